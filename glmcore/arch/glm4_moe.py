"""GLM-4.5 / 4.5-Air / 4.6 / 4.7 (transformers' glm4_moe, Glm4MoeForCausalLM): the Mixture-of-Experts GLM.

Each layer: RMSNorm -> attention (q/k/v bias, per-head q/k RMSNorm where use_qk_norm, rotary on the first
head_dim * partial_rotary_factor dims in NeoX order) -> residual -> RMSNorm -> a dense SwiGLU MLP (layers below
first_k_dense_replace) or the MoE block -> residual. The MoE block, as
transformers computes it: scores = sigmoid(x W_router^T) in fp32; e_score_correction_bias is added only to
choose the top-k experts (after limiting to topk_group of n_group groups); the chosen experts' unbiased scores,
divided by their sum (+1e-20) when norm_topk_prob, times routed_scaling_factor, weight their SwiGLU outputs; the
shared expert's output is added.

The multi-token-prediction (NextN) layers stored at indices num_hidden_layers.. are loaded under `mtp.J.*`
(kept for speculative decoding; never run as decoder layers) when the checkpoint has them.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..errors import CheckpointError, ConfigError
from .base import MTP_NAMES, Architecture, Axis, Role, Split, TensorSpec, mtp_tensors, place_mtp
from .glm import gguf_layer_parts, hf_rope, unknown_gguf_tensor, write_synthetic_tokenizer

# transformers' Glm4MoeConfig defaults, used exactly where config.json leaves a key out.
DEFAULTS = {"vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
            "num_attention_heads": 96, "num_key_value_heads": 8, "partial_rotary_factor": 0.5, "hidden_act": "silu",
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "rope_theta": 10000.0, "attention_bias": False, "moe_intermediate_size": 1408, "num_experts_per_tok": 8,
            "n_shared_experts": 1, "n_routed_experts": 128, "routed_scaling_factor": 1.0, "n_group": 1,
            "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True, "use_qk_norm": False,
            "num_nextn_predict_layers": 1}


@dataclass(frozen=True)
class MoeConfig(ModelConfig):
    """The dense fields describe attention, embeddings and the dense layers' MLP (ffn_hidden_size =
    intermediate_size); these describe the experts."""
    moe_ffn_hidden_size: int = 0          # each expert's SwiGLU width (moe_intermediate_size)
    num_experts: int = 0                  # n_routed_experts
    experts_per_token: int = 0            # num_experts_per_tok
    num_shared_experts: int = 0           # the shared expert is one SwiGLU of moe_ffn_hidden_size * this
    routed_scaling: float = 1.0
    num_groups: int = 1                   # n_group / topk_group: group-limited routing
    topk_groups: int = 1
    norm_topk_prob: bool = True
    sparse_layers: tuple[bool, ...] = ()  # per decoder layer: the MoE block (True) or a dense MLP
    qk_norm: bool = False                 # per-head RMSNorm on q and k before the rotary

    def validated(self, source: str = "config.json") -> "MoeConfig":
        cfg = super().validated(source)
        for f, hi in (("moe_ffn_hidden_size", 1 << 18), ("num_experts", 4096), ("experts_per_token", 4096),
                      ("num_shared_experts", 64), ("num_groups", 4096), ("topk_groups", 4096)):
            v = getattr(cfg, f)
            lo = 0 if f == "num_shared_experts" else 1
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ConfigError(f"{source}: {f} = {v!r} is not an integer in {lo}..{hi}; restore the file from the "
                                  "original checkpoint")
        if cfg.experts_per_token > cfg.num_experts:
            raise ConfigError(f"{source}: num_experts_per_tok {cfg.experts_per_token} exceeds n_routed_experts "
                              f"{cfg.num_experts}; set num_experts_per_tok to at most {cfg.num_experts}")
        if cfg.num_experts % cfg.num_groups:
            raise ConfigError(f"{source}: {cfg.num_experts} experts do not divide into n_group {cfg.num_groups} "
                              "groups; set n_group to a divisor of n_routed_experts (1 in every GLM)")
        if cfg.topk_groups > cfg.num_groups:
            raise ConfigError(f"{source}: topk_group {cfg.topk_groups} exceeds n_group {cfg.num_groups}; set "
                              "topk_group to at most n_group")
        per_group = cfg.num_experts // cfg.num_groups
        if cfg.experts_per_token > cfg.topk_groups * per_group:
            raise ConfigError(f"{source}: num_experts_per_tok {cfg.experts_per_token} exceeds the {cfg.topk_groups} "
                              f"x {per_group} experts the chosen groups hold; raise topk_group")
        if cfg.num_groups > 1 and per_group < 2:
            raise ConfigError(f"{source}: each of the n_group groups needs 2 experts (groups are scored by "
                              "their best two); lower n_group")
        if len(cfg.sparse_layers) != cfg.num_layers or not all(isinstance(s, bool) for s in cfg.sparse_layers):
            raise ConfigError(f"{source}: mlp_layer_types must name one kind per layer ({cfg.num_layers}); "
                              "restore the file from the original checkpoint")
        for f in ("norm_topk_prob", "qk_norm"):
            if not isinstance(getattr(cfg, f), bool):
                raise ConfigError(f"{source}: {f} = {getattr(cfg, f)!r} is not true/false")
        v = cfg.routed_scaling
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e6:
            raise ConfigError(f"{source}: routed_scaling_factor {v!r} is not a positive number")
        return dataclasses.replace(cfg, routed_scaling=float(v), sparse_layers=tuple(cfg.sparse_layers))


def moe_fields(raw: dict, num_layers: int, get, sparse: tuple[bool, ...]) -> dict:
    """The expert fields shared by glm4_moe and glm4_moe_lite config.json files; sparse: each layer's kind, read as
    the architecture's transformers config reads it (first_k_dense_sparse, listed_sparse)."""
    return dict(moe_ffn_hidden_size=get("moe_intermediate_size"), num_experts=get("n_routed_experts"),
                experts_per_token=get("num_experts_per_tok"), num_shared_experts=get("n_shared_experts"),
                routed_scaling=get("routed_scaling_factor"), num_groups=get("n_group"),
                topk_groups=get("topk_group"), norm_topk_prob=get("norm_topk_prob"), sparse_layers=sparse,
                num_mtp_layers=get("num_nextn_predict_layers"))


def first_k_dense_sparse(num_layers: int, get) -> tuple[bool, ...]:
    """glm4_moe's layer kinds as transformers' Glm4MoeForCausalLM (and vLLM) build them: the MoE block from layer
    first_k_dense_replace on. An mlp_layer_types key is not read there, so it is not read here either."""
    first_dense = get("first_k_dense_replace")
    if isinstance(first_dense, bool) or not isinstance(first_dense, int) or first_dense < 0:
        raise ConfigError(f"config.json: first_k_dense_replace {first_dense!r} is not a layer count")
    return tuple(i >= first_dense for i in range(num_layers))


def listed_sparse(raw: dict, num_layers: int) -> tuple[bool, ...]:
    """glm4_moe_lite's layer kinds as transformers' Glm4MoeLiteConfig reads them: mlp_layer_types, by default a dense
    first layer and the MoE block after it (first_k_dense_replace is not read there, so not here either)."""
    kinds = raw.get("mlp_layer_types")
    if kinds is None:
        return (False,) + (True,) * (num_layers - 1)
    if isinstance(kinds, list) and all(k in ("dense", "sparse") for k in kinds):
        return tuple(k == "sparse" for k in kinds)
    raise ConfigError("config.json: mlp_layer_types must be a list of \"dense\"/\"sparse\"; restore the file "
                      "from the original checkpoint")


def getter(raw: dict, defaults: dict):
    def get(key):
        v = raw.get(key, defaults.get(key))
        if v is None and key not in defaults:
            raise KeyError(key)
        return v
    return get


class Glm4MoeArchitecture(Architecture):
    name = "glm4_moe"
    model_types = ("glm4_moe",)
    title = "MoE GLM: GLM-4.5, 4.5-Air, 4.6, 4.7"
    torch_forward = "glm4_moe"
    config_class = MoeConfig
    synthetic_families = ("glm4-moe",)
    gguf_architectures = ("glm4moe",)

    # ------------------------------------------------------------ config.json

    def parse_config(self, raw: dict, source: str, model_dir: Path | None) -> MoeConfig:
        get = getter(raw, DEFAULTS)
        if get("hidden_act") != "silu":
            raise ConfigError(f"{source}: hidden_act {raw.get('hidden_act')!r} is not supported; GLM models use silu")
        heads, layers = get("num_attention_heads"), get("num_hidden_layers")
        head_dim = raw.get("head_dim") or get("hidden_size") // heads    # transformers: hidden // heads if absent
        theta, factor = hf_rope(raw, source, DEFAULTS)
        cfg = MoeConfig(
            family="glm4-moe", hidden_size=get("hidden_size"), num_layers=layers, num_heads=heads,
            num_kv_heads=get("num_key_value_heads"), head_dim=head_dim, ffn_hidden_size=get("intermediate_size"),
            vocab_size=get("vocab_size"), max_seq_len=get("max_position_embeddings"), rope_base=theta,
            norm_eps=get("rms_norm_eps"), qkv_bias=get("attention_bias"), name=raw.get("_name_or_path", ""),
            rotary_dim=int(head_dim * factor), tie_embeddings=get("tie_word_embeddings"), rotary_interleaved=False,
            arch=self.name, model_type="glm4_moe", qk_norm=get("use_qk_norm"),
            **moe_fields(raw, layers, get, first_k_dense_sparse(layers, get)))
        return cfg.validated(source)

    # ------------------------------------------------------------ GGUF (llama.cpp's converter)

    def gguf_config(self, meta, shapes) -> MoeConfig:
        """llama.cpp's glm4moe keys: its block_count holds the NextN layers too; NeoX rotary, as glmcore's."""
        heads, hidden = meta.get("{arch}.attention.head_count", int), meta.get("{arch}.embedding_length", int)
        head_dim = meta.get("{arch}.attention.key_length", int, hidden // max(heads, 1))
        cfg = MoeConfig(
            family="glm4-moe", hidden_size=hidden, num_heads=heads,
            num_kv_heads=meta.get("{arch}.attention.head_count_kv", int, heads), head_dim=head_dim,
            ffn_hidden_size=meta.get("{arch}.feed_forward_length", int), max_seq_len=meta.get("{arch}.context_length", int),
            rope_base=meta.get("{arch}.rope.freq_base", float, 10000.0),
            norm_eps=meta.get("{arch}.attention.layer_norm_rms_epsilon", float), name=meta.get("general.name", str, ""),
            rotary_dim=meta.get("{arch}.rope.dimension_count", int, head_dim // 2), rotary_interleaved=False,
            arch=self.name, model_type="glm4_moe", qk_norm="blk.0.attn_q_norm.weight" in shapes,
            **gguf_moe_fields(meta, shapes))
        return cfg.validated(meta.source)

    def gguf_to_canonical(self, cfg: MoeConfig, parts: dict, where: Path) -> dict:
        return moe_gguf_to_canonical(parts, where, GGUF_LAYER, GGUF_FUSED)

    # ------------------------------------------------------------ layout

    def attention_tensors(self, cfg: MoeConfig, p: str) -> dict[str, TensorSpec]:
        h, qkv = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size
        t = {p + "qkv.weight": TensorSpec((qkv, h), Split.COLUMN, Axis.QKV, role=Role.QUERY_KEY)}
        if cfg.qkv_bias:
            t[p + "qkv.bias"] = TensorSpec((qkv,), Split.COLUMN, Axis.QKV, role=Role.BIAS)
        t[p + "attn_out.weight"] = TensorSpec((h, cfg.q_size), Split.ROW, Axis.HEADS)
        if cfg.qk_norm:
            t[p + "q_norm.weight"] = TensorSpec((cfg.head_dim,), role=Role.NORM)
            t[p + "k_norm.weight"] = TensorSpec((cfg.head_dim,), role=Role.NORM)
        return t

    def layer_tensors(self, cfg: MoeConfig, p: str, sparse: bool) -> dict[str, TensorSpec]:
        h = cfg.hidden_size
        norm = TensorSpec((h,), role=Role.NORM)
        t = {p + "input_norm.weight": norm, **self.attention_tensors(cfg, p), p + "post_attn_norm.weight": norm}
        if not sparse:
            t[p + "ffn_up.weight"] = TensorSpec((2 * cfg.ffn_hidden_size, h), Split.COLUMN, Axis.FFN, blocks=2)
            t[p + "ffn_down.weight"] = TensorSpec((h, cfg.ffn_hidden_size), Split.ROW, Axis.FFN)
            return t
        E, f = cfg.num_experts, cfg.moe_ffn_hidden_size
        # the router runs in fp32 (its checkpoint tensors are fp32 in the published files)
        t[p + "router.weight"] = TensorSpec((E, h), role=Role.ROUTER)
        t[p + "router.bias"] = TensorSpec((E,), role=Role.ROUTER_BIAS)
        for e in range(E):
            t[p + f"experts.{e}.ffn_up.weight"] = TensorSpec((2 * f, h), Split.EXPERT)     # gate rows, then up
            t[p + f"experts.{e}.ffn_down.weight"] = TensorSpec((h, f), Split.EXPERT)
        if cfg.num_shared_experts:
            fs = f * cfg.num_shared_experts
            t[p + "shared.ffn_up.weight"] = TensorSpec((2 * fs, h), Split.COLUMN, Axis.SHARED_FFN, blocks=2)
            t[p + "shared.ffn_down.weight"] = TensorSpec((h, fs), Split.ROW, Axis.SHARED_FFN)
        return t

    def tensors(self, cfg: MoeConfig) -> dict[str, TensorSpec]:
        h = cfg.hidden_size
        t = {"embed.weight": TensorSpec((cfg.vocab_size, h), Split.VOCAB, role=Role.EMBEDDING)}
        for i in range(cfg.num_layers):
            t.update(self.layer_tensors(cfg, f"layers.{i}.", cfg.sparse_layers[i]))
        t["final_norm.weight"] = TensorSpec((h,), role=Role.NORM)
        t["lm_head.weight"] = TensorSpec((cfg.vocab_size, h), Split.VOCAB, role=Role.OUTPUT)
        return t

    def optional_tensors(self, cfg) -> dict[str, TensorSpec]:
        """The NextN layers (many exports drop them): MoE blocks."""
        return mtp_tensors(cfg, lambda p: self.layer_tensors(cfg, p, True))

    # ------------------------------------------------------------ checkpoint names

    def to_canonical(self, raw: dict[str, np.ndarray], where: Path) -> dict[str, np.ndarray]:
        return moe_to_canonical(raw, where, LAYER_NAMES, FUSED_PARTS)

    def complete(self, cfg: MoeConfig, tensors: dict[str, np.ndarray], where: Path) -> None:
        if cfg.tie_embeddings and "embed.weight" in tensors:
            tensors["lm_head.weight"] = tensors["embed.weight"]
        place_mtp(cfg, tensors, where)

    def stored_names(self, cfg: MoeConfig):
        return lambda n: {} if n == "lm_head.weight" and cfg.tie_embeddings else hf_moe_names(n, cfg, _INV_LAYER)

    def num_params(self, cfg: MoeConfig) -> int:
        return sum(int(np.prod(s.shape)) for n, s in self.tensors(cfg).items()
                   if not (n == "lm_head.weight" and cfg.tie_embeddings))

    # ------------------------------------------------------------ synthetic checkpoints

    def sizes(self, family: str) -> dict[str, dict]:
        return SIZES

    def synthetic_config(self, family, size, layers, out: Path, tokenizer_from) -> dict:
        spec = dict(SIZES[size])
        if layers is not None:
            spec["num_hidden_layers"] = layers
        return synthetic_moe_config(out, spec, KEYS, "glmcore-synthetic/GLM-4.5-" + size, tokenizer_from)


# ---------------------------------------------------------------- names (shared with glm4_moe_lite)

LAYER_NAMES = {
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "post_attn_norm.weight",
    "self_attn.o_proj.weight": "attn_out.weight",
    "self_attn.q_norm.weight": "q_norm.weight",
    "self_attn.k_norm.weight": "k_norm.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.gate.weight": "router.weight",
    "mlp.gate.e_score_correction_bias": "router.bias",
    "mlp.shared_experts.down_proj.weight": "shared.ffn_down.weight",
    "mlp.shared_experts.gate_up_proj.weight": "shared.ffn_up.weight",
}
_INV_LAYER = {v: k for k, v in LAYER_NAMES.items() if "gate_up" not in k}
# Parts stored separately and fused into one canonical tensor (rows concatenated in this order).
FUSED_PARTS = {
    "qkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    "qkv.bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
    "ffn_up.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "shared.ffn_up.weight": ["mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"],
}
# llama.cpp's names (gguf-py's TensorNameMap for glm4moe/deepseek2) -> canonical, per layer; the NextN layers'
# own tensors are blk.N.nextn.* (moved to mtp.J.* by place_mtp as for transformers' names)
GGUF_LAYER = {
    "attn_norm.weight": "input_norm.weight",
    "post_attention_norm.weight": "post_attn_norm.weight",
    "ffn_norm.weight": "post_attn_norm.weight",           # deepseek2's name for it
    "attn_output.weight": "attn_out.weight",
    "attn_q_norm.weight": "q_norm.weight",
    "attn_k_norm.weight": "k_norm.weight",
    "ffn_down.weight": "ffn_down.weight",
    "ffn_gate_inp.weight": "router.weight",
    "exp_probs_b.bias": "router.bias",
    "ffn_down_shexp.weight": "shared.ffn_down.weight",
    **{f"nextn.{k}": v for k, v in {"eh_proj.weight": "eh_proj.weight", "enorm.weight": "enorm.weight",
                                    "hnorm.weight": "hnorm.weight", "shared_head_norm.weight": "final_norm.weight",
                                    "shared_head_head.weight": "head.weight",
                                    "embed_tokens.weight": "embed.weight"}.items()},
}
GGUF_FUSED = {
    "qkv.weight": ["attn_q.weight", "attn_k.weight", "attn_v.weight"],
    "qkv.bias": ["attn_q.bias", "attn_k.bias", "attn_v.bias"],
    "ffn_up.weight": ["ffn_gate.weight", "ffn_up.weight"],
    "shared.ffn_up.weight": ["ffn_gate_shexp.weight", "ffn_up_shexp.weight"],
}
# The routed experts, stacked [experts, out, in] by the converter: canonical per expert (gate rows, then up).
GGUF_EXPERTS = {"ffn_gate_exps.weight": ("ffn_up", 0), "ffn_up_exps.weight": ("ffn_up", 1),
                "ffn_down_exps.weight": ("ffn_down", 0)}


def gguf_moe_fields(meta, shapes) -> dict:
    """The expert fields of llama.cpp's glm4moe/deepseek2 keys, and the decoder layer count (block_count less
    the NextN layers). Routing must be sigmoid (every GLM's); groups default to one."""
    from gguf import ExpertGatingFuncType
    gating = meta.get("{arch}.expert_gating_func", int, int(ExpertGatingFuncType.SIGMOID))
    if gating != ExpertGatingFuncType.SIGMOID:
        raise ConfigError(f"{meta.source}: expert_gating_func {gating} is not sigmoid, which every MoE GLM routes "
                          "with; the file is not a GLM model")
    nextn = meta.get("{arch}.nextn_predict_layers", int, 0)
    layers = meta.get("{arch}.block_count", int) - nextn
    dense = meta.get("{arch}.leading_dense_block_count", int, 0)
    if "token_embd.weight" not in shapes:
        raise CheckpointError(f"{meta.source}: tensor token_embd.weight is missing; the file is incomplete")
    return dict(num_layers=layers, vocab_size=shapes["token_embd.weight"][0],
                qkv_bias="blk.0.attn_q.bias" in shapes, tie_embeddings="output.weight" not in shapes,
                moe_ffn_hidden_size=meta.get("{arch}.expert_feed_forward_length", int),
                num_experts=meta.get("{arch}.expert_count", int),
                experts_per_token=meta.get("{arch}.expert_used_count", int),
                num_shared_experts=meta.get("{arch}.expert_shared_count", int, 0),
                routed_scaling=meta.get("{arch}.expert_weights_scale", float, 1.0),
                num_groups=meta.get("{arch}.expert_group_count", int, 1),
                topk_groups=meta.get("{arch}.expert_group_used_count", int, 1),
                norm_topk_prob=meta.get("{arch}.expert_weights_norm", bool, False),
                sparse_layers=tuple(i >= dense for i in range(max(layers, 0))), num_mtp_layers=nextn)


def moe_gguf_to_canonical(parts: dict, where: Path, layer: dict[str, str], fused: dict[str, list[str]]) -> dict:
    """blk.N.* -> layers.N.* (place_mtp then moves the NextN layers), split projections and gate|up stacked by
    rows, each expert of the stacked [experts, out, in] tensors its own canonical tensor."""
    from ..gguf import GGUFPart, stack
    out, grouped = {}, {}
    for name, p, rest, part in gguf_layer_parts(parts, where, out, "a MoE GLM GGUF"):
        if rest in layer:
            out[p + layer[rest]] = stack(where, name, [part])
        elif rest in GGUF_EXPERTS:
            kind, at = GGUF_EXPERTS[rest]
            if len(part.shape) != 3:
                raise CheckpointError(f"{where}: {name} has shape {part.shape}, not [experts, out, in]; the file is "
                                      "corrupt")
            for e in range(part.shape[0]):
                one = GGUFPart(f"{name}[{e}]", part.qtype, part.data[e], part.shape[1:])
                grouped.setdefault(p + f"experts.{e}.{kind}.weight", {})[at] = one
        else:
            into = next((c for c, names in fused.items() if rest in names), None)
            if into is None:
                raise unknown_gguf_tensor(where, name, "a MoE GLM GGUF")
            grouped.setdefault(p + into, {})[fused[into].index(rest)] = part
    for canon, got in grouped.items():
        need = 2 if ".experts." in canon and canon.endswith("ffn_up.weight") else \
            1 if ".experts." in canon else len(fused[canon.split(".", 2)[2]])
        if sorted(got) != list(range(need)) or canon in out:
            raise CheckpointError(f"{where}: {canon} is stored in {len(got)} of its {need} parts (or also whole); "
                                  "the file is incomplete or corrupt")
        out[canon] = stack(where, canon, [got[i] for i in range(need)])
    return out


def _expert_name(rest: str) -> str | None:
    m = re.fullmatch(r"mlp\.experts\.(\d+)\.down_proj\.weight", rest)
    return f"experts.{int(m.group(1))}.ffn_down.weight" if m else None


def moe_to_canonical(raw: dict[str, np.ndarray], where: Path, layer: dict[str, str],
                     fused: dict[str, list[str]]) -> dict[str, np.ndarray]:
    """model.layers.N.* -> layers.N.* (every N: place_mtp moves those past the decoder layers to mtp.J.*),
    the split projections fused, experts stored per expert or as transformers 5's 3-D gate_up_proj/down_proj."""
    out: dict[str, np.ndarray] = {}
    parts: dict[tuple[str, str], dict[str, np.ndarray]] = {}       # (layer prefix, canonical) -> part -> array
    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "final_norm.weight",
           "lm_head.weight": "lm_head.weight"}
    for name, t in raw.items():
        if name in top:
            out[top[name]] = t
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if m is None:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            raise CheckpointError(f"{where}: unknown tensor name {name!r}; this is not a GLM-4.5/4.6/4.7 "
                                  "(glm4_moe) or GLM-4.7-Flash (glm4_moe_lite) checkpoint, or it is quantized")
        p, rest = f"layers.{int(m.group(1))}.", m.group(2)
        if rest.endswith("rotary_emb.inv_freq"):
            continue
        canon = layer.get(rest) or _expert_name(rest) or MTP_NAMES.get(rest)
        if canon is not None:
            out[p + canon] = t
            continue
        me = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate|up)_proj\.weight", rest)
        if me:
            parts.setdefault((p, f"experts.{int(me.group(1))}.ffn_up.weight"), {})[me.group(2)] = t
            continue
        if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):     # transformers 5's fused 3-D form
            if t.ndim != 3:
                raise CheckpointError(f"{where}: {name} has shape {tuple(t.shape)}, not [experts, out, in]; the "
                                      "checkpoint is corrupt")
            kind = "ffn_up" if rest.endswith("gate_up_proj") else "ffn_down"
            for e in range(t.shape[0]):
                out[p + f"experts.{e}.{kind}.weight"] = t[e]
            continue
        into = next((c for c, names in fused.items() if rest in names), None)
        if into is not None:
            parts.setdefault((p, into), {})[rest] = t
            continue
        raise CheckpointError(f"{where}: unknown tensor name {name!r}; this is not a GLM-4.5/4.6/4.7 (glm4_moe) "
                              "or GLM-4.7-Flash (glm4_moe_lite) checkpoint, or it is quantized")
    for (p, canon), got in parts.items():
        if p + canon in out:
            raise CheckpointError(f"{where}: {p}{canon} is stored both fused and in parts; the checkpoint mixes "
                                  "two exports, re-download it")
        if canon.startswith("experts."):
            order = ["gate", "up"]
        else:
            order = fused[canon]
        missing = [o for o in order if o not in got]
        if missing:
            raise CheckpointError(f"{where}: {p}{canon} lacks {missing[0]} (has {sorted(got)}); the checkpoint is "
                                  "incomplete, download all of its shards")
        try:
            out[p + canon] = _join_rows([got[o] for o in order])
        except ValueError:
            raise CheckpointError(f"{where}: the parts of {p}{canon} have mismatched shapes "
                                  f"{[tuple(got[o].shape) for o in order]}; the checkpoint is corrupt") from None
    return out


def _join_rows(parts: list[np.ndarray]) -> np.ndarray:
    """The parts' rows concatenated: a view, not a copy, where they lie back to back in one mapped file (an
    expert's gate and up projections usually do), so a large checkpoint stays on disk until something reads it."""
    first, root = parts[0], parts[0]
    while isinstance(root.base, np.ndarray):
        root = root.base
    addr = [q.__array_interface__["data"][0] for q in parts]
    if isinstance(root, np.memmap) and root.ndim == 1 and \
            all(q.flags.c_contiguous and q.dtype == first.dtype and q.shape[1:] == first.shape[1:] for q in parts) and \
            all(a + q.nbytes == b for a, q, b in zip(addr, parts, addr[1:])):
        return np.ndarray((sum(q.shape[0] for q in parts),) + first.shape[1:], first.dtype, buffer=root,
                          offset=addr[0] - root.__array_interface__["data"][0])
    return np.concatenate(parts, axis=0)


def hf_moe_names(canonical: str, cfg, inv_layer: dict) -> dict[str, slice | None]:
    """The published (transformers / hub) names of a canonical tensor, each with the rows it holds."""
    top = {"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
           "lm_head.weight": "lm_head.weight"}
    if canonical in top:
        return {top[canonical]: None}
    m = re.fullmatch(r"(layers|mtp)\.(\d+)\.(.+)", canonical)
    kind, idx, rest = m.group(1), int(m.group(2)), m.group(3)
    if kind == "mtp":
        idx += cfg.num_layers
        if not rest.startswith("layer."):
            inv_mtp = {v: k for k, v in MTP_NAMES.items()}
            return {f"model.layers.{idx}.{inv_mtp[rest]}": None}
        rest = rest[len("layer."):]
    p = f"model.layers.{idx}."
    me = re.fullmatch(r"experts\.(\d+)\.ffn_(up|down)\.weight", rest)
    if me and me.group(2) == "up":
        f = cfg.moe_ffn_hidden_size
        e = f"mlp.experts.{me.group(1)}."
        return {p + e + "gate_proj.weight": slice(0, f), p + e + "up_proj.weight": slice(f, 2 * f)}
    if me:
        return {p + f"mlp.experts.{me.group(1)}.down_proj.weight": None}
    if rest in ("qkv.weight", "qkv.bias"):
        q, kv = cfg.q_size, cfg.kv_size
        names = FUSED_PARTS[rest]
        return {p + names[0]: slice(0, q), p + names[1]: slice(q, q + kv), p + names[2]: slice(q + kv, q + 2 * kv)}
    if rest in ("ffn_up.weight", "shared.ffn_up.weight"):
        names = FUSED_PARTS[rest]
        half = cfg.ffn_hidden_size if rest == "ffn_up.weight" else cfg.moe_ffn_hidden_size * cfg.num_shared_experts
        return {p + names[0]: slice(0, half), p + names[1]: slice(half, 2 * half)}
    return {p + inv_layer[rest]: None}


# ---------------------------------------------------------------- synthetic sizes and config.json keys

# make-model sizes by config.json key. air: GLM-4.5-Air's shape; 355b: GLM-4.5/4.6/4.7's (both: use --layers N
# for a few of their layers); tiny/small: test sizes on the synthetic tokenizer's vocabulary.
SIZES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=160, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                 first_k_dense_replace=1, use_qk_norm=True, routed_scaling_factor=2.5, vocab="tokenizer"),
    "small": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  intermediate_size=1536, moe_intermediate_size=256, n_routed_experts=16, num_experts_per_tok=4,
                  first_k_dense_replace=1, vocab="tokenizer"),
    "air": dict(hidden_size=4096, num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=128, num_experts_per_tok=8,
                first_k_dense_replace=1, use_qk_norm=False, routed_scaling_factor=1.0, rope_theta=1000000,
                attention_bias=True, vocab="real"),
    "355b": dict(hidden_size=5120, num_hidden_layers=92, num_attention_heads=96, num_key_value_heads=8,
                 head_dim=128, intermediate_size=12288, moe_intermediate_size=1536, n_routed_experts=160,
                 num_experts_per_tok=8, first_k_dense_replace=3, use_qk_norm=True, routed_scaling_factor=2.5,
                 rope_theta=1000000, attention_bias=True, vocab="real"),
}
# GLM-4.5-Air's published config.json keys (../shared/models/GLM-4.5-Air), sizes replaced per --size.
KEYS = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
        "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 131072,
        "n_group": 1, "n_shared_experts": 1, "norm_topk_prob": True, "num_nextn_predict_layers": 1,
        "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
        "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1, "torch_dtype": "bfloat16",
        "transformers_version": "4.54.1", "use_cache": True, "use_qk_norm": False}
REAL_VOCAB = 151552

# GLM-4.5's added tokens after the GLM-4 ranks, in id order (151329..151364 in the real tokenizer), as its
# tokenizer_config.json lists them (recalled from the published file; the real file was not reachable here).
GLM45_SPECIALS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
                  "<|end_of_video|>", "<|begin_of_audio|>", "<|end_of_audio|>", "<|begin_of_transcription|>",
                  "<|end_of_transcription|>", "<|code_prefix|>", "<|code_middle|>", "<|code_suffix|>", "<think>",
                  "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<arg_key>",
                  "</arg_key>", "<arg_value>", "</arg_value>", "/nothink", "<|begin_of_box|>", "<|end_of_box|>",
                  "<|image|>", "<|video|>"]


# The chat templates the MoE GLMs ship (glmcore/data, verbatim; no weights or hub files are reachable here):
# - GLM-4.5 / 4.6: GLM-4.6's chat_template.jinja as llama.cpp stores it (models/templates/GLM-4.6.jinja).
# - GLM-4.7 / GLM-4.7-Flash: GLM-4.7's, the same protocol written without newlines (`<|assistant|><think>`
#   opens every reply, `</think>` alone where an earlier turn's thinking is cleared or thinking is off,
#   `<tool_call>NAME<arg_key>...`, `clear_thinking=false` keeps earlier thinking). From a public verbatim copy
#   of zai-org's file (a prompt formatter's embedded copy), whose lines agree with every partial quote found
#   (llama.cpp server patches, renderer tests; LLaMA-Factory's GLM-4.7-Flash template states the `</think>` rule).
GLM45_TEMPLATE = "glm45_chat_template.jinja"
GLM47_TEMPLATE = "glm47_chat_template.jinja"


def synthetic_moe_config(out: Path, spec: dict, keys: dict, name: str, tokenizer_from,
                         real_vocab: int = REAL_VOCAB, template: str = GLM45_TEMPLATE) -> dict:
    """tokenizer.json + tokenizer_config.json with GLM-4.5's specials and the given chat template (one of
    glmcore/data's above), generation_config.json, and config.json's keys for a synthetic MoE GLM. The ranks are the
    first 2048 of glmcore's GLM-4 rank file, or with tokenizer_from (GLM-4's tokenizer.model, or a directory
    holding it) all of GLM-4's: GLM-4.5/4.6/4.7 use GLM-4's BPE with their own specials numbered from 151329,
    so that gives GLM-4.5's tokenizer id for id, and the real 151552-row vocabulary."""
    from ..tokenizer import DATA_DIR, DEFAULT_GLM4_RANKS, GLM4_RANKS_FILE, read_rank_file
    real = spec.pop("vocab") == "real" or tokenizer_from is not None
    if tokenizer_from is None:
        ranks = {t: r for t, r in read_rank_file(GLM4_RANKS_FILE).items() if r < DEFAULT_GLM4_RANKS}
    else:
        ranks = glm4_ranks(Path(tokenizer_from), real_vocab)
    n_vocab = len(ranks) + len(GLM45_SPECIALS)
    vocab = real_vocab if real else -(-n_vocab // 64) * 64
    chat_template = (DATA_DIR / template).read_text(encoding="utf-8")
    raw = {"_name_or_path": name, **keys, **spec, "vocab_size": max(vocab, n_vocab)}
    write_synthetic_tokenizer(out, raw, ranks, GLM45_SPECIALS, chat_template, ["[gMASK]", "<sop>"])
    return raw


GLM4_BPE_RANKS = 151329       # GLM-4's tokenizer.model; GLM-4.5's specials follow it (<|endoftext|> = 151329)


def glm4_ranks(path: Path, real_vocab: int) -> dict[bytes, int]:
    """GLM-4's BPE ranks from its tokenizer.model (a file, or a checkpoint directory holding one), checked to be
    the vocabulary GLM-4.5's special ids are numbered after."""
    from ..errors import GlmcoreError
    from ..tokenizer import read_rank_file
    if real_vocab != REAL_VOCAB:
        raise GlmcoreError("--tokenizer-from builds GLM-4.5's tokenizer from GLM-4's ranks; this family has a "
                           "vocabulary of its own (copy its tokenizer.json and tokenizer_config.json instead)")
    model = path / "tokenizer.model" if path.is_dir() else path
    if not model.is_file():
        raise GlmcoreError(f"{model} not found: point --tokenizer-from at GLM-4's tokenizer.model or a "
                           "glm-4-9b-chat directory holding it")
    ranks = read_rank_file(model)
    if len(ranks) != GLM4_BPE_RANKS:
        raise GlmcoreError(f"{model} has {len(ranks)} ranks, not GLM-4's {GLM4_BPE_RANKS}: GLM-4.5's special ids "
                           "follow GLM-4's ranks; use glm-4-9b-chat's tokenizer.model")
    return ranks


GLM4_MOE = Glm4MoeArchitecture()
