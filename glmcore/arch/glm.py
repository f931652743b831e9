"""The dense GLM block: ChatGLM2/3 and GLM-4 (THUDM's remote code, model_type "chatglm"), GLM-4-0414 and
GLM-Z1 (transformers' glm4) and GLM-Edge / the -hf conversions (transformers' glm).

One block with traits taken from config.json: the rotated part of each head (rotary_dim), the norms on
each sublayer's output (post_norms: glm4), QKV bias, a tied output layer. Rotary pairs are interleaved
(2i, 2i+1) in all of them.
"""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..errors import CheckpointError, ConfigError
from .base import MTP_NAMES, Architecture, Axis, Role, Split, TensorSpec, mtp_tensors, place_mtp


class GlmArchitecture(Architecture):
    name = "glm"
    model_types = ("chatglm", "glm", "glm4", "chatglm_6b", "chatglm6b")      # the last two: to refuse them
    title = "dense GLM: ChatGLM2/3, GLM-4, GLM-4-0414/Z1, GLM-Edge"
    torch_forward = "glm"
    synthetic_families = ("chatglm2", "chatglm3", "glm4", "glm4-0414", "glm-edge")
    # llama.cpp: "chatglm" (ChatGLM2/3, GLM-4-9B-chat and its -hf/GLM-Edge forms), "glm4" (GLM-4-0414, Z1)
    gguf_architectures = ("chatglm", "glm4")

    # ------------------------------------------------------------ config.json

    def parse_config(self, raw: dict, source: str, model_dir: Path | None) -> ModelConfig:
        if raw.get("model_type") in ("chatglm_6b", "chatglm6b"):
            raise ConfigError(f"{source}: ChatGLM-6B v1 (2-D positions) is not supported; use ChatGLM2/3 or GLM-4")
        if raw.get("model_type") == "chatglm":
            cfg = _from_chatglm(raw, model_dir)
        else:
            cfg = _from_hf_glm(raw, model_dir, source)
        return cfg.validated(source)

    # ------------------------------------------------------------ layout

    def tensors(self, cfg: ModelConfig) -> dict[str, TensorSpec]:
        h, norm = cfg.hidden_size, TensorSpec((cfg.hidden_size,), role=Role.NORM)
        t = {"embed.weight": TensorSpec((cfg.vocab_size, h), Split.VOCAB, role=Role.EMBEDDING)}
        for i in range(cfg.num_layers):
            t.update(layer_tensors(cfg, f"layers.{i}."))
        t["final_norm.weight"] = norm
        t["lm_head.weight"] = TensorSpec((cfg.vocab_size, h), Split.VOCAB, role=Role.OUTPUT)
        return t

    def optional_tensors(self, cfg: ModelConfig) -> dict[str, TensorSpec]:
        """A NextN layer (glmcore's extension for a dense checkpoint: the demo model's, trained here): GLM-4.5's
        parts -- the norms of the embedding and of the hidden state, their projection, one decoder layer of the
        model's kind, the shared head's norm -- stored after the decoder layers."""
        return mtp_tensors(cfg, lambda p: layer_tensors(cfg, p))

    def num_params(self, cfg: ModelConfig) -> int:
        h, f, L = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers
        qkv = h * (cfg.q_size + 2 * cfg.kv_size) + (cfg.q_size + 2 * cfg.kv_size) * cfg.qkv_bias
        layer = qkv + cfg.q_size * h + h * 2 * f + f * h + (4 if cfg.post_norms else 2) * h
        return (1 if cfg.tie_embeddings else 2) * cfg.vocab_size * h + L * layer + h

    # ------------------------------------------------------------ checkpoint names

    def to_canonical(self, raw: dict[str, np.ndarray], where: Path) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        hf_qkv: dict[tuple[str, str], dict[str, np.ndarray]] = {}
        hf_mlp: dict[str, dict[str, np.ndarray]] = {}
        for name, t in raw.items():
            if _IGNORED.search(name):
                continue
            if name in _CHATGLM_TOP:
                out[_CHATGLM_TOP[name]] = t
                continue
            if name in _HF_TOP:
                out[_HF_TOP[name]] = t
                continue
            m = re.fullmatch(r"transformer\.encoder\.layers\.(\d+)\.(.+)", name)
            if m and (canon := _CHATGLM_LAYER.get(m.group(2)) or MTP_NAMES.get(m.group(2))):
                out[f"layers.{m.group(1)}.{canon}"] = t       # past the decoder layers: a NextN layer (place_mtp)
                continue
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
            if m and (canon := _HF_LAYER.get(m.group(2)) or MTP_NAMES.get(m.group(2))):
                out[f"layers.{m.group(1)}.{canon}"] = t
                continue
            mq = re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)", name) if m else None
            if mq:
                hf_qkv.setdefault((mq.group(1), mq.group(3)), {})[mq.group(2)] = t
                continue
            mm = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.(gate|up)_proj\.weight", name) if m else None
            if mm:
                hf_mlp.setdefault(mm.group(1), {})[mm.group(2)] = t
                continue
            raise CheckpointError(f"{where}: unknown tensor name {name!r}; this is not a ChatGLM2/3, GLM-4 "
                                  "or transformers GLM checkpoint (or it is quantized, which is not supported)")
        # transformers' GLM splits the fused QKV projection; fuse it back (q rows, then k, then v).
        for (layer, kind), parts in hf_qkv.items():
            if f"layers.{layer}.qkv.{kind}" in out:
                raise CheckpointError(f"{where}: layer {layer} stores both a fused qkv_proj.{kind} and q/k/v_proj."
                                      f"{kind}; the checkpoint mixes two exports, re-download it")
            if set(parts) != {"q", "k", "v"}:
                raise CheckpointError(f"{where}: layer {layer} has only {sorted(parts)} of q/k/v_proj.{kind}; "
                                      "the checkpoint is incomplete")
            out[f"layers.{layer}.qkv.{kind}"] = _fuse(where, f"layer {layer}'s q/k/v_proj.{kind}",
                                                     [parts["q"], parts["k"], parts["v"]])
        # Separate gate_proj/up_proj (a llama-style export): fused as transformers' gate_up_proj (gate first).
        for layer, parts in hf_mlp.items():
            if set(parts) != {"gate", "up"} or f"layers.{layer}.ffn_up.weight" in out:
                raise CheckpointError(f"{where}: layer {layer} has {sorted(parts)} of mlp.gate/up_proj"
                                      f"{' beside a fused gate_up_proj' if set(parts) == {'gate', 'up'} else ''}; "
                                      "the checkpoint is incomplete or mixes two exports")
            out[f"layers.{layer}.ffn_up.weight"] = _fuse(where, f"layer {layer}'s gate/up_proj",
                                                        [parts["gate"], parts["up"]])
        return out

    # ------------------------------------------------------------ GGUF (llama.cpp's converter)

    def gguf_config(self, meta, shapes) -> ModelConfig:
        """llama.cpp's chatglm/glm4 keys. Its converter stores the rotated dims (rope.dimension_count) and the
        theta (10000 * rope_ratio); both rotate interleaved pairs (LLAMA_ROPE_TYPE_NORM), as glmcore does, so
        no weight is permuted back."""
        from ..gguf import gguf_family
        if "token_embd.weight" not in shapes:
            raise CheckpointError(f"{meta.source}: tensor token_embd.weight is missing; the file is incomplete")
        heads = meta.get("{arch}.attention.head_count", int)
        hidden = meta.get("{arch}.embedding_length", int)
        head_dim = meta.get("{arch}.attention.key_length", int, hidden // max(heads, 1))
        return ModelConfig(
            family=gguf_family(meta),
            hidden_size=hidden,
            num_layers=meta.get("{arch}.block_count", int),
            num_heads=heads,
            num_kv_heads=meta.get("{arch}.attention.head_count_kv", int, heads),
            head_dim=head_dim,
            ffn_hidden_size=meta.get("{arch}.feed_forward_length", int),
            vocab_size=shapes["token_embd.weight"][0],
            max_seq_len=meta.get("{arch}.context_length", int),
            rope_base=meta.get("{arch}.rope.freq_base", float, 10000.0),
            norm_eps=meta.get("{arch}.attention.layer_norm_rms_epsilon", float),
            qkv_bias="blk.0.attn_qkv.bias" in shapes or "blk.0.attn_q.bias" in shapes,
            linear_bias=False,
            name=meta.get("general.name", str, ""),
            rotary_dim=meta.get("{arch}.rope.dimension_count", int, head_dim // 2),
            post_norms=meta.arch == "glm4",
            tie_embeddings="output.weight" not in shapes,
            arch="glm", model_type="chatglm" if meta.arch == "chatglm" else "glm4",
        ).validated(meta.source)

    def gguf_to_canonical(self, cfg: ModelConfig, parts: dict, where: Path) -> dict:
        from ..gguf import stack
        out, qkv = {}, {}
        what = "GGUF architecture chatglm/glm4"
        for name, p, rest, part in gguf_layer_parts(parts, where, out, what):
            if rest in _GGUF_LAYER:
                out[p + _GGUF_LAYER[rest]] = stack(where, name, [part])
                continue
            mq = re.fullmatch(r"attn_([qkv])\.(weight|bias)", rest)
            if mq is None:
                raise unknown_gguf_tensor(where, name, what)
            qkv.setdefault((int(p.split(".")[1]), mq.group(2)), {})[mq.group(1)] = part
        for (layer, kind), q_k_v in qkv.items():      # llama.cpp keeps transformers' split q/k/v: fuse it back
            if set(q_k_v) != {"q", "k", "v"} or f"layers.{layer}.qkv.{kind}" in out:
                raise CheckpointError(f"{where}: layer {layer} has {sorted(q_k_v)} of attn_q/k/v.{kind}"
                                      f"{' beside attn_qkv' if set(q_k_v) == {'q', 'k', 'v'} else ''}; the file is "
                                      "incomplete or corrupt")
            out[f"layers.{layer}.qkv.{kind}"] = stack(where, f"layer {layer}'s attn_q/k/v.{kind}",
                                                      [q_k_v["q"], q_k_v["k"], q_k_v["v"]])
        return out

    def complete(self, cfg: ModelConfig, tensors: dict[str, np.ndarray], where: Path) -> None:
        if cfg.tie_embeddings and "embed.weight" in tensors:
            # Tied: the output layer is the embedding, whatever lm_head.weight a checkpoint also stores
            # (transformers ties them at load the same way).
            tensors["lm_head.weight"] = tensors["embed.weight"]
        elif "lm_head.weight" not in tensors and "embed.weight" in tensors:
            if cfg.model_type in ("glm", "glm4"):
                # transformers would initialise an untied, absent lm_head at random: nothing to run.
                raise CheckpointError(f"{where}: lm_head.weight is missing and config.json has "
                                      "tie_word_embeddings false; download the shard that holds it, or set "
                                      "tie_word_embeddings true if the model really shares its embedding")
            tensors["lm_head.weight"] = tensors["embed.weight"]     # ChatGLM exports that dropped a tied copy
        place_mtp(cfg, tensors, where)

    def stored_names(self, cfg: ModelConfig):
        if cfg.model_type in ("glm", "glm4"):
            return lambda n: {} if n == "lm_head.weight" and cfg.tie_embeddings else hf_names(mtp_as_layer(n, cfg),
                                                                                             cfg)
        return lambda n: {chatglm_name(mtp_as_layer(n, cfg)): None}

    # ------------------------------------------------------------ synthetic checkpoints

    def sizes(self, family: str) -> dict[str, dict]:
        return HF_SIZES[family] if family in HF_SIZES else SIZES

    def synthetic_config(self, family: str, size: str, layers: int | None, out: Path, tokenizer_from) -> dict:
        if family in HF_SIZES:
            return _hf_synthetic_config(family, size, layers, out, tokenizer_from)
        return _chatglm_synthetic_config(family, size, layers, out, tokenizer_from)


def layer_tensors(cfg: ModelConfig, p: str) -> dict[str, TensorSpec]:
    """One dense block's tensors under prefix p. Linear weights are [out, in] as in the checkpoints; the fused
    qkv holds q rows, then k, then v; ffn_up holds the gate rows, then the up rows (transformers' gate_up_proj:
    chunk(2), gate first)."""
    h, qkv = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size
    norm = TensorSpec((h,), role=Role.NORM)
    t = {p + "input_norm.weight": norm,
         p + "qkv.weight": TensorSpec((qkv, h), Split.COLUMN, Axis.QKV, role=Role.QUERY_KEY)}
    if cfg.qkv_bias:
        t[p + "qkv.bias"] = TensorSpec((qkv,), Split.COLUMN, Axis.QKV, role=Role.BIAS)
    t[p + "attn_out.weight"] = TensorSpec((h, cfg.q_size), Split.ROW, Axis.HEADS)
    if cfg.post_norms:
        t[p + "post_self_attn_norm.weight"] = norm     # on the attention output, before the add
    t[p + "post_attn_norm.weight"] = norm
    t[p + "ffn_up.weight"] = TensorSpec((2 * cfg.ffn_hidden_size, h), Split.COLUMN, Axis.FFN, blocks=2)
    t[p + "ffn_down.weight"] = TensorSpec((h, cfg.ffn_hidden_size), Split.ROW, Axis.FFN)
    if cfg.post_norms:
        t[p + "post_mlp_norm.weight"] = norm           # on the MLP output, before the add
    return t


# ---------------------------------------------------------------- config.json forms

def _from_chatglm(raw: dict, model_dir: Path | None) -> ModelConfig:
    if raw.get("position_encoding_2d") or "inner_hidden_size" in raw:
        raise ConfigError("config.json: ChatGLM-6B v1 (2-D positions) is not supported; use ChatGLM2/3 or GLM-4")
    if not raw.get("rmsnorm", True) or raw.get("apply_residual_connection_post_layernorm", False):
        raise ConfigError("config.json: only rmsnorm=true, apply_residual_connection_post_layernorm=false is supported")
    heads = raw["num_attention_heads"]
    return ModelConfig(
        family=_chatglm_family(raw, model_dir),
        hidden_size=raw["hidden_size"],
        num_layers=raw["num_layers"],
        num_heads=heads,
        num_kv_heads=raw["multi_query_group_num"] if raw.get("multi_query_attention") else heads,
        head_dim=raw.get("kv_channels", raw["hidden_size"] // heads),
        ffn_hidden_size=raw["ffn_hidden_size"],
        vocab_size=raw["padded_vocab_size"],
        max_seq_len=raw["seq_length"],
        rope_base=10000.0 * float(raw.get("rope_ratio", 1.0)),
        norm_eps=raw["layernorm_epsilon"],
        qkv_bias=raw.get("add_qkv_bias", True),
        linear_bias=raw.get("add_bias_linear", False),
        name=raw.get("_name_or_path", ""),
        arch="glm", model_type="chatglm",
        num_mtp_layers=raw.get("num_nextn_predict_layers", 0),      # glmcore's extension (the demo's NextN layer)
    )


def _chatglm_family(raw: dict, model_dir: Path | None) -> str:
    """ChatGLM2, ChatGLM3 and GLM-4 share model_type 'chatglm'; tell them apart by vocabulary and name."""
    from ..tokenizer import is_tiktoken_file
    if raw["padded_vocab_size"] >= 150000:
        return "glm4"
    if model_dir is not None and is_tiktoken_file(model_dir / "tokenizer.model"):
        return "glm4"
    names = [raw.get("_name_or_path", "")]
    if model_dir is not None and (model_dir / "tokenizer_config.json").is_file():
        try:
            names.append(json.loads((model_dir / "tokenizer_config.json").read_text()).get("name_or_path", ""))
        except (ValueError, OSError, AttributeError):
            pass    # load_tokenizer reports a broken tokenizer_config.json
    return "chatglm2" if any("chatglm2" in str(n).lower() for n in names) else "chatglm3"


# transformers' GlmConfig/Glm4Config defaults, used exactly where the file leaves a key out (so that a
# config.json means what it means to transformers).
HF_DEFAULTS = {"num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 131072,
               "rms_norm_eps": 1.5625e-07, "attention_bias": True, "tie_word_embeddings": False,
               "partial_rotary_factor": 0.5, "rope_theta": 10000.0, "hidden_act": "silu"}
_GLM4_9B_CHAT_VOCAB = 151552


def hf_rope(raw: dict, source: str, defaults: dict) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) of a transformers config: transformers 5 nests the rope keys in
    rope_parameters, 4.x has them at the top (rope_scaling for types). Only the default rotary is run."""
    for key in ("rope_parameters", "rope_scaling"):
        if not isinstance(raw.get(key) or {}, dict):
            raise ConfigError(f"{source}: {key} is not an object of rope settings; restore the file from the "
                              "original checkpoint")
    rope = {k: raw[k] for k in ("rope_theta", "partial_rotary_factor") if k in raw}
    rope.update(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ConfigError(f"{source}: rope_type {rope_type!r} is not supported (only the default rotary); "
                          "use a checkpoint without rope scaling")
    factor = float(rope.get("partial_rotary_factor", defaults["partial_rotary_factor"]))
    if not 0 < factor <= 1:
        raise ConfigError(f"{source}: partial_rotary_factor {factor} must be in (0, 1] (the part of each head "
                          "that rotates); restore the file from the original checkpoint")
    return float(rope.get("rope_theta", defaults["rope_theta"])), factor


def _from_hf_glm(raw: dict, model_dir: Path | None, source: str) -> ModelConfig:
    """transformers' glm (GlmForCausalLM) and glm4 (Glm4ForCausalLM) config.json: every number from its
    own keys. The two differ only by glm4's two extra norms per layer."""
    def get(key):
        v = raw.get(key, HF_DEFAULTS.get(key))
        if v is None and key not in HF_DEFAULTS:
            raise KeyError(key)
        return v

    heads = raw["num_attention_heads"]
    head_dim = get("head_dim") or raw["hidden_size"] // heads     # null: transformers' hidden/heads fallback
    if get("hidden_act") != "silu":
        raise ConfigError(f"{source}: hidden_act {raw.get('hidden_act')!r} is not supported; GLM models use silu")
    theta, factor = hf_rope(raw, source, HF_DEFAULTS)
    if "rope_ratio" in raw:            # a chatglm-style key left in by a converter: it is what the model trained with
        theta = 10000.0 * float(raw["rope_ratio"])
    vocab = raw["vocab_size"]
    if (raw["model_type"] == "glm" and theta == 10000.0 and raw.get("max_position_embeddings") == 131072
            and vocab == _GLM4_9B_CHAT_VOCAB and factor == 0.5):
        # glm-4-9b-chat trained with rope_ratio 500, and some conversions of it to the glm layout wrote 10000.
        # transformers runs the stored value, and so do we; a real glm4 checkpoint (GLM-Z1-Rumination-32B)
        # has exactly this theta and context, so nothing is changed, only said.
        warnings.warn(f"{source}: rope_theta 10000 on a 128k glm-4-9b-chat conversion; the original trained "
                      "with rope_ratio 500 (rope_theta 5000000): if its long-context output is poor, set "
                      "\"rope_theta\": 5000000.0 in config.json")
    return ModelConfig(
        family=_hf_family(raw["model_type"], model_dir),
        hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=get("num_key_value_heads"),
        head_dim=head_dim,
        ffn_hidden_size=raw["intermediate_size"],
        vocab_size=vocab,
        max_seq_len=get("max_position_embeddings"),
        rope_base=theta,
        norm_eps=get("rms_norm_eps"),
        qkv_bias=get("attention_bias"),
        linear_bias=False,
        name=raw.get("_name_or_path", ""),
        rotary_dim=int(head_dim * factor),      # transformers: dim = int(head_dim * partial_rotary_factor)
        post_norms=raw["model_type"] == "glm4",
        tie_embeddings=get("tie_word_embeddings"),
        arch="glm", model_type=raw["model_type"],
    )


def _hf_family(model_type: str, model_dir: Path | None) -> str:
    from ..tokenizer import is_tiktoken_file
    if model_type == "glm4":
        return "glm4-0414"
    # A glm-layout conversion of glm-4-9b-chat that kept the original tiktoken tokenizer.model (and no
    # tokenizer.json) uses GLM-4's native tokenizer and chat format.
    if model_dir is not None and not (model_dir / "tokenizer.json").is_file() \
            and is_tiktoken_file(model_dir / "tokenizer.model"):
        return "glm4"
    return "glm-edge"


# ---------------------------------------------------------------- checkpoint names

_CHATGLM_LAYER = {
    "input_layernorm.weight": "input_norm.weight",
    "self_attention.query_key_value.weight": "qkv.weight",
    "self_attention.query_key_value.bias": "qkv.bias",
    "self_attention.dense.weight": "attn_out.weight",
    "post_attention_layernorm.weight": "post_attn_norm.weight",
    "mlp.dense_h_to_4h.weight": "ffn_up.weight",
    "mlp.dense_4h_to_h.weight": "ffn_down.weight",
}
_CHATGLM_TOP = {
    "transformer.embedding.word_embeddings.weight": "embed.weight",
    "transformer.encoder.final_layernorm.weight": "final_norm.weight",
    "transformer.output_layer.weight": "lm_head.weight",
}
_HF_LAYER = {
    "input_layernorm.weight": "input_norm.weight",
    "self_attn.o_proj.weight": "attn_out.weight",
    "post_attention_layernorm.weight": "post_attn_norm.weight",
    "post_self_attn_layernorm.weight": "post_self_attn_norm.weight",
    "post_mlp_layernorm.weight": "post_mlp_norm.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.qkv_proj.weight": "qkv.weight",          # vLLM-style fused exports
    "self_attn.qkv_proj.bias": "qkv.bias",
}
_HF_TOP = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "final_norm.weight",
           "lm_head.weight": "lm_head.weight"}
# llama.cpp's names of the tensors outside the layers (every GLM layout)
GGUF_TOP = {"token_embd.weight": "embed.weight", "output_norm.weight": "final_norm.weight",
             "output.weight": "lm_head.weight"}


def gguf_layer_parts(parts: dict, where: Path, out: dict, what: str):
    """llama.cpp's tensors outside the layers into out (canonical), rope_freqs skipped (a buffer some converters
    write; the rotary is computed); yields (name, "layers.N.", rest, part) for each blk.N.rest. Any other name is
    a CheckpointError naming `what` (the GGUF architecture)."""
    from ..gguf import stack
    for name, part in parts.items():
        if name in GGUF_TOP:
            out[GGUF_TOP[name]] = stack(where, name, [part])
        elif name != "rope_freqs.weight":
            m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
            if m is None:
                raise unknown_gguf_tensor(where, name, what)
            yield name, f"layers.{int(m.group(1))}.", m.group(2), part


def unknown_gguf_tensor(where: Path, name: str, what: str) -> CheckpointError:
    return CheckpointError(f"{where}: unknown tensor {name!r} for {what}; the file is not a GLM model llama.cpp wrote")


# llama.cpp's names (gguf-py's TensorNameMap for chatglm/glm4) -> canonical; attn_q/k/v are fused in code.
_GGUF_LAYER = {
    "attn_norm.weight": "input_norm.weight",
    "attn_qkv.weight": "qkv.weight",
    "attn_qkv.bias": "qkv.bias",
    "attn_output.weight": "attn_out.weight",
    "ffn_norm.weight": "post_attn_norm.weight",
    "ffn_up.weight": "ffn_up.weight",              # the fused gate|up (dense_h_to_4h, gate_up_proj), gate first
    "ffn_down.weight": "ffn_down.weight",
    "post_attention_norm.weight": "post_self_attn_norm.weight",    # glm4: post_self_attn_layernorm
    "post_ffw_norm.weight": "post_mlp_norm.weight",                # glm4: post_mlp_layernorm
}
# Buffers some checkpoints carry that the math does not need.
_IGNORED = re.compile(r"(rotary_pos_emb\.inv_freq|rotary_emb\.inv_freq)$")


def _fuse(where: Path, what: str, parts: list[np.ndarray]) -> np.ndarray:
    try:
        return np.concatenate(parts, axis=0)
    except ValueError:
        raise CheckpointError(f"{where}: {what} have mismatched shapes {[tuple(p.shape) for p in parts]}; the "
                              "checkpoint is corrupt") from None


def hf_names(canonical: str, cfg: ModelConfig) -> dict[str, slice | None]:
    """transformers' glm/glm4 checkpoint names of a canonical tensor, each with the rows of the canonical
    tensor it holds (None: all): the fused QKV is stored as q_proj/k_proj/v_proj. Used when writing."""
    inv_top = {v: k for k, v in _HF_TOP.items()}
    if canonical in inv_top:
        return {inv_top[canonical]: None}
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", canonical)
    p = f"model.layers.{m.group(1)}."
    if m.group(2) in ("qkv.weight", "qkv.bias"):
        kind = m.group(2).split(".")[1]
        q, kv = cfg.q_size, cfg.kv_size
        return {p + f"self_attn.q_proj.{kind}": slice(0, q), p + f"self_attn.k_proj.{kind}": slice(q, q + kv),
                p + f"self_attn.v_proj.{kind}": slice(q + kv, q + 2 * kv)}
    inv = {**{v: k for k, v in MTP_NAMES.items()}, **{v: k for k, v in _HF_LAYER.items() if "qkv_proj" not in k}}
    return {p + inv[m.group(2)]: None}


def mtp_as_layer(canonical: str, cfg: ModelConfig) -> str:
    """A NextN layer's canonical name as the layer it is stored as (mtp.J.x -> layers.{num_layers + J}.x)."""
    m = re.fullmatch(r"mtp\.(\d+)\.(layer\.)?(.+)", canonical)
    return f"layers.{cfg.num_layers + int(m.group(1))}.{m.group(3)}" if m else canonical


def chatglm_name(canonical: str) -> str:
    """The ChatGLM checkpoint name of a canonical tensor (used when writing checkpoints)."""
    for k, v in _CHATGLM_TOP.items():
        if v == canonical:
            return k
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", canonical)
    inv = {**{v: k for k, v in MTP_NAMES.items()}, **{v: k for k, v in _CHATGLM_LAYER.items()}}
    return f"transformer.encoder.layers.{m.group(1)}.{inv[m.group(2)]}"


# ---------------------------------------------------------------- synthetic sizes and config.json keys

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
HF_KEYS = {
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
CHATGLM_KEYS = {
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
FAMILY_KEYS = {
    "chatglm2": {"seq_length": 32768, "torch_dtype": "float16", "eos_token_id": 2, "pad_token_id": 0},
    "chatglm3": {"seq_length": 8192, "torch_dtype": "float16", "eos_token_id": 2, "pad_token_id": 0},
    "glm4": {"seq_length": 131072, "torch_dtype": "bfloat16", "eos_token_id": [151329, 151336, 151338],
             "pad_token_id": 151329, "rope_ratio": 500, "layernorm_epsilon": 1.5625e-07, "classifier_dropout": None},
}


def _chatglm_synthetic_config(family, size, layers, out: Path, tokenizer_from) -> dict:
    from ..errors import GlmcoreError
    from ..tokenizer import load_tokenizer, write_tokenizer
    if size == "9b" and family in ("chatglm2", "chatglm3"):
        raise GlmcoreError(f"size 9b is GLM-4-9B's shape, which no {family} has; use --family glm4 (GLM-4-9B-chat) "
                           "or glm4-0414 (GLM-4-9B-0414)")
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
    raw = {"_name_or_path": f"glmcore-synthetic/{name.split('/')[1]}-{size}", **CHATGLM_KEYS, **spec,
           **FAMILY_KEYS[family], "padded_vocab_size": vocab}
    if family == "glm4":
        raw["num_hidden_layers"] = raw["num_layers"]
        raw["vocab_size"] = vocab
        # A synthetic vocabulary numbers its special tokens after its own ranks.
        raw["eos_token_id"] = [tok.eos_id, tok.special_ids["<|user|>"], tok.special_ids["<|observation|>"]]
        raw["pad_token_id"] = tok.pad_id
    return raw


def _hf_synthetic_config(family, size, layers, out: Path, tokenizer_from) -> dict:
    """transformers' layout: the published keys, and tokenizer.json + tokenizer_config.json (with the family's
    chat template) from GLM-4's synthetic rank file; generation_config.json beside them."""
    from ..errors import GlmcoreError
    from ..hf_tokenizer import GLM4_0414_TEMPLATE, GLM_EDGE_TEMPLATE
    from ..tokenizer import DEFAULT_GLM4_RANKS, GLM4_RANKS_FILE, GLM4_SPECIALS, read_rank_file
    if tokenizer_from is not None:
        raise GlmcoreError(f"--tokenizer-from copies a tokenizer.model; {family} checkpoints ship tokenizer.json, "
                           "copy it (with tokenizer_config.json) into the written directory instead")
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
    raw = {"_name_or_path": f"glmcore-synthetic/{name.split('/')[1]}-{size}", **HF_KEYS[family], **spec,
           "vocab_size": vocab}
    write_synthetic_tokenizer(out, raw, ranks, GLM4_SPECIALS, template, prefix)
    return raw


def write_synthetic_tokenizer(out: Path, raw: dict, ranks: dict, specials: list[str], template: str,
                              prefix: list[str] | None) -> None:
    """tokenizer.json + tokenizer_config.json (the given chat template) + generation_config.json of a synthetic
    tokenizer.json checkpoint; its stop and pad ids go into raw (config.json's keys)."""
    from ..hf_tokenizer import write_hf_tokenizer
    write_hf_tokenizer(out, ranks, specials, template, prefix, name=raw["_name_or_path"],
                       max_length=raw["max_position_embeddings"])
    ids = {t: len(ranks) + i for i, t in enumerate(specials)}
    eos = [ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]]
    raw.update(eos_token_id=eos, pad_token_id=ids["<|endoftext|>"])
    (out / "generation_config.json").write_text(json.dumps(
        {"_from_model_config": True, "eos_token_id": eos, "pad_token_id": ids["<|endoftext|>"],
         "transformers_version": raw["transformers_version"]}, indent=2) + "\n")


GLM = GlmArchitecture()
