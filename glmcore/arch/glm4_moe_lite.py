"""GLM-4.7-Flash (transformers' glm4_moe_lite, Glm4MoeLiteForCausalLM): the MoE GLM with multi-head latent
attention (DeepSeek-V2's MLA).

Attention per layer: q = q_b(rmsnorm(q_a(x))) (or q_proj where q_lora_rank is null), split per head into
qk_nope + qk_rope dims; [c_kv, k_rope] = kv_a(x); c_kv = rmsnorm(c_kv); k_nope, v = kv_b(c_kv) per head; the
rope dims of q and the one shared k_rope rotate (interleaved pairs where rope_interleave, else NeoX halves);
scale 1/sqrt(qk_nope + qk_rope). The cache holds c_kv and the rotated k_rope: kv_lora_rank + qk_rope_head_dim
values per token and layer. The MoE block and the NextN layers are glm4_moe's (glmcore/arch/glm4_moe.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, ConfigError
from .base import Axis, Role, Split, TensorSpec
from .glm4_moe import (FUSED_PARTS, GGUF_FUSED, GGUF_LAYER, GLM47_TEMPLATE, LAYER_NAMES, Glm4MoeArchitecture,
                       MoeConfig, getter, gguf_moe_fields, hf_moe_names, listed_sparse, moe_fields,
                       moe_gguf_to_canonical, moe_to_canonical, synthetic_moe_config)
from .glm import hf_rope

# transformers' Glm4MoeLiteConfig defaults (GLM-4.7-Flash's shape), used where config.json leaves a key out.
DEFAULTS = {"vocab_size": 154880, "hidden_size": 2048, "intermediate_size": 10240, "moe_intermediate_size": 1536,
            "num_hidden_layers": 47, "num_attention_heads": 20, "num_key_value_heads": 20, "n_shared_experts": 1,
            "n_routed_experts": 64, "routed_scaling_factor": 1.8, "kv_lora_rank": 512, "q_lora_rank": 768,
            "qk_rope_head_dim": 64, "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1,
            "num_experts_per_tok": 4, "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 202752,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_interleave": True, "attention_bias": False,
            "rope_theta": 10000.0, "partial_rotary_factor": 1.0, "first_k_dense_replace": 1,
            "num_nextn_predict_layers": 1}


@dataclass(frozen=True)
class MlaConfig(MoeConfig):
    """head_dim is a query/key head (qk_nope + qk_rope), rotary_dim the rope part (qk_rope, at the end of each
    query head and in the one shared rope key)."""
    q_lora_rank: int = 0                  # 0: q_proj directly (q_lora_rank null)
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    v_head_dim: int = 0

    @property
    def qk_rope_dim(self) -> int:
        return self.rotary_dim

    @property
    def latent_norm_eps(self) -> float:
        """The epsilon of the q_a and kv_a (latent) norms: transformers' Glm4MoeLiteRMSNorm default, 1e-6, which
        its attention does not override with rms_norm_eps (DeepSeek's own modeling code the same; vLLM and
        llama.cpp pass rms_norm_eps, 1e-5 at GLM-4.7-Flash)."""
        return 1e-6

    @property
    def latent_size(self) -> int:
        """Cached values per token and layer: the compressed KV and the rotated rope key."""
        return self.kv_lora_rank + self.qk_rope_dim

    def validated(self, source: str = "config.json") -> "MlaConfig":
        cfg = super().validated(source)
        for f, lo in (("q_lora_rank", 0), ("kv_lora_rank", 1), ("qk_nope_dim", 1), ("v_head_dim", 1)):
            v = getattr(cfg, f)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= 1 << 16:
                raise ConfigError(f"{source}: {f} = {v!r} is not an integer in {lo}..{1 << 16}; restore the file "
                                  "from the original checkpoint")
        if cfg.head_dim != cfg.qk_nope_dim + cfg.rotary_dim:
            raise ConfigError(f"{source}: qk_nope_head_dim + qk_rope_head_dim must be the query head "
                              f"({cfg.head_dim}); restore the file from the original checkpoint")
        return cfg


class Glm4MoeLiteArchitecture(Glm4MoeArchitecture):
    name = "glm4_moe_lite"
    model_types = ("glm4_moe_lite",)
    title = "MoE GLM with latent attention: GLM-4.7-Flash"
    torch_forward = "glm4_moe_lite"
    config_class = MlaConfig
    synthetic_families = ("glm4-moe-lite",)

    def parse_config(self, raw: dict, source: str, model_dir: Path | None) -> MlaConfig:
        get = getter(raw, DEFAULTS)
        if get("hidden_act") != "silu":
            raise ConfigError(f"{source}: hidden_act {raw.get('hidden_act')!r} is not supported; GLM models use silu")
        layers, rope = get("num_hidden_layers"), get("qk_rope_head_dim")
        theta, factor = hf_rope(raw, source, DEFAULTS)
        if factor != 1.0:
            raise ConfigError(f"{source}: partial_rotary_factor {factor} on latent attention: the rope dims "
                              "(qk_rope_head_dim) rotate whole; restore the file from the original checkpoint")
        nope = get("qk_nope_head_dim")
        cfg = MlaConfig(
            family="glm4-moe-lite", hidden_size=get("hidden_size"), num_layers=layers,
            # every head attends to the whole latent cache: num_key_value_heads means nothing here (transformers'
            # default of 20 is read only by a repeat that is then a no-op; vLLM does not read it)
            num_heads=get("num_attention_heads"), num_kv_heads=get("num_attention_heads"),
            head_dim=nope + rope,
            ffn_hidden_size=get("intermediate_size"), vocab_size=get("vocab_size"),
            max_seq_len=get("max_position_embeddings"), rope_base=theta, norm_eps=get("rms_norm_eps"),
            qkv_bias=get("attention_bias"), name=raw.get("_name_or_path", ""), rotary_dim=rope,
            tie_embeddings=get("tie_word_embeddings"), rotary_interleaved=get("rope_interleave"), arch=self.name,
            model_type="glm4_moe_lite", q_lora_rank=get("q_lora_rank") or 0, kv_lora_rank=get("kv_lora_rank"),
            qk_nope_dim=nope, v_head_dim=get("v_head_dim"),
            **moe_fields(raw, layers, get, listed_sparse(raw, layers)))
        if not isinstance(cfg.rotary_interleaved, bool):
            raise ConfigError(f"{source}: rope_interleave {cfg.rotary_interleaved!r} is not true/false")
        return cfg.validated(source)

    gguf_architectures = ("deepseek2",)

    def gguf_config(self, meta, shapes) -> MlaConfig:
        """llama.cpp's deepseek2 keys as its converter writes GLM-4.7-Flash: MLA stored as one KV head (head_count_kv
        1), the query head in key_length_mla, the rope dims interleaved (LLAMA_ROPE_TYPE_NORM: rope_interleave)."""
        if meta.get("{arch}.rope.scaling.type", str, "none") not in ("none", ""):
            raise ConfigError(f"{meta.source}: rope scaling {meta.get('{arch}.rope.scaling.type', str)!r} is not "
                              "supported (only the default rotary); use a GGUF without rope scaling")
        rope = meta.get("{arch}.rope.dimension_count", int)
        head = meta.get("{arch}.attention.key_length_mla", int)
        heads = meta.get("{arch}.attention.head_count", int)
        cfg = MlaConfig(
            family="glm4-moe-lite", hidden_size=meta.get("{arch}.embedding_length", int), num_heads=heads,
            num_kv_heads=heads, head_dim=head, ffn_hidden_size=meta.get("{arch}.feed_forward_length", int),
            max_seq_len=meta.get("{arch}.context_length", int), rope_base=meta.get("{arch}.rope.freq_base", float, 10000.0),
            norm_eps=meta.get("{arch}.attention.layer_norm_rms_epsilon", float), name=meta.get("general.name", str, ""),
            rotary_dim=rope, rotary_interleaved=True, arch=self.name, model_type="glm4_moe_lite",
            q_lora_rank=meta.get("{arch}.attention.q_lora_rank", int, 0),
            kv_lora_rank=meta.get("{arch}.attention.kv_lora_rank", int), qk_nope_dim=head - rope,
            v_head_dim=meta.get("{arch}.attention.value_length_mla", int), **gguf_moe_fields(meta, shapes))
        return dataclasses.replace(cfg, qkv_bias="blk.0.attn_kv_a_mqa.bias" in shapes).validated(meta.source)

    def gguf_to_canonical(self, cfg: MlaConfig, parts: dict, where: Path) -> dict:
        """As glm4moe's, and kv_b put back together from the converter's k_b ([heads, kv_lora_rank, qk_nope]:
        transposed) and v_b ([heads, v_head_dim, kv_lora_rank])."""
        from ..gguf import GGUFTensor
        k_b = {n: parts.pop(n) for n in [n for n in parts if n.endswith(".attn_k_b.weight")]}
        v_b = {n: parts.pop(n) for n in [n for n in parts if n.endswith(".attn_v_b.weight")]}
        out = moe_gguf_to_canonical(parts, where, _GGUF_MLA_LAYER, _GGUF_MLA_FUSED)
        H, nope, v, r = cfg.num_heads, cfg.qk_nope_dim, cfg.v_head_dim, cfg.kv_lora_rank
        for name, k in k_b.items():
            layer = name.split(".")[1]
            vb = v_b.pop(name.replace("attn_k_b", "attn_v_b"), None)
            if vb is None or k.shape != (H, r, nope) or vb.shape != (H, v, r):
                raise CheckpointError(f"{where}: layer {layer}'s attn_k_b {k.shape} / attn_v_b "
                                      f"{None if vb is None else vb.shape} are not [{H}, {r}, {nope}] / [{H}, {v}, {r}]; "
                                      "the file is incomplete or of another model")
            out[f"layers.{layer}.kv_b.weight"] = GGUFTensor(
                (k, vb), (H * (nope + v), r),
                lambda kb, vb_: np.concatenate([kb.transpose(0, 2, 1), vb_], axis=1))
        if v_b:
            raise CheckpointError(f"{where}: {next(iter(v_b))} has no attn_k_b beside it; the file is incomplete")
        return out

    def attention_tensors(self, cfg: MlaConfig, p: str) -> dict[str, TensorSpec]:
        h, H = cfg.hidden_size, cfg.num_heads
        # Under tensor parallelism (as vLLM and SGLang split DeepSeek's MLA) the latent projections and norms are
        # every rank's: they make the shared latent and rope key, which is why every rank caches all of it. The
        # per-head tensors split by head, each head's block whole: q_b's (or q's) qk_nope + qk_rope rows, kv_b's
        # qk_nope + v rows, o_proj's v_head_dim columns.
        t = {}
        if cfg.q_lora_rank:
            t[p + "q_a.weight"] = TensorSpec((cfg.q_lora_rank, h))
            if cfg.qkv_bias:
                t[p + "q_a.bias"] = TensorSpec((cfg.q_lora_rank,), role=Role.BIAS)
            t[p + "q_a_norm.weight"] = TensorSpec((cfg.q_lora_rank,), role=Role.NORM)
            t[p + "q_b.weight"] = TensorSpec((H * cfg.head_dim, cfg.q_lora_rank), Split.COLUMN, Axis.HEADS,
                                             role=Role.QUERY_KEY)
        else:
            t[p + "q.weight"] = TensorSpec((H * cfg.head_dim, h), Split.COLUMN, Axis.HEADS, role=Role.QUERY_KEY)
        t[p + "kv_a.weight"] = TensorSpec((cfg.latent_size, h), role=Role.QUERY_KEY)
        if cfg.qkv_bias:
            t[p + "kv_a.bias"] = TensorSpec((cfg.latent_size,), role=Role.BIAS)
        t[p + "kv_a_norm.weight"] = TensorSpec((cfg.kv_lora_rank,), role=Role.NORM)
        kv_head = cfg.qk_nope_dim + cfg.v_head_dim
        t[p + "kv_b.weight"] = TensorSpec((H * kv_head, cfg.kv_lora_rank), Split.COLUMN, Axis.HEADS, head_size=kv_head)
        t[p + "attn_out.weight"] = TensorSpec((h, H * cfg.v_head_dim), Split.ROW, Axis.HEADS, head_size=cfg.v_head_dim)
        if cfg.qkv_bias:
            t[p + "attn_out.bias"] = TensorSpec((h,), Split.ONCE, role=Role.BIAS)
        return t

    def to_canonical(self, raw: dict[str, np.ndarray], where: Path) -> dict[str, np.ndarray]:
        return moe_to_canonical(raw, where, _MLA_LAYER, _MLA_FUSED)

    def stored_names(self, cfg: MlaConfig):
        return lambda n: {} if n == "lm_head.weight" and cfg.tie_embeddings else hf_moe_names(n, cfg, _INV_MLA_LAYER)

    def sizes(self, family: str) -> dict[str, dict]:
        return SIZES

    def synthetic_config(self, family, size, layers, out: Path, tokenizer_from) -> dict:
        spec = dict(SIZES[size])
        n = layers if layers is not None else spec["num_hidden_layers"]
        spec["num_hidden_layers"] = n
        spec["mlp_layer_types"] = ["dense"] + ["sparse"] * (n - 1)
        return synthetic_moe_config(out, spec, KEYS, "glmcore-synthetic/GLM-4.7-Flash-" + size, tokenizer_from,
                                    real_vocab=154880, template=GLM47_TEMPLATE)


_MLA_LAYER = {k: v for k, v in LAYER_NAMES.items() if not k.startswith("self_attn.")}
_MLA_LAYER.update({
    "self_attn.q_a_proj.weight": "q_a.weight", "self_attn.q_a_proj.bias": "q_a.bias",
    "self_attn.q_a_layernorm.weight": "q_a_norm.weight", "self_attn.q_b_proj.weight": "q_b.weight",
    "self_attn.q_proj.weight": "q.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "kv_a.weight", "self_attn.kv_a_proj_with_mqa.bias": "kv_a.bias",
    "self_attn.kv_a_layernorm.weight": "kv_a_norm.weight", "self_attn.kv_b_proj.weight": "kv_b.weight",
    "self_attn.o_proj.weight": "attn_out.weight", "self_attn.o_proj.bias": "attn_out.bias",
})
_INV_MLA_LAYER = {v: k for k, v in _MLA_LAYER.items() if "gate_up" not in k}
# llama.cpp's deepseek2 names of the attention tensors (the rest as glm4moe's)
_GGUF_MLA_LAYER = {k: v for k, v in GGUF_LAYER.items() if not k.startswith(("attn_q_norm", "attn_k_norm"))}
_GGUF_MLA_LAYER.update({
    "attn_q_a.weight": "q_a.weight", "attn_q_a.bias": "q_a.bias", "attn_q_a_norm.weight": "q_a_norm.weight",
    "attn_q_b.weight": "q_b.weight", "attn_q.weight": "q.weight", "attn_kv_a_mqa.weight": "kv_a.weight",
    "attn_kv_a_mqa.bias": "kv_a.bias", "attn_kv_a_norm.weight": "kv_a_norm.weight",
    "attn_kv_b.weight": "kv_b.weight",            # older conversions keep kv_b whole
    "attn_output.bias": "attn_out.bias",
})
_GGUF_MLA_FUSED = {k: v for k, v in GGUF_FUSED.items() if not k.startswith("qkv")}
_MLA_FUSED = {k: v for k, v in FUSED_PARTS.items() if not k.startswith("qkv")}

# make-model sizes. flash: GLM-4.7-Flash's shape (47 layers: --layers N for fewer); tiny/small for tests.
SIZES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                 q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                 intermediate_size=160, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                 vocab="tokenizer"),
    "small": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8,
                  q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=64,
                  intermediate_size=1536, moe_intermediate_size=256, n_routed_experts=16, num_experts_per_tok=4,
                  vocab="tokenizer"),
    "flash": dict(hidden_size=2048, num_hidden_layers=47, num_attention_heads=20, num_key_value_heads=20,
                  q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
                  intermediate_size=10240, moe_intermediate_size=1536, n_routed_experts=64, num_experts_per_tok=4,
                  vocab="real"),
}
# GLM-4.7-Flash's config.json keys (../shared/models/GLM-4.7-Flash), sizes replaced per --size.
KEYS = {"architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite", "attention_bias": False,
        "attention_dropout": 0.0, "first_k_dense_replace": 1, "hidden_act": "silu",
        "max_position_embeddings": 202752, "n_group": 1, "n_shared_experts": 1, "norm_topk_prob": True,
        "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-05, "rope_interleave": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "routed_scaling_factor": 1.8,
        "tie_word_embeddings": False, "topk_group": 1, "torch_dtype": "bfloat16", "transformers_version": "5.0.0",
        "use_cache": True}

GLM4_MOE_LITE = Glm4MoeLiteArchitecture()
