"""Backend ascend_npu on the MoE GLMs (glm4_moe, glm4_moe_lite): the experts as torch_npu's fused MoE chain
(npu_moe_gating_top_k -> npu_moe_init_routing_v2 -> npu_grouped_matmul -> npu_swiglu -> npu_grouped_matmul ->
npu_moe_token_unpermute), chosen from the kernels' registered schemas per op-plugin release, held to the torch
reference with the conformance tolerance rows; host routing where the gating kernel cannot express the config;
dense experts where the release has no Tensor group lists; one graph across decode lengths.

The kernels are stand-ins: registered with torch.library under each release's exact schema text
(op_plugin/config/op_plugin_functions.yaml), a Meta kernel shaped as op-plugin's _meta_registrations.py, and a CPU
kernel that computes what the op documents and refuses (assert) what its documentation or Meta kernel refuses."""
from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from glmcore.backend import LoadOptions  # noqa: E402
from glmcore_conformance import TOLERANCES  # noqa: E402
from glmcore_conformance.metrics import compare, out_of_bounds  # noqa: E402
from glmcore_plugins.ascend_npu import AscendNpuBackend  # noqa: E402
from glmcore_plugins.ascend_npu.ops import gating_refusal, moe_ops, moe_summary, npu_gating, select_ops  # noqa: E402
from glmcore_plugins.torch_ref import TorchBackend  # noqa: E402
from glmcore_plugins.torch_ref.ops import torch_route  # noqa: E402
from glmcore_plugins.torch_ref.ops import dense_experts, torch_experts  # noqa: E402

from test_ascend_npu import NPU, _fake_torch_npu, _fake_torchair, ids, model  # noqa: E402

FAMILIES = ["glm4-moe", "glm4-moe-lite"]

# The MoE kernels' schemas exactly as op-plugin registers them, by release (tag and commit in the Ascend/op-plugin
# repository). npu_grouped_matmul: the entry registered for torch 2.1+ ("op_api: [v2.1, newest]").
_SWIGLU = "npu_swiglu(Tensor self, int dim=-1) -> Tensor"
_FINALIZE = ("npu_moe_finalize_routing(Tensor expanded_permuted_rows, Tensor? skip1, Tensor? skip2, Tensor? bias, "
             "Tensor? scales, Tensor expanded_src_to_dst_row, Tensor? export_for_source_row, int? drop_pad_mode=0) "
             "-> Tensor")
_GATING = ("npu_moe_gating_top_k(Tensor x, int k, *, Tensor? bias=None, int k_group=1, int group_count=1, "
           "int group_select_mode=0, int renorm=0, int norm_type=0, bool out_flag=False, "
           "float routed_scaling_factor=1.0, float eps=1e-20) -> (Tensor, Tensor, Tensor)")
_INIT_V2 = ("npu_moe_init_routing_v2(Tensor x, Tensor expert_idx, *, Tensor? scale=None, Tensor? offset=None, "
            "int active_num=-1, int expert_capacity=-1, int expert_num=-1, int drop_pad_mode=0, "
            "int expert_tokens_num_type=0, bool expert_tokens_num_flag=False, int quant_mode=0, "
            "int[2] active_expert_range=[], int row_idx_type=0) -> (Tensor, Tensor, Tensor, Tensor)")
MOE_SCHEMAS = {
    # 6.0.0 (ddb7ed2; 6.0.rc3 b99362e the same): group_list is int[] (host values), no init_routing_v2, no gating
    "6.0.0": {
        "npu_grouped_matmul": (
            "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
            "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
            "int[]? group_list=None, int? split_item=0, ScalarType? output_dtype=None) -> Tensor[]"),
        "npu_moe_init_routing": ("npu_moe_init_routing(Tensor x, Tensor row_idx, Tensor expert_idx, int active_num) "
                                 "-> (Tensor, Tensor, Tensor)"),
        "npu_moe_finalize_routing": _FINALIZE, "npu_swiglu": _SWIGLU},
    # 7.0.0 (7b9ce1c): gating, init_routing_v2 (quant_mode defaults to 0: static int8 quantisation), Tensor group_list
    "7.0.0": {
        "npu_grouped_matmul": (
            "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
            "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
            "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
            "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, "
            "int? group_type=-1, int? group_list_type=0, int? act_type=0, ScalarType? output_dtype=None) -> Tensor[]"),
        "npu_moe_gating_top_k": _GATING, "npu_moe_init_routing_v2": _INIT_V2,
        "npu_moe_finalize_routing": _FINALIZE, "npu_swiglu": _SWIGLU},
    # 7.1.0 (57c5266; 7.3.0 b3065ed the same for these): npu_moe_token_unpermute, tuning_config on the grouped matmul
    "7.1.0": {
        "npu_grouped_matmul": (
            "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
            "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
            "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
            "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, "
            "int? group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, "
            "ScalarType? output_dtype=None) -> Tensor[]"),
        "npu_moe_gating_top_k": _GATING, "npu_moe_init_routing_v2": _INIT_V2,
        "npu_moe_finalize_routing": _FINALIZE, "npu_swiglu": _SWIGLU,
        "npu_moe_token_unpermute": ("npu_moe_token_unpermute(Tensor permuted_tokens, Tensor sorted_indices, "
                                    "Tensor? probs=None, bool padded_mode=False, int[]? restore_shape=None) -> Tensor")},
}
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_LIBRARIES: dict = {}
CALLS: list = []


# ---------------------------------------------------------------- the stand-in kernels

def gating_top_k(x, k, bias=None, k_group=1, group_count=1, group_select_mode=0, renorm=0, norm_type=0,
                 out_flag=False, routed_scaling_factor=1.0, eps=1e-20):
    """torch_npu-npu_moe_gating_top_k.md (7.2.0 on): sigmoid (norm_type 1), bias added for choosing, groups scored by
    their top-2 sum (group_select_mode 1) or max (0), the top k_group groups kept, top-k experts of them; yOut the
    chosen unbiased scores / (sum + eps) * routed_scaling_factor. Constraints as documented."""
    CALLS.append("gating_top_k")
    n, e = x.shape
    assert x.dtype in FLOATS and bias is not None and bias.shape == (e,) and bias.dtype == x.dtype
    assert e <= 2048 and group_count > 0 and e % group_count == 0 and e // group_count > 2
    assert -(-(e // group_count) // 32) * 32 * group_count <= 2048
    assert 1 <= k_group <= group_count and 1 <= k <= k_group * e // group_count
    assert renorm == 0 and not out_flag and group_select_mode in (0, 1)
    assert norm_type == 1, "the stand-in models the sigmoid gating only"
    norm = torch.sigmoid(x.float())
    choice = (norm + bias.float()).view(n, group_count, e // group_count)
    score = choice.topk(2, dim=-1)[0].sum(-1) if group_select_mode == 1 else choice.max(-1)[0]
    kept = torch.zeros_like(score, dtype=torch.bool).scatter(1, score.topk(k_group, dim=-1)[1], True)
    idx = choice.masked_fill(~kept[..., None], float("-inf")).view(n, e).topk(k, dim=-1)[1]
    y = norm.gather(1, idx)
    y = y / (y.sum(-1, keepdim=True) + eps) * routed_scaling_factor
    return y.to(x.dtype), idx.to(torch.int32), norm


def gating_top_k_meta(x, k, bias=None, **kw):
    assert x.dim() == 2 and (bias is None or bias.dim() == 1)        # op-plugin's Meta kernel checks
    return (x.new_empty((x.shape[0], k)), x.new_empty((x.shape[0], k), dtype=torch.int32),
            x.new_empty(x.shape, dtype=torch.float32))


def _range_checks(x, expert_idx, kw):
    """npu_moe_init_routing_v2's Meta kernel (7.0.0) and documentation: 2-D x and expert_idx of the same rows,
    active_expert_range two increasing values within [0, 10240] (its default [] is refused), the modes in range."""
    rng = kw.get("active_expert_range", [])
    assert x.dim() == 2 and expert_idx.dim() == 2 and x.shape[0] == expert_idx.shape[0]
    assert isinstance(rng, list) and len(rng) == 2 and 0 <= rng[0] < rng[1] <= 10240
    assert kw.get("drop_pad_mode", 0) in (0, 1) and kw.get("expert_tokens_num_type", 0) in (0, 1)
    assert kw.get("row_idx_type", 0) in (0, 1) and kw.get("quant_mode", 0) in (-1, 0, 1)
    return rng


def init_routing_v2(x, expert_idx, **kw):
    """Rows r = t*K + j sorted by expert (stable); expanded_x[i] = x[sorted[i] // K]; the gather-type row index
    (row_idx_type 0) maps r to its place; per-expert counts (expert_tokens_num_type 1) or their cumsum (0)."""
    CALLS.append("init_routing_v2")
    start, end = _range_checks(x, expert_idx, kw)
    n, k = expert_idx.shape
    # the modes this stand-in computes: dropless, unquantised, every expert active, every row
    assert kw["quant_mode"] == -1, "quant_mode 0/1 quantise x to int8 (7.0.0's default is 0)"
    assert kw.get("drop_pad_mode", 0) == 0 and kw.get("scale") is None and kw.get("offset") is None
    assert kw["active_num"] in (-1, 0, n * k) and (start, end) == (0, kw["expert_num"])
    assert expert_idx.dtype == torch.int32 and x.dtype in FLOATS
    assert int(expert_idx.min()) >= 0 and int(expert_idx.max()) < kw["expert_num"]
    flat = expert_idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    rows = torch.empty_like(order).scatter_(0, order, torch.arange(n * k)) if kw.get("row_idx_type", 0) == 0 else order
    counts = torch.bincount(flat, minlength=kw["expert_num"])[start:end]
    if kw.get("expert_tokens_num_type", 0) == 0:
        counts = counts.cumsum(0)
    return x[order // k], rows.to(torch.int32), counts.to(torch.int64), torch.zeros(n * k)


def init_routing_v2_meta(x, expert_idx, **kw):
    start, end = _range_checks(x, expert_idx, kw)
    rows = expert_idx.shape[0] * expert_idx.shape[1]
    dtype = x.dtype if kw.get("quant_mode", 0) == -1 else torch.int8
    return (x.new_empty((rows, x.shape[1]), dtype=dtype), x.new_empty((rows,), dtype=torch.int32),
            x.new_empty((end - start,), dtype=torch.int64), x.new_empty((rows,), dtype=torch.float32))


def grouped_matmul(x, weight, **kw):
    """The documented single-tensor form (group_type 0, split_item 2/3): x [M, K] contiguous, weight [E, K, N]
    (transposed storage allowed), group_list a Tensor of E <= 1024 counts (type 1) or cumsum (type 0) adding up
    to M; y [M, N] with each run of rows times its expert's matrix."""
    CALLS.append("grouped_matmul")
    group_list = kw["group_list"]
    assert len(x) == 1 and len(weight) == 1 and x[0].dim() == 2 and weight[0].dim() == 3
    assert kw.get("split_item", 0) in (2, 3) and kw.get("group_type") == 0 and kw.get("act_type", 0) == 0
    assert x[0].is_contiguous() and x[0].dtype == weight[0].dtype and x[0].dtype in FLOATS
    assert isinstance(group_list, torch.Tensor) and group_list.dim() == 1 and group_list.dtype == torch.int64
    assert len(group_list) == weight[0].shape[0] <= 1024 and x[0].shape[1] == weight[0].shape[1]
    assert all(kw.get(a) is None for a in ("bias", "scale", "offset", "antiquant_scale", "per_token_scale"))
    counts = group_list if kw.get("group_list_type", 0) == 1 else torch.diff(group_list, prepend=group_list[:1] * 0)
    assert kw.get("group_list_type", 0) in (0, 1) and int(counts.min()) >= 0 and int(counts.sum()) == x[0].shape[0]
    parts = torch.split(x[0].float(), counts.tolist())
    y = torch.cat([p @ w.float() for p, w in zip(parts, weight[0])])
    return [y.to(kw.get("output_dtype") or x[0].dtype)]


def grouped_matmul_meta(x, weight, **kw):
    n = weight[0].shape[2] if len(weight) == 1 and weight[0].dim() == 3 else weight[0].shape[1]
    assert kw.get("split_item", 0) == 2             # the form used here: one output of all rows (op-plugin's Meta)
    return [x[0].new_empty((sum(t.shape[0] for t in x), n), dtype=kw.get("output_dtype") or x[0].dtype)]


def swiglu(x, dim=-1):
    """swish(A) * B, A the first half along dim (torch_npu-npu_swiglu.md); contiguous input only."""
    CALLS.append("swiglu")
    assert x.is_contiguous() and x.dtype in FLOATS and x.shape[dim] % 2 == 0
    a, b = x.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(a) * b).to(x.dtype)


def swiglu_meta(x, dim=-1):
    shape = list(x.shape)
    shape[dim] //= 2
    return x.new_empty(shape)


def token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    """op-plugin's test_npu_moe_token_permute_and_unpermute.py: row r of the unpermuted [N*K, H] is
    permuted_tokens[sorted_indices[r]]; each token's K rows weighted by probs [N, K] and summed."""
    CALLS.append("token_unpermute")
    assert permuted_tokens.dim() == 2 and sorted_indices.dim() == 1 and sorted_indices.dtype == torch.int32
    assert not padded_mode and probs is not None and probs.dim() == 2
    assert sorted_indices.numel() == permuted_tokens.shape[0] == probs.numel()
    rows = permuted_tokens.float()[sorted_indices.long()].view(*probs.shape, -1)
    return (rows * probs.float()[..., None]).sum(1).to(permuted_tokens.dtype)


def token_unpermute_meta(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    topk = 1 if probs is None else probs.shape[1]
    return permuted_tokens.new_empty((sorted_indices.shape[0] // topk, permuted_tokens.shape[1]))


STAND_INS = {"npu_moe_gating_top_k": (gating_top_k, gating_top_k_meta),
             "npu_moe_init_routing_v2": (init_routing_v2, init_routing_v2_meta),
             "npu_grouped_matmul": (grouped_matmul, grouped_matmul_meta),
             "npu_swiglu": (swiglu, swiglu_meta),
             "npu_moe_token_unpermute": (token_unpermute, token_unpermute_meta)}


def fake_torch_npu(release: str):
    """test_ascend_npu's stand-in torch_npu (attention, RMSNorm, cache update on master's schemas) with the MoE
    kernels of `release` registered under its exact schemas. Kernels registered without a stand-in (v1 routing,
    finalize_routing) have no CPU implementation: a call to them fails."""
    fake, _ = _fake_torch_npu()
    namespace = "glmcore_test_npu_moe_" + release.replace(".", "_")
    if namespace not in _LIBRARIES:
        lib = torch.library.Library(namespace, "DEF")
        for name, schema in MOE_SCHEMAS[release].items():
            lib.define(schema)
            if name in STAND_INS and not (name == "npu_grouped_matmul" and "int[]? group_list" in schema):
                cpu, meta = STAND_INS[name]
                lib.impl(name, cpu, "CPU")
                lib.impl(name, meta, "Meta")
        _LIBRARIES[namespace] = lib
    ops = getattr(torch.ops, namespace)
    for name in MOE_SCHEMAS[release]:
        setattr(fake, name, getattr(ops, name))
    CALLS.clear()
    return fake


def _npu(monkeypatch, release):
    """The stand-in torch_npu of `release` installed; sessions built by the backend take its NPU kernels."""
    from glmcore_plugins.ascend_npu import session as sess
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(release))
    monkeypatch.setattr(sess, "select_ops", lambda device, dtype, soc: select_ops(NPU, dtype, soc))
    return sess


def _runner(sess, cfg, w, precision, mode, capacity=64):
    opts = AscendNpuBackend().resolve(LoadOptions(precision=precision, capacity=capacity,
                                                  extra={"mode": mode, "buckets": "8"}))
    return sess.StepRunner(cfg, w, opts, AscendNpuBackend().capabilities(), torch.device("cpu"), 1, "Ascend910B4")


def _script_logits(runner, script):
    """Each chunk (start, ids) run as one step of the runner, one id as a decode step: all positions' float32
    logits."""
    rows = []
    for start, chunk in script:
        padded = torch.zeros((1, 1 if len(chunk) == 1 else runner.bucket(len(chunk))), dtype=torch.long)
        padded[0, :len(chunk)] = torch.tensor(chunk)
        _, hidden = runner.call(padded, [start], [0], [len(chunk) - 1])
        with torch.inference_mode():
            rows.append(runner.model.logits(hidden[0, :len(chunk)]).float().numpy())
    return np.concatenate(rows)


def _reference_logits(cfg, w, script):
    s = TorchBackend().load(cfg, w, LoadOptions(capacity=64))
    return np.concatenate([s.prefill(chunk, all_logits=True) for _, chunk in script])


def _within(row, want, got):
    bad = out_of_bounds(compare(want, got), TOLERANCES[row].bounds())
    assert not bad, f"{row} row: {bad} out of bounds ({compare(want, got)})"


SCRIPT = [(0, ids(9, 1)), (9, ids(1, 2)), (10, ids(1, 3)), (11, ids(6, 4))]


# ---------------------------------------------------------------- kernel choice per release and config

@pytest.mark.parametrize("release", ["6.0.0", "7.0.0", "7.1.0"])
def test_moe_kernels_are_chosen_from_each_release_schemas(make_tiny, monkeypatch, release):
    fake = fake_torch_npu(release)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    cfg, _ = model(make_tiny, "glm4-moe")
    npu = select_ops(NPU, torch.bfloat16, "Ascend910B4")
    ops = moe_ops(npu, cfg, graph=True)
    summary = moe_summary(fake).split("This torch_npu: ")[1]       # the kernel table's line (glmcore backends)
    assert summary == {"6.0.0": "dense experts (this torch_npu has no npu_moe_init_routing_v2 (op-plugin 7.0.0 on))",
                       "7.0.0": "the fused chain, gating kernel, gather combine",
                       "7.1.0": "the fused chain, gating kernel, npu_moe_token_unpermute"}[release]
    if release == "6.0.0":           # group lists only as host ints: dense under capture, the chosen experts eager
        assert ops.experts is dense_experts and ops.route is torch_route
        assert "npu_moe_init_routing_v2" in ops.kernels["experts"]
        assert moe_ops(npu, cfg, graph=False).experts is torch_experts
        return
    assert ops.route is not torch_route and "npu_moe_gating_top_k" in ops.kernels["moe_routing"]
    assert "npu_grouped_matmul" in ops.kernels["experts"]
    assert ops.kernels["experts"].endswith("-> npu_moe_token_unpermute") == (release == "7.1.0")
    # eager mode takes the same static chain
    assert moe_ops(npu, cfg, graph=False).kernels["experts"] == ops.kernels["experts"]


@pytest.mark.parametrize("change, why", [
    ({"norm_topk_prob": False}, "always renormalises"),
    ({"num_groups": 4, "topk_groups": 2}, "more than 2 experts per group"),     # 8 experts: 2 per group
])
def test_configs_the_gating_kernel_cannot_express_keep_the_host_routing(make_tiny, monkeypatch, change, why):
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu("7.1.0"))
    cfg, _ = model(make_tiny, "glm4-moe")
    cfg = dataclasses.replace(cfg, **change)
    ops = moe_ops(select_ops(NPU, torch.bfloat16, "Ascend910B4"), cfg, graph=True)
    assert ops.route is torch_route and why in ops.kernels["moe_routing"] and "host routing" in ops.kernels["moe_routing"]
    assert "npu_grouped_matmul" in ops.kernels["experts"]          # the experts stay the fused chain


def test_gating_range_follows_the_kernel_documentation(make_tiny):
    cfg, _ = model(make_tiny, "glm4-moe")
    assert gating_refusal(cfg) is None
    assert "2048" in gating_refusal(dataclasses.replace(cfg, num_experts=4096, num_groups=1))
    assert gating_refusal(dataclasses.replace(cfg, num_experts=160, experts_per_token=8)) is None    # GLM-4.5
    assert gating_refusal(dataclasses.replace(cfg, num_experts=64, experts_per_token=4)) is None     # GLM-4.7-Flash


@pytest.mark.parametrize("groups, topk_groups, scaling", [(1, 1, 2.5), (2, 1, 1.0), (4, 2, 1.8)])
def test_npu_gating_chooses_and_weighs_as_the_host_router(make_tiny, monkeypatch, groups, topk_groups, scaling):
    """The gating kernel (its documented computation) against torch_route on the same fp32 logits and bias,
    with group limiting (16 experts in groups of 16, 8, 4) and the routed scaling factor."""
    fake = fake_torch_npu("7.1.0")
    cfg, _ = model(make_tiny, "glm4-moe")
    cfg = dataclasses.replace(cfg, num_experts=16, experts_per_token=3, num_groups=groups, topk_groups=topk_groups,
                              routed_scaling=scaling)
    g = torch.Generator().manual_seed(groups)
    h, router = torch.randn(40, 24, generator=g), torch.randn(16, 24, generator=g)
    bias = torch.randn(16, generator=g) * 0.5
    chosen, weights = npu_gating(fake, cfg)(cfg, h, router, bias)
    want_chosen, want_weights = torch_route(cfg, h, router, bias)
    assert chosen.dtype == torch.int32 and CALLS == ["gating_top_k"]
    order, want_order = chosen.long().sort(-1), want_chosen.sort(-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), want_weights.gather(1, want_order.indices))


# ---------------------------------------------------------------- the fused chain against the torch reference

@pytest.mark.parametrize("release", ["7.0.0", "7.1.0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_moe_matches_the_reference(make_tiny, monkeypatch, family, release):
    """Eager steps (prefill, decodes, an append) on the fused chain: f32 to the f32 row (the chain computes the
    reference's math, only summation order differs), bf16 to the bf16+experts row."""
    sess = _npu(monkeypatch, release)
    cfg, w = model(make_tiny, family)
    want = _reference_logits(cfg, w, SCRIPT)
    for precision, row in (("f32", "f32"), ("bf16", "bf16+experts")):
        CALLS.clear()
        runner = _runner(sess, cfg, w, precision, "eager")
        _within(row, want, _script_logits(runner, SCRIPT))
        combine = "token_unpermute" if release == "7.1.0" else None
        sparse = sum(cfg.sparse_layers)
        assert CALLS[:5] == ["gating_top_k", "init_routing_v2", "grouped_matmul", "swiglu", "grouped_matmul"]
        assert CALLS.count("gating_top_k") == sparse * len(SCRIPT)
        assert CALLS.count("token_unpermute") == (sparse * len(SCRIPT) if combine else 0)


def test_host_routing_with_fused_experts_matches_the_reference(make_tiny, monkeypatch):
    """norm_topk_prob off: the gating kernel cannot (it always renormalises), so torch_route chooses and the
    fused chain computes the experts; still the reference's logits."""
    sess = _npu(monkeypatch, "7.1.0")
    cfg, w = model(make_tiny, "glm4-moe")
    cfg = dataclasses.replace(cfg, norm_topk_prob=False)
    want = _reference_logits(cfg, w, SCRIPT)
    runner = _runner(sess, cfg, w, "f32", "eager")
    _within("f32", want, _script_logits(runner, SCRIPT))
    assert "gating_top_k" not in CALLS and "grouped_matmul" in CALLS


@pytest.mark.parametrize("release", ["6.0.0", "7.1.0"])
def test_moe_graph_compiles_once_across_decode_lengths(make_tiny, monkeypatch, release):
    """As on the NPU (torchair stand-in, dynamic=True with static tensor shapes): two prefill chunks of one bucket
    at starts 0 and 8 make one graph, decodes at lengths 17 and 18 one more; the MoE kernels (Meta kernels of the
    release's schemas) trace with static shapes. 7.1.0: the fused chain; 6.0.0: dense experts. Both held to the
    torch reference by the bf16+experts row."""
    sess = _npu(monkeypatch, release)
    graphs = []

    def eager_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setitem(sys.modules, "torchair", _fake_torchair(lambda compiler_config: eager_backend))
    cfg, w = model(make_tiny, "glm4-moe")
    runner = _runner(sess, cfg, w, "bf16", "graph", capacity=32)
    runner.on_npu = True                                       # tensors on the CPU, the NPU's compile path
    runner._step = runner._compile()
    torch._dynamo.reset()
    script = [(0, ids(8, 81)), (8, ids(8, 82)), (16, ids(1, 83)), (17, ids(1, 84))]
    got = _script_logits(runner, script)
    assert len(graphs) == 2, f"{len(graphs)} graphs for two prefill chunks of one bucket and two decode steps"
    fused = any("npu_moe_init_routing_v2" in str(n.target) for g in graphs for n in g.graph.nodes)
    assert fused == (release == "7.1.0")
    _within("bf16+experts", _reference_logits(cfg, w, script), got)


def test_batched_decode_rows_share_the_fused_chain(make_tiny, monkeypatch):
    """A batch session (two slots, prompts of different lengths, then decode steps of both rows in one call): the
    fused chain routes the rows of several sequences together; each slot's logits are the single-sequence
    reference's (f32 row)."""
    sess = _npu(monkeypatch, "7.1.0")
    cfg, w = model(make_tiny, "glm4-moe-lite")
    opts = AscendNpuBackend().resolve(LoadOptions(precision="f32", capacity=64, extra={"mode": "eager"}))
    batch = sess.AscendBatchSession(cfg, w, opts, AscendNpuBackend().capabilities(), torch.device("cpu"), 2,
                                    "Ascend910B4")
    prompts, decodes = [ids(7, 91), ids(4, 92)], [ids(3, 93), ids(3, 94)]
    got = [[batch.step([(slot, prompts[slot])], all_logits=True)[0]] for slot in (0, 1)]
    for j in range(3):
        rows = batch.step([(0, [decodes[0][j]]), (1, [decodes[1][j]])], all_logits=True)
        for slot in (0, 1):
            got[slot].append(rows[slot])
    assert "grouped_matmul" in CALLS and batch.runner.ops.kernels["experts"].startswith("torch_npu")
    for slot in (0, 1):
        want = _reference_logits(cfg, w, [(0, prompts[slot] + decodes[slot])])
        _within("f32", want, np.concatenate(got[slot]))
