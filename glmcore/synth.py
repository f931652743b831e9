"""Synthetic checkpoints in each family's real on-disk layout, at any size from tiny to 6B.

No weights can be downloaded here, so the project makes its own: config.json with the real keys,
sharded safetensors or PyTorch .bin with the real index file and tensor names, and a real tokenizer.
"""
from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .errors import GlmcoreError
from .weights import BF16, canonical_shapes, chatglm_name, hf_names, write_safetensors

# Architecture sizes. 6b is the real ChatGLM3-6B shape. tiny and small use the synthetic tokenizer's
# vocabulary (small: ~100M parameters); 1b and 6b the family's real padded vocabulary, so their
# embedding and output layers cost what the real ones do.
SIZES = {
    "tiny": dict(hidden_size=64, num_layers=2, num_attention_heads=4, multi_query_group_num=2,
                 kv_channels=16, ffn_hidden_size=160, vocab="tokenizer"),
    "small": dict(hidden_size=768, num_layers=14, num_attention_heads=12, multi_query_group_num=2,
                  kv_channels=64, ffn_hidden_size=2560, vocab="tokenizer"),
    "1b": dict(hidden_size=2048, num_layers=24, num_attention_heads=16, multi_query_group_num=2,
               kv_channels=128, ffn_hidden_size=5632, vocab="real"),
    "6b": dict(hidden_size=4096, num_layers=28, num_attention_heads=32, multi_query_group_num=2,
               kv_channels=128, ffn_hidden_size=13696, vocab="real"),
    # GLM-4-9B-chat's shape (family glm4 only: no ChatGLM2/3 has it)
    "9b": dict(hidden_size=4096, num_layers=40, num_attention_heads=32, multi_query_group_num=2,
               kv_channels=128, ffn_hidden_size=13696, vocab="real"),
}
REAL_VOCAB = {"chatglm2": 65024, "chatglm3": 65024, "glm4": 151552, "glm4-0414": 151552, "glm-edge": 59264}

# transformers' glm4 (GLM-4-0414 / Z1) and glm (GLM-Edge) layouts: sizes by config.json key. 9b is
# GLM-4-9B-0414's shape, 32b GLM-4-32B-0414's (61 layers: use --layers N for a few of them), edge's 1b
# GLM-Edge-1.5B-chat's.
_HF_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=160, vocab="tokenizer")
HF_SIZES = {
    "glm4-0414": {
        "tiny": _HF_TINY,
        "small": dict(hidden_size=768, num_hidden_layers=14, num_attention_heads=12, num_key_value_heads=2,
                      head_dim=64, intermediate_size=2560, vocab="tokenizer"),
        "1b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=2,
                   head_dim=128, intermediate_size=5632, vocab="real"),
        "9b": dict(hidden_size=4096, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=2,
                   head_dim=128, intermediate_size=13696, vocab="real"),
        "32b": dict(hidden_size=6144, num_hidden_layers=61, num_attention_heads=48, num_key_value_heads=2,
                    head_dim=128, intermediate_size=23040, vocab="real"),
    },
    "glm-edge": {
        "tiny": _HF_TINY,
        "small": dict(hidden_size=768, num_hidden_layers=14, num_attention_heads=12, num_key_value_heads=4,
                      head_dim=64, intermediate_size=2304, vocab="tokenizer"),
        "1b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=4,
                   head_dim=128, intermediate_size=6144, vocab="real"),
    },
}
# The published config.json keys (GLM-4-9B-0414, glm-edge-1.5b-chat), sizes replaced per --size.
_HF_KEYS = {
    "glm4-0414": {"architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "attention_bias": True,
                  "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
                  "max_position_embeddings": 32768, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05,
                  "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                  "transformers_version": "4.51.3", "use_cache": True},
    "glm-edge": {"architectures": ["GlmForCausalLM"], "model_type": "glm", "attention_bias": False,
                 "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
                 "max_position_embeddings": 8192, "partial_rotary_factor": 1.0, "rms_norm_eps": 1e-05,
                 "rope_theta": 10000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
                 "transformers_version": "4.47.0.dev0", "use_cache": True},
}
_HF_NAMES = {"glm4-0414": "THUDM/GLM-4-9B-0414", "glm-edge": "THUDM/glm-edge-1.5b-chat"}

# The real config.json keys of each family (values as published, sizes replaced per --size).
_CHATGLM_KEYS = {
    "model_type": "chatglm", "architectures": ["ChatGLMModel"],
    "auto_map": {"AutoConfig": "configuration_chatglm.ChatGLMConfig",
                 "AutoModel": "modeling_chatglm.ChatGLMForConditionalGeneration",
                 "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
                 "AutoModelForSeq2SeqLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
                 "AutoModelForSequenceClassification": "modeling_chatglm.ChatGLMForSequenceClassification"},
    "add_bias_linear": False, "add_qkv_bias": True, "apply_query_key_layer_scaling": True,
    "apply_residual_connection_post_layernorm": False, "attention_dropout": 0.0,
    "attention_softmax_in_fp32": True, "bias_dropout_fusion": True, "fp32_residual_connection": False,
    "hidden_dropout": 0.0, "layernorm_epsilon": 1e-05, "multi_query_attention": True,
    "original_rope": True, "post_layer_norm": True, "rmsnorm": True, "use_cache": True,
    "tie_word_embeddings": False,
}
_FAMILY_KEYS = {
    "chatglm2": {"seq_length": 32768, "torch_dtype": "float16", "eos_token_id": 2, "pad_token_id": 0},
    "chatglm3": {"seq_length": 8192, "torch_dtype": "float16", "eos_token_id": 2, "pad_token_id": 0},
    "glm4": {"seq_length": 131072, "torch_dtype": "bfloat16", "eos_token_id": [151329, 151336, 151338],
             "pad_token_id": 151329, "rope_ratio": 500, "layernorm_epsilon": 1.5625e-07, "classifier_dropout": None},
}
DTYPES = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "bf16": BF16}


def make_model(family: str, size: str, out: str | Path, fmt: str = "safetensors", shards: int | None = None,
               seed: int = 0, tokenizer_from: str | Path | None = None, dtype: str | None = None,
               progress: Callable[[str], None] | None = None, layers: int | None = None) -> ModelConfig:
    if family not in REAL_VOCAB:
        raise GlmcoreError(f"unknown family {family!r}; choose {', '.join(REAL_VOCAB)}")
    sizes = HF_SIZES.get(family, SIZES)
    if size not in sizes:
        raise GlmcoreError(f"unknown size {size!r} for {family}; choose {', '.join(sizes)}")
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
        raise GlmcoreError(f"invalid --layers {layers}: use a positive integer")
    if tokenizer_from is not None and family in HF_SIZES:
        raise GlmcoreError(f"--tokenizer-from copies a tokenizer.model; {family} checkpoints ship tokenizer.json, "
                           "copy it (with tokenizer_config.json) into the written directory instead")
    if fmt not in ("safetensors", "bin"):
        raise GlmcoreError(f"unknown format {fmt!r}; choose safetensors or bin")
    if shards is not None and (isinstance(shards, bool) or not isinstance(shards, int) or shards < 1):
        raise GlmcoreError(f"invalid --shards {shards}: use a positive integer")
    from .cache import build_once, new_output_dir
    # Written beside `out` and renamed into place: a user's files are never overwritten, and a failed
    # or interrupted run leaves nothing behind.
    cfg: list[ModelConfig] = []
    build_once(new_output_dir(out), lambda tmp: cfg.append(_write_model(family, size, tmp, fmt, shards, seed,
                                                                       tokenizer_from, dtype, progress, layers)),
               complete=lambda p: False)
    return cfg[0]


def _write_model(family, size, out: Path, fmt, shards, seed, tokenizer_from, dtype, progress,
                 layers: int | None = None) -> ModelConfig:
    if family in HF_SIZES:
        return _write_hf_model(family, size, out, fmt, shards, seed, dtype, progress, layers)
    if size == "9b" and family in ("chatglm2", "chatglm3"):
        raise GlmcoreError(f"size 9b is GLM-4-9B's shape, which no {family} has; use --family glm4 (GLM-4-9B-chat) "
                           "or glm4-0414 (GLM-4-9B-0414)")
    from .tokenizer import load_tokenizer, write_tokenizer
    n_vocab = write_tokenizer(family, out, tokenizer_from=tokenizer_from)
    tok = load_tokenizer(out, family)

    spec = dict(SIZES[size])
    if layers is not None:
        spec["num_layers"] = layers
    real = spec.pop("vocab") == "real" or tokenizer_from
    vocab = REAL_VOCAB[family] if real else -(-n_vocab // 64) * 64
    if vocab < n_vocab:
        raise GlmcoreError(f"tokenizer has {n_vocab} ids but the model only {vocab} rows")
    name = {"chatglm2": "THUDM/chatglm2-6b", "chatglm3": "THUDM/chatglm3-6b", "glm4": "THUDM/glm-4-9b-chat"}[family]
    raw = {"_name_or_path": f"glmcore-synthetic/{name.split('/')[1]}-{size}", **_CHATGLM_KEYS, **spec,
           **_FAMILY_KEYS[family], "padded_vocab_size": vocab}
    if family == "glm4":
        raw["num_hidden_layers"] = raw["num_layers"]
        raw["vocab_size"] = vocab
        # A synthetic vocabulary numbers its special tokens after its own ranks.
        raw["eos_token_id"] = [tok.eos_id, tok.special_ids["<|user|>"], tok.special_ids["<|observation|>"]]
        raw["pad_token_id"] = tok.pad_id
    raw["glmcore_synthetic"] = {"family": family, "size": size, "seed": seed, "note": "random weights"}
    (out / "config.json").write_text(json.dumps(raw, indent=2, ensure_ascii=False) + "\n")
    cfg = ModelConfig.from_dir(out)

    return _write_weights(cfg, out, size, fmt, shards, seed, dtype, progress,
                          lambda n: {chatglm_name(n): None})


def _write_hf_model(family, size, out: Path, fmt, shards, seed, dtype, progress, layers) -> ModelConfig:
    """transformers' layout: config.json/generation_config.json with the published keys, q/k/v_proj split,
    gate_up_proj fused, the glm4 post norms, no lm_head where the embeddings are tied; tokenizer.json and
    tokenizer_config.json (with the family's chat template) from GLM-4's synthetic rank file."""
    from .hf_tokenizer import GLM4_0414_TEMPLATE, GLM_EDGE_TEMPLATE, write_hf_tokenizer
    from .tokenizer import DEFAULT_GLM4_RANKS, GLM4_RANKS_FILE, GLM4_SPECIALS, read_rank_file
    spec = dict(HF_SIZES[family][size])
    if layers is not None:
        spec["num_hidden_layers"] = layers
    ranks = read_rank_file(GLM4_RANKS_FILE)
    ranks = {t: r for t, r in ranks.items() if r < DEFAULT_GLM4_RANKS}
    n_vocab = len(ranks) + len(GLM4_SPECIALS)
    vocab = REAL_VOCAB[family] if spec.pop("vocab") == "real" else -(-n_vocab // 64) * 64
    name = _HF_NAMES[family]
    prefix = ["[gMASK]", "<sop>"] if family == "glm4-0414" else None
    template = GLM4_0414_TEMPLATE if family == "glm4-0414" else GLM_EDGE_TEMPLATE
    raw = {"_name_or_path": f"glmcore-synthetic/{name.split('/')[1]}-{size}", **_HF_KEYS[family], **spec,
           "vocab_size": vocab}
    write_hf_tokenizer(out, ranks, GLM4_SPECIALS, template, prefix, name=raw["_name_or_path"],
                       max_length=raw["max_position_embeddings"])
    ids = {t: len(ranks) + i for i, t in enumerate(GLM4_SPECIALS)}
    eos = [ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]]
    raw.update(eos_token_id=eos, pad_token_id=ids["<|endoftext|>"])
    raw["glmcore_synthetic"] = {"family": family, "size": size, "seed": seed, "note": "random weights"}
    (out / "config.json").write_text(json.dumps(raw, indent=2, ensure_ascii=False) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"_from_model_config": True, "eos_token_id": eos, "pad_token_id": ids["<|endoftext|>"],
         "transformers_version": raw["transformers_version"]}, indent=2) + "\n")
    cfg = ModelConfig.from_dir(out)
    return _write_weights(cfg, out, size, fmt, shards, seed, dtype, progress,
                          lambda n: {} if n == "lm_head.weight" and cfg.tie_embeddings else hf_names(n, cfg))


def _write_weights(cfg: ModelConfig, out: Path, size, fmt, shards, seed, dtype, progress, names) -> ModelConfig:
    """The canonical tensors under their checkpoint names: names(canonical) -> {stored name: rows or None}."""
    np_dtype = DTYPES[dtype or ("f32" if size in ("tiny", "small") else "bf16")]
    shapes = canonical_shapes(cfg)
    if not names("lm_head.weight"):
        del shapes["lm_head.weight"]        # tied: the checkpoint stores the embedding once
    total = sum(int(np.prod(s)) for s in shapes.values()) * np_dtype.itemsize
    if shards is None:
        shards = 2 if size == "tiny" else max(1, -(-total // (2 << 30)))
    if shards > len(shapes):
        raise GlmcoreError(f"invalid --shards {shards}: this model has only {len(shapes)} tensors")
    groups = _split(list(shapes), shapes, shards, np_dtype.itemsize)
    ext = "safetensors" if fmt == "safetensors" else "bin"
    stem = "model" if fmt == "safetensors" else "pytorch_model"
    weight_map = {}
    for k, group in enumerate(groups, 1):
        fname = f"{stem}.{ext}" if shards == 1 else f"{stem}-{k:05d}-of-{shards:05d}.{ext}"
        tensors = {}
        for n in group:
            parts = names(n)
            if not parts:
                continue
            t = init_tensor(n, shapes[n], cfg, seed).astype(np_dtype)
            tensors.update({stored: t if rows is None else t[rows] for stored, rows in parts.items()})
        _write(out / fname, tensors, fmt)
        weight_map.update({t: fname for t in tensors})
        if progress:
            progress(f"wrote {fname} ({k}/{shards})")
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / f"{stem}.{ext}.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return cfg


def cached_model(family: str, size: str, seed: int = 0, purpose: str = "models") -> Path:
    """A synthetic checkpoint in the cache directory, made on first use."""
    from .cache import build_once, cache_root
    return build_once(cache_root() / purpose / f"{family}-{size}-seed{seed}",
                      lambda tmp: _write_model(family, size, tmp, "safetensors", None, seed, None, None, None),
                      complete=lambda p: (p / "config.json").is_file())


def init_tensor(name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int) -> np.ndarray:
    """Deterministic per tensor (independent of sharding). Scales are chosen so attention is sharp and
    logits are peaked, as in a trained model: precision errors then show up in top-1 agreement, and a
    positional bug (rotary off by one) changes the output visibly."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    h = cfg.hidden_size
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    if name.endswith("qkv.bias"):
        return 0.2 * rng.standard_normal(shape, dtype=np.float32)
    if name == "embed.weight":
        return rng.standard_normal(shape, dtype=np.float32)
    if name.endswith("qkv.weight"):
        std = 1.6 / np.sqrt(h)        # q.k/sqrt(d) ~ N(0, 2.5): sharp, position-dependent attention
    elif name == "lm_head.weight":
        std = 6.0 / np.sqrt(h)        # logits ~ N(0, 36): a confident next-token distribution
    else:
        std = 1.0 / np.sqrt(shape[1])  # keeps each residual update around unit scale
    return (std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)


def _split(names, shapes, n, itemsize):
    sizes = [int(np.prod(shapes[k])) * itemsize for k in names]
    target = sum(sizes) / n
    groups, cur, acc = [], [], 0
    for name, s in zip(names, sizes):
        if cur and acc + s / 2 > target * (len(groups) + 1) and len(groups) < n - 1:
            groups.append(cur)
            cur = []
        cur.append(name)
        acc += s
    groups.append(cur)
    while len(groups) < n:      # more shards than tensors: never happens for real sizes
        groups.append([])
    return groups


def _write(path: Path, tensors: dict[str, np.ndarray], fmt: str) -> None:
    if fmt == "safetensors":
        write_safetensors(path, tensors, {"format": "pt"})
        return
    try:
        import torch
    except ImportError:
        raise GlmcoreError('writing .bin checkpoints needs torch: pip install torch==2.13.0 (CPU build), '
                           'or use --format safetensors') from None
    state = {}
    for k, v in tensors.items():
        t = torch.from_numpy(np.ascontiguousarray(v.view(np.uint16) if v.dtype == BF16 else v))
        state[k] = t.view(torch.bfloat16) if v.dtype == BF16 else t
    torch.save(state, path)
