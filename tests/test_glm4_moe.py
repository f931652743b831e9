"""The MoE GLMs: GLM-4.5/4.5-Air/4.6/4.7 (glm4_moe) and GLM-4.7-Flash (glm4_moe_lite, latent attention).

Held to transformers' own Glm4MoeForCausalLM / Glm4MoeLiteForCausalLM on checkpoints glmcore writes and on
checkpoints transformers writes; their configs as published; bad configs and checkpoints refused in one line."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from glmcore import arch
from glmcore.backend import LoadOptions, registry
from glmcore.config import ModelConfig
from glmcore.errors import BackendError, CheckpointError, ConfigError
from glmcore.weights import load_weights, read_safetensors, write_safetensors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SHARED = Path(__file__).resolve().parents[2] / "shared" / "models"
HF_CLASS = {"glm4-moe": "Glm4MoeForCausalLM", "glm4-moe-lite": "Glm4MoeLiteForCausalLM"}
MOE_FAMILIES = ["glm4-moe", "glm4-moe-lite"]


def hf_model(path: Path, family: str):
    transformers.logging.set_verbosity_error()      # it reports the NextN layer it does not use
    return getattr(transformers, HF_CLASS[family]).from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def ours(backend: str, path: Path, steps, capacity: int = 512, slots: int = 1, **extra):
    """Run `steps` (lists of (slot, ids) entries) on a backend; the all-position logits of each entry."""
    cfg = ModelConfig.from_dir(path)
    b = registry().get(backend)
    opts = b.resolve(LoadOptions(capacity=capacity, threads=1, extra=extra))
    with b.load_batch(cfg, load_weights(path, cfg), opts, slots) as batch:
        return [batch.step(entries, all_logits=True) for entries in steps]


def close(got, want):
    """fp32 on both sides: conformance's f32 row (only the order of summation differs, on any CPU); the same argmax
    wherever transformers' best two logits are further apart than that row allows (a nearer tie may go either way
    with another summation order, as on another CPU's kernels)."""
    from glmcore_conformance import TOLERANCES
    bound = TOLERANCES["f32"].max_abs
    assert np.abs(got - want).max() <= bound, np.abs(got - want).max()
    top2 = np.sort(want, axis=-1)[..., -2:]
    decided = top2[..., 1] - top2[..., 0] > 2 * bound
    assert (got.argmax(-1) == want.argmax(-1))[decided].all()


# ---------------------------------------------------------------- the published configs

@pytest.mark.skipif(not (SHARED / "GLM-4.5-Air").is_dir(), reason="../shared/models is not beside the checkout")
def test_glm45_air_config_as_published():
    cfg = ModelConfig.from_dir(SHARED / "GLM-4.5-Air")
    assert (cfg.arch, cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == \
        ("glm4_moe", "glm4-moe", 46, 4096, 96, 8)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.num_shared_experts, cfg.moe_ffn_hidden_size) == (128, 8, 1, 1408)
    assert cfg.sparse_layers == (False,) + (True,) * 45 and cfg.rotary_dim == 64 and not cfg.rotary_interleaved
    assert (cfg.qk_norm, cfg.qkv_bias, cfg.rope_base, cfg.routed_scaling, cfg.num_mtp_layers) == \
        (False, True, 1e6, 1.0, 1)
    # ~106B parameters (12B active): the count the model card gives
    assert 105e9 < cfg.num_params() < 111e9
    # make-model's air size is this shape
    size = arch.for_family("glm4-moe").sizes("glm4-moe")["air"]
    raw = json.loads((SHARED / "GLM-4.5-Air" / "config.json").read_text())
    assert {k: raw[k] for k in size if k != "vocab"} == {k: v for k, v in size.items() if k != "vocab"}


@pytest.mark.skipif(not (SHARED / "GLM-4.7-Flash").is_dir(), reason="../shared/models is not beside the checkout")
def test_glm47_flash_config_as_published():
    cfg = ModelConfig.from_dir(SHARED / "GLM-4.7-Flash")
    assert (cfg.arch, cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.vocab_size) == \
        ("glm4_moe_lite", "glm4-moe-lite", 47, 2048, 20, 154880)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.v_head_dim) == (768, 512, 192, 64, 256)
    assert cfg.latent_size == 576 and cfg.head_dim == 256 and cfg.rotary_interleaved
    assert (cfg.num_experts, cfg.experts_per_token, cfg.routed_scaling) == (64, 4, 1.8)
    assert cfg.sparse_layers == (False,) + (True,) * 46
    assert 29e9 < cfg.num_params() < 32e9           # "30B total"


def test_transformers_4_and_5_config_forms_agree(tmp_path):
    """Top-level rope keys (transformers 4.x) and rope_parameters (5.x) mean the same model."""
    from glmcore.arch.glm4_moe import KEYS, SIZES
    raw = {**KEYS, **{k: v for k, v in SIZES["tiny"].items() if k != "vocab"}, "vocab_size": 512}
    v5 = {k: v for k, v in raw.items() if k not in ("rope_theta", "partial_rotary_factor", "rope_scaling")}
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": raw["rope_theta"], "partial_rotary_factor": 0.5}
    assert ModelConfig.from_dict(raw) == ModelConfig.from_dict(v5)
    # glm4_moe's layer kinds come from first_k_dense_replace alone, as transformers' Glm4MoeForCausalLM reads them
    mixed = dict(raw, mlp_layer_types=["sparse", "dense", "dense"], first_k_dense_replace=2)
    assert ModelConfig.from_dict(mixed).sparse_layers == (False, False, True)


@pytest.mark.parametrize("change,match", [
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok 9 exceeds n_routed_experts 8; set num_experts_per_tok"),
    ({"n_group": 3}, r"8 experts do not divide into n_group 3 groups; set n_group"),
    ({"topk_group": 2}, r"topk_group 2 exceeds n_group 1"),
    ({"first_k_dense_replace": "1"}, r"first_k_dense_replace '1' is not a layer count"),
    ({"routed_scaling_factor": -1}, r"routed_scaling_factor -1 is not a positive number"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
    ({"rope_scaling": True}, r"rope_scaling is not an object of rope settings"),
    ({"rope_parameters": [1]}, r"rope_parameters is not an object of rope settings"),
])
def test_bad_moe_configs_get_one_line_errors(change, match):
    from glmcore.arch.glm4_moe import KEYS, SIZES
    raw = {**KEYS, **{k: v for k, v in SIZES["tiny"].items() if k != "vocab"}, "vocab_size": 512, **change}
    with pytest.raises(ConfigError, match=match) as e:
        ModelConfig.from_dict(raw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("change,match", [
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor 0\.5 on latent attention"),
    ({"rope_interleave": "yes"}, r"rope_interleave 'yes' is not true/false"),
    ({"kv_lora_rank": 0}, r"kv_lora_rank = 0 is not an integer in 1\.\.65536"),
    ({"q_lora_rank": -1}, r"q_lora_rank = -1 is not an integer in 0\.\.65536"),
    ({"mlp_layer_types": ["dense"]}, r"mlp_layer_types must name one kind per layer \(3\)"),
    ({"mlp_layer_types": "dense"}, r"mlp_layer_types must be a list"),
])
def test_bad_latent_attention_configs_get_one_line_errors(change, match):
    from glmcore.arch.glm4_moe_lite import KEYS, SIZES
    spec = {k: v for k, v in SIZES["tiny"].items() if k != "vocab"}
    raw = {**KEYS, **spec, "vocab_size": 512, "mlp_layer_types": ["dense", "sparse", "sparse"], **change}
    with pytest.raises(ConfigError, match=match) as e:
        ModelConfig.from_dict(raw)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- checkpoints

@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_layout_per_expert_and_the_nextn_layer_kept_apart(make_tiny, family):
    path = make_tiny(family)
    cfg = ModelConfig.from_dir(path)
    w = load_weights(path, cfg)
    stored = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in stored and "model.layers.3.eh_proj.weight" in stored
    f = cfg.moe_ffn_hidden_size
    assert w["layers.1.experts.7.ffn_up.weight"].shape == (2 * f, cfg.hidden_size)     # gate rows, then up
    assert w["layers.1.router.bias"].dtype == np.float32
    # the NextN layer (index num_hidden_layers) is loaded for speculative decoding, never as a decoder layer
    assert not any(n.startswith(f"layers.{cfg.num_layers}.") for n in w)
    assert w["mtp.0.eh_proj.weight"].shape == (cfg.hidden_size, 2 * cfg.hidden_size)
    assert "mtp.0.layer.experts.0.ffn_down.weight" in w and "mtp.0.final_norm.weight" in w


def test_experts_gate_and_up_fused_without_reading_them(make_tiny):
    """An expert's gate and up projections, stored back to back, become one view of the mapped file (no copy: a
    large checkpoint's experts stay on disk until a backend reads them) with the rows of both, gate first."""
    path = make_tiny("glm4-moe")
    cfg = ModelConfig.from_dir(path)
    w = load_weights(path, cfg)
    raw = {}
    for shard in path.glob("*.safetensors"):
        raw.update(read_safetensors(shard))
    fused = w["layers.1.experts.5.ffn_up.weight"]
    assert isinstance(fused.base, np.memmap)
    assert np.array_equal(fused, np.concatenate([raw["model.layers.1.mlp.experts.5.gate_proj.weight"],
                                                 raw["model.layers.1.mlp.experts.5.up_proj.weight"]]))


def _copy_without(src: Path, dst: Path, drop=(), reshape: dict | None = None) -> Path:
    shutil.copytree(src, dst)
    for shard in dst.glob("*.safetensors"):
        t = {k: np.array(v) for k, v in read_safetensors(shard).items() if not any(k.startswith(d) for d in drop)}
        for k, shape in (reshape or {}).items():
            if k in t:
                t[k] = np.zeros(shape, t[k].dtype)
        write_safetensors(shard, t)
    index = dst / "model.safetensors.index.json"
    wm = json.loads(index.read_text())
    wm["weight_map"] = {k: v for k, v in wm["weight_map"].items() if not any(k.startswith(d) for d in drop)}
    index.write_text(json.dumps(wm))
    return dst


def test_a_checkpoint_without_its_nextn_layer_loads(make_tiny, tmp_path):
    path = _copy_without(make_tiny("glm4-moe"), tmp_path / "m", drop=("model.layers.3.",))
    cfg = ModelConfig.from_dir(path)
    w = load_weights(path, cfg)
    assert not any(n.startswith("mtp.") for n in w)


@pytest.mark.parametrize("broken,match", [
    (dict(drop=("model.layers.2.mlp.experts.5.down_proj",)), r"tensor layers\.2\.experts\.5\.ffn_down\.weight is missing"),
    (dict(drop=("model.layers.1.mlp.experts.3.up_proj",)), r"layers\.1\.experts\.3\.ffn_up\.weight lacks up"),
    (dict(reshape={"model.layers.3.eh_proj.weight": (64, 96)}), r"mtp\.0\.eh_proj\.weight has shape \(64, 96\) but "
                                                                r"config\.json implies \(64, 128\)"),
    (dict(drop=("model.layers.3.enorm",)), r"tensor mtp\.0\.enorm\.weight is missing"),
])
def test_bad_moe_checkpoints_get_one_line_errors(make_tiny, tmp_path, broken, match):
    path = _copy_without(make_tiny("glm4-moe"), tmp_path / "m", **broken)
    cfg = ModelConfig.from_dir(path)
    with pytest.raises(CheckpointError, match=match) as e:
        load_weights(path, cfg)
    assert "\n" not in str(e.value)


def test_a_layer_past_the_nextn_layers_belongs_to_another_model(make_tiny, tmp_path):
    path = _copy_without(make_tiny("glm4-moe"), tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(raw, num_hidden_layers=2)))   # layer 2 and 3 now past it
    with pytest.raises(CheckpointError, match=r"lie past the 2 decoder layers and 1 NextN layer"):
        load_weights(path, ModelConfig.from_dir(path))


# ---------------------------------------------------------------- the math, against transformers

@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("backend,extra", [("torch", {}), ("ascend_npu", {"mode": "eager"})])
def test_logits_match_transformers(make_tiny, family, backend, extra):
    """Prefill, decode token by token and a 300-token prompt, two sequences in one batch."""
    if backend not in registry().ready():
        pytest.skip(f"{backend} is not ready here")
    path = make_tiny(family)
    model = hf_model(path, family)
    rng = np.random.default_rng(3)
    a, b = [int(t) for t in rng.integers(0, 2000, 300)], [int(t) for t in rng.integers(0, 2000, 20)]
    steps = [[(0, a[:40]), (1, b[:12])]] + [[(0, [a[40 + k]]), (1, [b[12 + k]])] for k in range(6)] + \
        [[(0, a[46:])]]
    got = ours(backend, path, steps, slots=2, **extra)
    close(np.concatenate([got[0][0]] + [g[0] for g in got[1:]]), hf_logits(model, a))
    close(np.concatenate([got[0][1]] + [g[1] for g in got[1:7]]), hf_logits(model, b[:18]))


def group_limited_checkpoint(path: Path):
    """A checkpoint transformers writes itself (its names, its init), with n_group 4 / topk_group 2 so the
    group limit decides, q/k norms on and a correction bias that changes choices. Returns transformers' model."""
    cfg = transformers.Glm4MoeConfig(
        vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=24, n_group=4, topk_group=2, use_qk_norm=True, attention_bias=True,
        routed_scaling_factor=2.5, partial_rotary_factor=0.5)
    torch.manual_seed(0)
    model = transformers.Glm4MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.3 if "norm" not in name else 0.1).add_(1.0 if "norm" in name else 0.0)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model


def test_transformers_own_checkpoint_with_group_limited_routing(tmp_path):
    model = group_limited_checkpoint(tmp_path)
    ids = [int(t) for t in np.random.default_rng(4).integers(0, 300, 50)]
    got = ours("torch", tmp_path, [[(0, ids)]])[0][0]
    close(got, hf_logits(model, ids))


# Configs transformers builds itself (its own defaults wherever a variant is silent), shaped so every backend can
# run them: each variant turns on paths the tiny checkpoints leave off. rms_norm_eps 1e-2 on small latents makes a
# norm given the wrong epsilon visible (transformers' latent norms keep their own 1e-6).
VARIANT_SHAPES = {
    "glm4-moe": dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, n_routed_experts=8,
                     num_experts_per_tok=3, first_k_dense_replace=1, routed_scaling_factor=2.5,
                     num_nextn_predict_layers=0),
    "glm4-moe-lite": dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                          qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32,
                          n_routed_experts=8, num_experts_per_tok=3, first_k_dense_replace=1,
                          routed_scaling_factor=1.8, num_nextn_predict_layers=0),
}
VARIANTS = [
    ("glm4-moe", dict(rms_norm_eps=1e-2, use_qk_norm=True)),
    ("glm4-moe", dict(norm_topk_prob=False, n_shared_experts=2, first_k_dense_replace=0, n_group=4, topk_group=2)),
    ("glm4-moe", dict(partial_rotary_factor=1.0, attention_bias=False, tie_word_embeddings=True,
                      num_key_value_heads=1, n_shared_experts=0)),
    ("glm4-moe-lite", dict(rms_norm_eps=1e-2)),
    ("glm4-moe-lite", dict(q_lora_rank=None, rope_interleave=False, attention_bias=True, rms_norm_eps=1e-2,
                           n_shared_experts=0)),
    ("glm4-moe-lite", dict(mlp_layer_types=["sparse", "dense", "sparse"], norm_topk_prob=False, n_group=4,
                           topk_group=2, n_shared_experts=2)),
    # layer kinds where the two keys disagree: glm4_moe reads first_k_dense_replace, glm4_moe_lite mlp_layer_types
    ("glm4-moe", dict(first_k_dense_replace=2, mlp_layer_types=["sparse", "sparse", "dense"])),
    ("glm4-moe-lite", dict(first_k_dense_replace=2, mlp_layer_types=["dense", "sparse", "dense"])),
    # latent and value widths that are not whole tiles of cpu_int4's kernels (each head's block is padded)
    ("glm4-moe-lite", dict(kv_lora_rank=24, v_head_dim=8, q_lora_rank=None)),
]


def transformers_variant(path: Path, family: str, changes: dict, shapes: dict | None = None, std: float = 0.2):
    """transformers' own model for a variant (VARIANT_SHAPES changed by `changes`, or `shapes` as they are), saved at
    `path` with weights drawn so every path matters."""
    config_class = {"glm4-moe": transformers.Glm4MoeConfig, "glm4-moe-lite": transformers.Glm4MoeLiteConfig}[family]
    torch.manual_seed(0)
    spec = {**(VARIANT_SHAPES[family] if shapes is None else shapes), **changes}
    model = getattr(transformers, HF_CLASS[family])(config_class(**spec)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # the latents small, so the epsilon of their norms decides as much as their weights
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0, 0.003 if "_a_proj" in name else std)
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.mark.parametrize("family,changes", VARIANTS, ids=lambda v: v if isinstance(v, str) else
                         ",".join(f"{k}={x}" for k, x in v.items()))
def test_transformers_config_variants(tmp_path, family, changes):
    """Each backend that runs the MoE GLMs, on checkpoints transformers writes for config variants: the torch
    reference (and ascend_npu's host path) and openvino_amx f32 within the f32 row of transformers' logits; cpu_int4
    within the int8+experts row of the reference on the weights it packed (int4 is its only format)."""
    from glmcore_conformance.metrics import compare, out_of_bounds
    from glmcore_conformance.tolerances import TOLERANCES
    from glmcore_plugins.cpu_int4 import quant
    model = transformers_variant(tmp_path, family, changes)
    ids = [int(t) for t in np.random.default_rng(5).integers(0, 320, 40)]
    steps = [[(0, ids[:30])]] + [[(0, [t])] for t in ids[30:]]
    want = hf_logits(model, ids)

    def logits(run):
        return np.concatenate([s[0] for s in run])
    ready = registry().ready()
    close(logits(ours("torch", tmp_path, steps)), want)
    if "ascend_npu" in ready:
        close(logits(ours("ascend_npu", tmp_path, steps, mode="eager")), want)
    cfg = ModelConfig.from_dir(tmp_path)
    w = load_weights(tmp_path, cfg)
    if "openvino_amx" in ready:
        b = registry().get("openvino_amx")
        opts = b.resolve(LoadOptions(precision="f32", weights="f32", capacity=64, threads=1,
                                     cache_dir=tmp_path / "cache"))
        with b.load_batch(cfg, w, opts, 1) as batch:
            close(logits([batch.step(e, all_logits=True) for e in steps]), want)
    if "cpu_int4" in ready:
        b = registry().get("cpu_int4")
        opts = b.resolve(LoadOptions(capacity=64, threads=1, cache_dir=tmp_path / "cache"))
        with b.load_batch(cfg, w, opts, 1) as batch:
            got = logits([batch.step(e, all_logits=True) for e in steps])
            own = {**dict(w), **quant.dequantized_weights(batch.meta, np.asarray(batch._blob))}
        with registry().get("torch").load_batch(cfg, own, LoadOptions(capacity=64), 1) as ref:
            reference = logits([ref.step(e, all_logits=True) for e in steps])
        figures = compare(reference, got)
        assert not out_of_bounds(figures, TOLERANCES["int8+experts"].bounds()), figures


def test_latent_model_config_without_its_defaulted_keys(tmp_path):
    """A glm4_moe_lite config.json without mlp_layer_types and num_key_value_heads (written by hand, or by a tool
    that drops defaults): transformers' Glm4MoeLiteConfig makes layer 0 dense and the rest MoE whatever
    first_k_dense_replace says, and its default of 20 KV heads changes nothing in latent attention (every head
    reads the whole latent cache); glmcore reads it so, and runs it as transformers' model from the same files."""
    transformers_variant(tmp_path, "glm4-moe-lite", dict(first_k_dense_replace=2))
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["mlp_layer_types"], raw["num_key_value_heads"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.sparse_layers == (False, True, True) and cfg.num_kv_heads == cfg.num_heads == 4
    model = hf_model(tmp_path, "glm4-moe-lite")
    ids = [int(t) for t in np.random.default_rng(7).integers(0, 320, 16)]
    close(ours("torch", tmp_path, [[(0, ids)]])[0][0], hf_logits(model, ids))


@st.composite
def moe_configs(draw):
    """(family, transformers config kwargs): any shape transformers runs and glmcore accepts -- routing (experts,
    top-k, groups, shared experts, dense layers either key), attention (heads, KV groups, head size, partial and
    interleaved rotary, q LoRA, latent and value widths, biases, q/k norms), epsilons, tied embeddings."""
    family = draw(st.sampled_from(MOE_FAMILIES))
    layers, heads = draw(st.integers(1, 3)), draw(st.sampled_from([2, 4, 6]))
    experts = draw(st.sampled_from([4, 8, 16]))
    groups = draw(st.sampled_from([g for g in (1, 2, 4) if g == 1 or experts // g >= 2]))
    topk_group = draw(st.integers(1, groups))
    c = dict(vocab_size=257, hidden_size=draw(st.sampled_from([32, 48, 64])), intermediate_size=64,
             num_hidden_layers=layers, num_attention_heads=heads, moe_intermediate_size=draw(st.sampled_from([16, 24])),
             n_routed_experts=experts, n_group=groups, topk_group=topk_group,
             num_experts_per_tok=draw(st.integers(1, min(experts // groups * topk_group, 6))),
             first_k_dense_replace=draw(st.integers(0, 2)), routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
             norm_topk_prob=draw(st.booleans()), n_shared_experts=draw(st.integers(0, 2)), num_nextn_predict_layers=0,
             rms_norm_eps=draw(st.sampled_from([1e-5, 1e-2])), tie_word_embeddings=draw(st.booleans()),
             attention_bias=draw(st.booleans()), pad_token_id=0, eos_token_id=1, bos_token_id=None)
    theta = draw(st.sampled_from([1e4, 1e6]))
    if family == "glm4-moe":
        head_dim = draw(st.sampled_from([8, 12, 16]))
        factor = draw(st.sampled_from([f for f in (0.25, 0.5, 1.0) if int(head_dim * f) % 2 == 0]))
        c.update(num_key_value_heads=draw(st.sampled_from([k for k in (1, 2, heads) if heads % k == 0])),
                 head_dim=head_dim, use_qk_norm=draw(st.booleans()),
                 rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor})
    else:
        c.update(num_key_value_heads=heads, q_lora_rank=draw(st.sampled_from([None, 16])),
                 kv_lora_rank=draw(st.sampled_from([8, 16, 24])), qk_nope_head_dim=draw(st.sampled_from([8, 16])),
                 qk_rope_head_dim=draw(st.sampled_from([4, 8])), v_head_dim=draw(st.sampled_from([8, 12, 16])),
                 rope_interleave=draw(st.booleans()), rope_parameters={"rope_type": "default", "rope_theta": theta},
                 mlp_layer_types=draw(st.lists(st.sampled_from(["dense", "sparse"]), min_size=layers,
                                               max_size=layers)))
    return family, c


@seed(55)           # random draws (not hypothesis' simplest-first derandomized ones), the same on every run
@settings(max_examples=int(os.environ.get("GLMCORE_FUZZ_EXAMPLES", "10")), deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(case=moe_configs())
def test_any_config_transformers_runs_gives_its_logits(tmp_path_factory, case):
    """Property: for a config drawn from the space both read, the torch reference (and ascend_npu's host path)
    and openvino_amx f32 give transformers' logits within the f32 row, prefill and decode; cpu_int4 runs it (its
    int8 activations make a random model with top-1 routing chaotic, so its accuracy is the fixed variants')."""
    family, spec = case
    path = tmp_path_factory.mktemp("cfg")
    model = transformers_variant(path, family, {}, shapes=spec, std=0.1)
    ids = [int(t) for t in np.random.default_rng(1).integers(0, 257, 24)]
    steps = [[(0, ids[:20])]] + [[(0, [t])] for t in ids[20:]]
    want = hf_logits(model, ids)
    ready = registry().ready()
    for backend, extra in (("torch", {}), ("ascend_npu", {"mode": "eager"})):
        if backend in ready:
            close(np.concatenate([s[0] for s in ours(backend, path, steps, capacity=32, **extra)]), want)
    cfg = ModelConfig.from_dir(path)
    w = load_weights(path, cfg)
    for backend, options in (("openvino_amx", LoadOptions(precision="f32", weights="f32")), ("cpu_int4", LoadOptions())):
        if backend not in ready:
            continue
        b = registry().get(backend)
        opts = b.resolve(dataclasses.replace(options, capacity=32, threads=1, cache_dir=path / "cache"))
        with contextlib.redirect_stderr(io.StringIO()), b.load_batch(cfg, w, opts, 1) as batch:
            got = np.concatenate([batch.step(e, all_logits=True)[0] for e in steps])
        if backend == "openvino_amx":
            close(got, want)
        else:
            assert got.shape == want.shape and np.isfinite(got).all()


# ---------------------------------------------------------------- backends and commands

@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_backends_without_moe_kernels_refuse_naming_those_that_run_it(make_tiny, family):
    from glmcore.model import load_model
    with pytest.raises(BackendError, match=r"cannot run this checkpoint: .* implement glm, not glm4_moe.*backends "
                                           r"that run it: .*ascend_npu.*openvino_amx.*torch") as e:
        load_model(make_tiny(family), "tpu_bm1684x")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_glmcore_run_answers_with_the_checkpoints_own_template(make_tiny, family, capsys):
    """The default backend for an MoE checkpoint is the best ready one that runs it; the prompt is the checkpoint's
    template's (GLM-4.6's [gMASK]<sop><|user|>\\n...<|assistant|>, GLM-4.7-Flash's [gMASK]<sop><|user|>...
    <|assistant|><think>), and the answer streams."""
    from glmcore.cli import main
    path = make_tiny(family)
    assert main(["run", "--model", str(path), "--prompt", "你好", "--max-new-tokens", "4", "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    # a fresh cache quantizes first (its progress lines come before the report)
    # the tests' rule (GLMCORE_AUTOSELECT=0): openvino_amx where OpenVINO has integer kernels, else cpu_int4 where ready
    assert "generated 4 tok" in err and re.search(r"^\[(openvino_amx|cpu_int4|torch)\] ", err, re.M), err
    from glmcore.model import load_model
    m = load_model(path)
    try:
        ids = m.chat_format.encode_messages([__import__("glmcore.chat", fromlist=["as_message"]).as_message(
            {"role": "user", "content": "你好"})])
        sp = m.tokenizer.special_ids
        opening = [sp["<|assistant|>"]] + ([sp["<think>"]] if family == "glm4-moe-lite" else [])
        assert ids[:3] == [sp["[gMASK]"], sp["<sop>"], sp["<|user|>"]] and ids[-len(opening):] == opening, ids
        assert m.tokenizer.decode(ids[3:-len(opening)]) == ("你好" if family == "glm4-moe-lite" else "\n你好")
        assert m.backend.supports(m.config) is None
    finally:
        m.close()


def test_make_model_refuses_an_unknown_size(tmp_path):
    from glmcore.errors import GlmcoreError
    from glmcore.synth import make_model
    with pytest.raises(GlmcoreError, match=r"unknown size '9b' for glm4-moe; choose tiny, small, air, 355b"):
        make_model("glm4-moe", "9b", tmp_path / "m")


def test_tensor_parallel_serves_latent_attention(make_tiny):
    """GLM-4.7-Flash under --tp 2 (latent attention split by heads, glmcore/parallel.py): the server's greedy reply
    is one rank's; more ranks than attention heads are refused in one line."""
    pytest.importorskip("openai", reason="the server tests need the dev extra (openai, httpx)")
    pytest.importorskip("uvicorn", reason='the server needs its extra: pip install "glmcore[server]"')
    from test_server import client, serving

    from glmcore.model import load_model
    from glmcore.pipeline import Pipeline
    from glmcore.sampling import SamplingParams
    d = make_tiny("glm4-moe-lite")
    messages = [{"role": "user", "content": "你好"}]
    want = Pipeline(d, "torch", LoadOptions(threads=1)).chat(messages, params=SamplingParams(temperature=0),
                                                             max_new_tokens=6)
    assert want.reasoning or want.content       # GLM-4.7's template opens the reply inside <think>
    m = load_model(d, "torch", LoadOptions(threads=1, tp=2), slots=2)
    try:
        assert m.backend.name == "torch tp=2"
        with serving(m, "glm4-moe-lite") as url:
            r = client(url).chat.completions.create(model="glm4-moe-lite", messages=messages, max_tokens=6,
                                                    temperature=0)
            said = r.choices[0].message
            assert (getattr(said, "reasoning_content", None) or "", said.content or "") == (want.reasoning,
                                                                                             want.content)
    finally:
        m.close()
    with pytest.raises(BackendError, match=r"^--tp 5: this model has 4 attention heads; use 1\.\.4 ranks$"):
        load_model(d, "torch", LoadOptions(tp=5))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_eval_perplexity_runs_on_the_moe_models(make_tiny, tmp_path, capsys, family):
    from glmcore.cli import main
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. 你好，世界！" * 8, encoding="utf-8")
    assert main(["eval", "--model", str(make_tiny(family)), "--perplexity", str(text), "--ctx", "32", "--chunks", "2",
                 "--threads", "1", "--backend", "torch"]) == 0
    out = capsys.readouterr().out
    ppl = float(re.search(r"PPL = ([0-9.e+]+) .* over 30 tokens \(torch", out).group(1))
    assert np.isfinite(ppl) and ppl > 1, out      # random weights: large, but a number


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_serve_answers_through_the_openai_client(make_tiny, family):
    """glmcore serve on an MoE checkpoint (its default backend, by the speed_rank rule in the tests: openvino_amx
    where OpenVINO has integer kernels (AVX-512 VNNI, AMX), else cpu_int4, torch without a C compiler): the
    reply the Pipeline gives (thought and answer), streamed and not; the template's enable_thinking switch reaches
    the prompt (GLM-4.6's renders /nothink, GLM-4.7-Flash's closes the thought with </think> at once)."""
    pytest.importorskip("openai", reason="the server tests need the dev extra (openai, httpx)")
    pytest.importorskip("uvicorn", reason='the server needs its extra: pip install "glmcore[server]"')
    from test_server import client, serving

    from glmcore.chat import as_message
    from glmcore.model import load_model
    from glmcore.pipeline import Pipeline
    from glmcore.sampling import SamplingParams
    d = make_tiny(family)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "你好"}]
    # f32: random weights give near-flat logits, where bf16's rounding (openvino_amx's default on AVX-512 BF16)
    # in the batched server graph and the one-sequence graph picks different greedy tokens
    opts = LoadOptions(threads=1, precision="f32")
    reply = Pipeline(d, options=opts).chat(messages, params=SamplingParams(temperature=0), max_new_tokens=6)
    want = (reply.reasoning or "", reply.content)
    assert "".join(want)
    m = load_model(d, options=opts, slots=2)
    try:
        plain = m.chat_format.encode_messages([as_message(x) for x in messages])
        nothink = m.chat_format.configured({"enable_thinking": False}).encode_messages(
            [as_message(x) for x in messages])
        sp = m.tokenizer.special_ids
        if family == "glm4-moe-lite":
            assert plain[-1] == sp["<think>"] and nothink[-1] == sp["</think>"]
        else:
            assert sp["/nothink"] in nothink and nothink != plain     # a special token of GLM-4.5
        with serving(m, family) as url:
            c = client(url)
            r = c.chat.completions.create(model=family, messages=messages, max_tokens=6, temperature=0)
            said = r.choices[0].message
            assert (getattr(said, "reasoning_content", None) or "", said.content or "") == want
            chunks = list(c.chat.completions.create(model=family, messages=messages, max_tokens=6, temperature=0,
                                                   stream=True))
            deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
            assert ("".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
                    "".join(d.content or "" for d in deltas)) == want
            r = c.chat.completions.create(model=family, messages=messages, max_tokens=6, temperature=0,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            assert r.usage.prompt_tokens == len(nothink)
    finally:
        m.close()
