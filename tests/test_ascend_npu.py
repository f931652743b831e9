"""Backend ascend_npu: the graph-captured GLM model against the torch reference, in eager and graph mode;
one compile per static shape, zero graph breaks, a static KV cache that decode never grows; the NPU
kernel dispatch checked against the documented torch_npu signatures; options, probe and errors.

Graph-mode sessions compile with inductor (tens of seconds each on 2 cores), so the graph tests share
one compiled session with small prefill buckets (8, 32: three graphs with decode)."""
from __future__ import annotations

import importlib.machinery
import math
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from glmcore.backend import LoadOptions, registry  # noqa: E402
from glmcore.config import ModelConfig  # noqa: E402
from glmcore.errors import BackendError  # noqa: E402
from glmcore.weights import load_weights  # noqa: E402
from glmcore_plugins.ascend_npu import AscendNpuBackend, device_precisions  # noqa: E402
from glmcore_plugins.torch_ref.forward import DenseGLM, to_device  # noqa: E402
from glmcore_plugins.ascend_npu.ops import select_ops  # noqa: E402
from glmcore_plugins.torch_ref import TorchBackend  # noqa: E402

from glmcore.config import FAMILIES  # noqa: E402
CAP = 128


def model(make_tiny, family, **kw):
    d = make_tiny(family, **kw)
    cfg = ModelConfig.from_dir(d)
    return cfg, load_weights(d, cfg)


def ascend(cfg, weights, capacity=CAP, precision="f32", **extra):
    return AscendNpuBackend().load(cfg, weights, LoadOptions(precision=precision, capacity=capacity,
                                                             extra={"device": "cpu", **extra}))


def reference(cfg, weights, capacity=CAP):
    return TorchBackend().load(cfg, weights, LoadOptions(capacity=capacity))


def run(session, script):
    """script: ("p", ids) prefill with all logits | ("d", ids) decode each | "r" reset. Stacked logits."""
    out = []
    for step in script:
        if step == "r":
            session.reset()
            continue
        kind, ids = step
        if kind == "p":
            out.append(session.prefill(ids, all_logits=True))
        else:
            out.extend(session.decode(t)[None] for t in ids)
    return np.concatenate(out)


def ids(n, seed, vocab=1000):
    return np.random.default_rng(seed).integers(5, vocab, n).tolist()


def rel_l2(a, b):
    return float((np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)).max())


# ---------------------------------------------------------------- registration, probe, options

def test_registered_and_probe_reports_device_versions_and_mode():
    reg = registry()
    assert "ascend_npu" in reg.names()
    p = reg.probe("ascend_npu")
    assert p.ready, p.reason
    assert p.device in ("npu:0", "cuda:0", "cpu")
    assert p.details["torch"] == torch.__version__
    assert "torch_npu" in p.details and p.details["mode"].startswith("graph")
    assert p.details["compiler"] in ("inductor", "torchair npu backend, frozen parameters") or "g++" in p.details["compiler"]


def test_capabilities_per_device_and_option_errors(make_tiny):
    caps = AscendNpuBackend().capabilities()
    assert not caps.can_shift and "f32" in caps.precisions and "bf16" in caps.precisions
    assert caps.weight_formats == caps.precisions      # weights live in the compute precision
    cpu = device_precisions("cpu")
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        assert "f16" in cpu
    else:                                              # this host: AVX2, fp16 matmul is a slow fallback
        assert cpu == ("f32", "bf16")
    cfg, w = model(make_tiny, "chatglm3")
    b = AscendNpuBackend()
    with pytest.raises(BackendError, match="mode=graph or mode=eager"):
        ascend(cfg, w, mode="fast")
    with pytest.raises(BackendError, match="buckets"):
        ascend(cfg, w, buckets="0,abc")
    with pytest.raises(BackendError, match="--weights f32"):
        b.resolve(LoadOptions(precision="f32", weights="bf16"))
    with pytest.raises(BackendError, match="not available here"):
        ascend(cfg, w, device="npu:0") if not hasattr(torch, "npu") else ascend(cfg, w, device="xpu")
    if "f16" not in cpu:
        with pytest.raises(BackendError, match="no precision .f16. on cpu .this CPU has no native fp16"):
            ascend(cfg, w, precision="f16")
    assert b.resolve(LoadOptions(precision="bf16")).weights == "bf16"


def test_kernels_are_chosen_once_at_load_and_reported(make_tiny):
    cfg, w = model(make_tiny, "chatglm3")
    s = ascend(cfg, w, mode="eager")
    r = s.report()
    assert r["device"] == "cpu" and r["mode"] == "eager" and r["precision"] == "f32"
    assert s.model.ops is s.ops and s.ops.name == "torch"
    assert "scaled_dot_product_attention" in r["kernels"]["attention"]
    assert "rms_norm" in r["kernels"]["rms_norm"]


# ---------------------------------------------------------------- eager mode against the reference

@pytest.mark.parametrize("family", FAMILIES)
def test_eager_f32_matches_reference(make_tiny, family):
    cfg, w = model(make_tiny, family)
    script = [("p", ids(23, 1)), ("d", ids(6, 2)), ("p", ids(9, 3)), ("d", ids(3, 4)), "r",
              ("p", ids(5, 5)), ("d", ids(2, 6))]
    got, want = run(ascend(cfg, w, mode="eager"), script), run(reference(cfg, w), script)
    assert np.abs(got - want).max() < 1e-3
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_bf16_weights_go_to_the_device_in_bf16_and_stay_close(make_tiny):
    cfg, w = model(make_tiny, "glm4", dtype="bf16")     # a bf16 checkpoint, as GLM-4 ships
    s = ascend(cfg, w, precision="bf16", mode="eager")
    layer = s.model.layers[0]
    assert layer.qkv.dtype == torch.bfloat16 and s.k_cache[0].dtype == torch.bfloat16
    assert layer.input_norm.dtype == torch.float32     # norms run in fp32 on the fp32 residual
    # bf16 checkpoint -> bf16 parameter is a bitwise copy (no fp32 detour, no rounding)
    raw = np.asarray(w["layers.0.qkv.weight"]).view(np.uint16)
    assert np.array_equal(layer.qkv.view(torch.int16).numpy().view(np.uint16), raw)
    script = [("p", ids(24, 7)), ("d", ids(16, 8))]
    got, want = run(s, script), run(reference(cfg, w), script)
    # Measured on the tiny families: rel L2 ~0.013-0.03, top-1 >= 0.95 (matmul inputs and outputs in
    # bf16 on these sharp synthetic models); a positional bug measures rel L2 ~0.5-1.
    assert rel_l2(got, want) < 0.06
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_to_device_converts_without_changing_values():
    import ml_dtypes
    a = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    p = to_device(a.astype(ml_dtypes.bfloat16), torch.device("cpu"), torch.float32)
    assert p.dtype == torch.float32 and not p.requires_grad
    assert np.array_equal(p.numpy(), a.astype(ml_dtypes.bfloat16).astype(np.float32))


# ---------------------------------------------------------------- graph mode (one shared compiled session)

COMPILES_AT_LOAD: list[int] = []     # the shared session's compile count right after load (tests run in any order)


@pytest.fixture(scope="module")
def graph(make_tiny):
    cfg, w = model(make_tiny, "chatglm3")
    s = ascend(cfg, w, buckets="8,32")                  # no mode given: graph is the default
    COMPILES_AT_LOAD.append(s.compiles)
    yield cfg, w, s
    s.close()


def test_graph_matches_reference_through_buckets_chunks_and_appends(graph):
    cfg, w, s = graph
    assert s.mode == "graph" and s.report()["compiler"] == "inductor" and s.report()["prefill buckets"] == [8, 32]
    assert COMPILES_AT_LOAD[-1] <= 1     # the decode graph, compiled at load (0: this process compiled it before)
    # 5 -> bucket 8; 20 appended -> bucket 32; 70 appended -> chunks 32+32+6; decode in between
    script = ["r", ("p", ids(5, 11)), ("d", ids(6, 12)), ("p", ids(20, 13)), ("d", ids(3, 14)),
              ("p", ids(70, 15)), ("d", ids(4, 16))]
    got, want = run(s, script), run(reference(cfg, w), script)
    assert s.kv_len == 5 + 6 + 20 + 3 + 70 + 4
    assert np.abs(got - want).max() < 1e-3
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_graph_near_capacity_pads_into_the_spare_slots(graph):
    cfg, w, s = graph
    # capacity-1 ids: the last chunk (31 ids in a 32 bucket) pads past the capacity, into spare slots
    script = ["r", ("p", ids(CAP - 1, 21)), ("d", ids(1, 22))]
    got, want = run(s, script), run(reference(cfg, w), script)
    assert s.kv_len == CAP
    assert np.abs(got - want).max() < 1e-3
    with pytest.raises(BackendError, match="overflow"):
        s.decode(1)
    s.reset()
    assert s.kv_len == 0


def test_graph_compiles_once_per_shape_not_per_step(graph):
    _, _, s = graph
    s.reset()
    before = s.compiles                                # other tests of the shared session may have run first
    s.prefill(ids(5, 31))                              # bucket 8
    s.prefill(ids(20, 32))                             # bucket 32
    s.decode(7)                                        # decode
    warm = s.compiles
    assert warm - before <= 3                          # buckets 8 and 32, and decode: nothing else, ever
    for n in (1, 3, 8, 9, 17, 32):
        s.prefill(ids(n, 40 + n))
    for t in ids(30, 33):
        s.decode(t)
    assert s.compiles == warm, "a prefill length inside the buckets or a decode step recompiled"


def explain(m, ids_shape, k_cache, v_cache, n_rows_slots=None):
    b, t = ids_shape
    slots = torch.arange(b) if n_rows_slots is None else torch.tensor(n_rows_slots)
    with torch.inference_mode():
        return torch._dynamo.explain(m.forward)(torch.zeros(ids_shape, dtype=torch.long), torch.zeros(b, dtype=torch.long),
                                                slots, torch.zeros(b, dtype=torch.long), k_cache, v_cache)


def test_graph_has_no_graph_breaks(graph):
    _, _, s = graph
    for t in (1, 8, 32):                               # decode and both prefill buckets
        ex = explain(s.model, (1, t), s.k_cache, s.v_cache)
        assert ex.graph_break_count == 0, ex.break_reasons
        assert ex.graph_count == 1


def test_graph_decode_updates_the_cache_in_place_and_never_grows(graph):
    from torch.profiler import ProfilerActivity, profile
    cfg, _, s = graph
    s.reset()
    s.prefill(ids(4, 51))
    s.decode(3)
    ptrs = [t.data_ptr() for t in s.k_cache + s.v_cache]
    # torch's CPU allocator has no counter like cuda.memory_allocated; the profiler's allocator hook
    # records every allocation and free, so the sum over the window is the net growth.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for t in ids(100, 52):
            s.decode(t)
    events = prof.events()
    net = sum(e.self_cpu_memory_usage for e in events)
    allocated = sum(e.self_cpu_memory_usage for e in events if e.self_cpu_memory_usage > 0)
    assert net == 0, f"decode grew memory by {net} bytes over 100 steps"
    assert [t.data_ptr() for t in s.k_cache + s.v_cache] == ptrs     # the static cache, written in place
    # Per step only the step's own small temporaries and the logits: nothing the size of a cache layer.
    logits = cfg.vocab_size * 4
    layer = s.k_cache[0].numel() * s.k_cache[0].element_size()
    assert allocated / 100 < logits + layer, f"{allocated / 100:.0f} bytes per decode step"
    assert s.kv_len == 105


# ---------------------------------------------------------------- the NPU path, on documented signatures

# The kernels' schemas exactly as op-plugin registers them (op_plugin/config/op_plugin_functions.yaml, master
# 517f2e7): what dynamo sees when it traces a torch_npu call. Note the length types: int[] for the prompt kernel,
# SymInt[] for the incremental and the fused infer kernel.
SCHEMAS = {
    "npu_rms_norm": "npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
    "scatter_update_": "scatter_update_(Tensor(a!) self, Tensor indices, Tensor updates, int axis) -> Tensor(a!)",
    "npu_prompt_flash_attention": (
        "npu_prompt_flash_attention(Tensor query, Tensor key, Tensor value, *, Tensor? padding_mask=None, "
        "Tensor? atten_mask=None, Tensor? pse_shift=None, int[]? actual_seq_lengths=None, Tensor? deq_scale1=None, "
        "Tensor? quant_scale1=None, Tensor? deq_scale2=None, Tensor? quant_scale2=None, Tensor? quant_offset2=None, "
        "int num_heads=1, float scale_value=1.0, int pre_tokens=2147483647, int next_tokens=0, str input_layout=\"BSH\", "
        "int num_key_value_heads=0, int[]? actual_seq_lengths_kv=None, int sparse_mode=0) -> Tensor"),
    "npu_incre_flash_attention": (
        "npu_incre_flash_attention(Tensor query, Tensor key, Tensor value, *, Tensor? padding_mask=None, "
        "Tensor? atten_mask=None, Tensor? pse_shift=None, SymInt[]? actual_seq_lengths=None, "
        "Tensor? antiquant_scale=None, Tensor? antiquant_offset=None, Tensor? block_table=None, "
        "Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, "
        "Tensor? quant_scale2=None, Tensor? quant_offset2=None, Tensor? kv_padding_size=None, int num_heads=1, "
        "float scale_value=1.0, str input_layout=\"BSH\", int num_key_value_heads=0, int block_size=0, "
        "int inner_precise=1) -> Tensor"),
    "npu_fused_infer_attention_score": (
        "npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, "
        "Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None, "
        "Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, "
        "Tensor? quant_scale2=None, Tensor? quant_offset2=None, Tensor? antiquant_scale=None, "
        "Tensor? antiquant_offset=None, Tensor? key_antiquant_scale=None, Tensor? key_antiquant_offset=None, "
        "Tensor? value_antiquant_scale=None, Tensor? value_antiquant_offset=None, Tensor? block_table=None, "
        "Tensor? query_padding_size=None, Tensor? kv_padding_size=None, Tensor? key_shared_prefix=None, "
        "Tensor? value_shared_prefix=None, SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, "
        "Tensor? key_rope=None, Tensor? key_rope_antiquant_scale=None, int num_heads=1, float scale=1.0, "
        "int pre_tokens=2147483647, int next_tokens=2147483647, str input_layout=\"BSH\", int num_key_value_heads=0, "
        "int sparse_mode=0, int inner_precise=0, int block_size=0, int antiquant_mode=0, int key_antiquant_mode=0, "
        "int value_antiquant_mode=0, bool softmax_lse_flag=False) -> (Tensor, Tensor)"),
}
# Older releases' schemas (same source, their branches), by the op-plugin release and config folder:
#  - 6.0.rc1 v2r1 (torch_npu 2.1.0-6.0.rc1): the fused kernel exists but types its lengths int[];
#  - 6.0.rc2 v2r3 (torch_npu v2.3.1-6.0.rc2; v2r2/v2r4 and 6.0.rc1's v2r2/v2r3 the same for these kernels): no fused
#    kernel, a prompt kernel without pse_shift / actual_seq_lengths_kv / sparse_mode (line 2345), int[] lengths on
#    the incremental kernel (line 2348).
OLDER_SCHEMAS = {
    "6.0.rc1-v2r1": {**SCHEMAS, "npu_fused_infer_attention_score": (
        "npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, "
        "Tensor? atten_mask=None, int[]? actual_seq_lengths=None, int[]? actual_seq_lengths_kv=None, "
        "Tensor? antiquant_scale=None, Tensor? antiquant_offset=None, Tensor? block_table=None, "
        "Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, Tensor? quant_scale2=None, "
        "Tensor? quant_offset2=None, Tensor? query_padding_size=None, Tensor? kv_padding_size=None, int num_heads=1, "
        "float scale=1.0, int pre_tokens=2147483647, int next_tokens=2147483647, str input_layout=\"BSH\", "
        "int num_key_value_heads=0, int sparse_mode=0, int inner_precise=0, int block_size=0, int antiquant_mode=0, "
        "bool softmax_lse_flag=False) -> (Tensor, Tensor)")},
    "6.0.rc2-v2r3": {**{k: v for k, v in SCHEMAS.items() if k != "npu_fused_infer_attention_score"},
                     "npu_prompt_flash_attention": (
        "npu_prompt_flash_attention(Tensor query, Tensor key, Tensor value, *, Tensor? padding_mask=None, "
        "Tensor? atten_mask=None, int[]? actual_seq_lengths=None, int num_heads=1, float scale_value=1.0, "
        "int pre_tokens=2147473647, int next_tokens=0, str input_layout=\"BSH\", int num_key_value_heads=0) -> Tensor"),
                     "npu_incre_flash_attention": (
        "npu_incre_flash_attention(Tensor query, Tensor key, Tensor value, *, Tensor? padding_mask=None, "
        "Tensor? atten_mask=None, int[]? actual_seq_lengths=None, Tensor? antiquant_scale=None, "
        "Tensor? antiquant_offset=None, Tensor? block_table=None, Tensor? dequant_scale1=None, Tensor? quant_scale1=None, "
        "Tensor? dequant_scale2=None, Tensor? quant_scale2=None, Tensor? quant_offset2=None, "
        "Tensor? kv_padding_size=None, int num_heads=1, float scale_value=1.0, str input_layout=\"BSH\", "
        "int num_key_value_heads=0, int block_size=0, int inner_precise=1) -> Tensor")},
}
_LIBRARIES: dict = {}      # namespace -> (torch.library.Library, calls): registered once per process
_CALLS: list = []          # what the CPU kernels of the current fake were called with


def _npu_library(release: str | None = None):
    """Register the kernels under torch.ops.<namespace> with the vendor schemas of `release` (an OLDER_SCHEMAS
    key; None: master), a Meta kernel each (what dynamo traces with, shaped as op-plugin's Meta kernels) and a
    CPU kernel that computes the documented result."""
    namespace = "glmcore_test_npu" + (release or "").replace(".", "_").replace("-", "_")
    if namespace in _LIBRARIES:
        return getattr(torch.ops, namespace), _LIBRARIES[namespace][1]
    schemas = OLDER_SCHEMAS[release] if release else SCHEMAS
    lib = torch.library.Library(namespace, "DEF")
    for schema in schemas.values():
        lib.define(schema)

    def rms_norm(x, gamma, epsilon=1e-06):
        _CALLS.append("rms_norm")
        assert x.dtype == gamma.dtype
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
        return (x.float() * rstd * gamma.float()).to(x.dtype), rstd

    def rms_norm_meta(x, gamma, epsilon=1e-06):
        return torch.empty_like(x), x.new_empty(x.shape[:-1] + (1,), dtype=torch.float32)

    def scatter_update_(data, indices, updates, axis):
        _CALLS.append("scatter_update_")
        assert axis == -2 and indices.dtype == torch.long and indices.dim() == 1
        for b in range(data.shape[0]):
            data[b].narrow(data.dim() - 3, int(indices[b]), updates.shape[-2]).copy_(updates[b])
        return data

    def fa(query, key, value, atten_mask, num_heads, scale, input_layout, num_key_value_heads, kv_lens):
        """BNSD, atten_mask True = masked out, GQA through num_key_value_heads; a row reads only its
        first kv_lens[b] keys."""
        assert input_layout == "BNSD" and query.is_contiguous() and query.dtype in (torch.float16, torch.bfloat16)
        assert query.shape[1] == num_heads and key.shape[1] == num_key_value_heads
        b = query.shape[0]
        assert atten_mask.shape == (b, 1, query.shape[2], key.shape[2]) and atten_mask.dtype == torch.bool
        g = num_heads // num_key_value_heads
        k = key.float().repeat_interleave(g, 1)
        v = value.float().repeat_interleave(g, 1)
        s = query.float() @ k.transpose(-1, -2) * scale
        s = s.masked_fill(atten_mask, float("-inf"))
        if kv_lens is not None:
            assert len(kv_lens) == b and all(isinstance(n, int) for n in kv_lens)
            beyond = torch.arange(key.shape[2])[None, :] >= torch.tensor(kv_lens)[:, None]
            s = s.masked_fill(beyond[:, None, None, :], float("-inf"))
        return (s.softmax(-1) @ v).to(query.dtype)

    def prompt(query, key, value, **kw):
        _CALLS.append(("prompt_fa", kw.get("actual_seq_lengths_kv")))
        # keyword-only arguments arrive as passed (the schema's defaults are not filled in)
        assert kw.get("sparse_mode", 0) == 0 and kw.get("next_tokens", 0) >= key.shape[2]   # the mask alone decides
        return fa(query, key, value, kw["atten_mask"], kw["num_heads"], kw.get("scale_value", 1.0),
                  kw["input_layout"], kw["num_key_value_heads"], kw.get("actual_seq_lengths_kv"))

    def incre(query, key, value, **kw):
        table = kw.get("block_table")
        _CALLS.append(("incre_fa" if table is None else "paged_fa", kw.get("actual_seq_lengths")))
        assert query.shape[2] == 1
        if table is not None:     # page attention, under its documented constraints (see paged_attention_read)
            key, value, mask = paged_attention_read(query, key, value, table, kw)
            return fa(query, key, value, mask, kw["num_heads"], kw.get("scale_value", 1.0), kw["input_layout"],
                      kw["num_key_value_heads"], kw["actual_seq_lengths"])
        return fa(query, key, value, kw["atten_mask"], kw["num_heads"], kw.get("scale_value", 1.0),
                  kw["input_layout"], kw["num_key_value_heads"], kw.get("actual_seq_lengths"))

    def fused(query, key, value, **kw):
        _CALLS.append(("fused_fa", kw.get("actual_seq_lengths_kv")))
        assert kw.get("sparse_mode", 0) == 0 and kw.get("next_tokens", 2147483647) >= key.shape[2]
        out = fa(query, key, value, kw["atten_mask"], kw["num_heads"], kw.get("scale", 1.0), kw["input_layout"],
                 kw["num_key_value_heads"], kw.get("actual_seq_lengths_kv"))
        return out, torch.empty(0)       # softmax_lse_flag=False: no lse (op-plugin's Meta kernel: shape [0])

    def attention_meta(query, key, value, **kw):
        return torch.empty_like(query)

    def fused_meta(query, key, value, **kw):
        # op-plugin's _meta_registrations.py (npu_fused_infer_attention_score_forward): lse [0] unless softmax_lse_flag
        assert not kw.get("softmax_lse_flag", False)
        return torch.empty_like(query), query.new_empty((0,), dtype=torch.float32)

    for name, cpu, meta in (("npu_rms_norm", rms_norm, rms_norm_meta),
                            ("scatter_update_", scatter_update_, lambda data, *a: data),
                            ("npu_prompt_flash_attention", prompt, attention_meta),
                            ("npu_incre_flash_attention", incre, attention_meta),
                            ("npu_fused_infer_attention_score", fused, fused_meta)):
        if name in schemas:
            lib.impl(name, cpu, "CPU")
            lib.impl(name, meta, "Meta")
    _LIBRARIES[namespace] = lib, list(schemas)
    return getattr(torch.ops, namespace), list(schemas)


def paged_attention_read(query, key, value, table, kw):
    """What npu_incre_flash_attention's page attention reads (op-plugin docs/zh/custom_APIs/torch_npu/
    torch_npu-npu_incre_flash_attention.md, "page attention使用限制"): block_table int32 [B, maxBlockNumPerSeq]
    of block indices in [0, blocknum), the cache [blocknum, numKvHeads, blocksize, headDims] with a BNSD query,
    block_size 16-aligned for fp16/bf16, and every row's actual_seq_lengths. Returns each row's blocks in order as
    [B, Hkv, M * block_size, D] and an all-False mask (the lengths bound each row)."""
    lens = kw.get("actual_seq_lengths")
    size = kw.get("block_size", 0)
    b, m = table.shape
    assert lens is not None and len(lens) == b == query.shape[0] and table.dtype == torch.int32
    assert kw["input_layout"] == "BNSD" and key.dim() == 4 and key.shape[2] == size and size % 16 == 0
    assert int(table.min()) >= 0 and int(table.max()) < key.shape[0] and m * size >= max(lens)
    assert kw.get("atten_mask") is None
    k, v = ((c[table.long()].transpose(1, 2).reshape(b, c.shape[1], m * size, c.shape[3])) for c in (key, value))
    return k, v, torch.zeros((b, 1, 1, m * size), dtype=torch.bool)


def _fake_torch_npu(release: str | None = None):
    """A torch_npu module as the real one exposes its kernels (torch_npu.X is the torch.ops.npu.X packet; a kernel
    its op-plugin lacks is no attribute), backed by _npu_library: documented signatures, so a wrong keyword or
    type raises, and the kernels compute the documented result on the CPU. release: an OLDER_SCHEMAS key."""
    ops, names = _npu_library(release)
    _CALLS.clear()
    mod = types.ModuleType("torch_npu")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)     # find_spec reads it, as for a real import
    for name in names:
        setattr(mod, name, getattr(ops, name))
    return mod, _CALLS


NPU = types.SimpleNamespace(type="npu")               # torch.device("npu") exists only with torch_npu


def _run_steps(m, kc, vc, steps):
    """steps: (ids [B, T] list, start list, slots list, last list); stacked logits."""
    rows = []
    with torch.inference_mode():
        for ids, start, slots, last in steps:
            seq_lens = [s + len(ids[0]) for s in start] if m.ops.seq_lens else None
            rows.append(m(torch.tensor(ids), torch.tensor(start), torch.tensor(slots), torch.tensor(last), kc, vc,
                          seq_lens)[0])
    return torch.cat(rows).float().numpy()


def test_npu_dispatch_uses_the_documented_kernels_with_per_row_lengths(make_tiny, monkeypatch):
    fake, calls = _fake_torch_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    cfg, w = model(make_tiny, "chatglm3")
    cpu, positions = torch.device("cpu"), 64
    ops = select_ops(NPU, torch.bfloat16, "Ascend910B4")
    assert ops.name == "npu" and ops.seq_lens and "npu_incre_flash_attention" in ops.kernels["attention"]
    npu_model = DenseGLM(cfg, w, cpu, torch.bfloat16, ops, positions)
    host_model = DenseGLM(cfg, w, cpu, torch.bfloat16, select_ops(cpu, torch.bfloat16), positions)
    # one sequence (a one-slot cache: scatter_update_), then three sequences in slots 2, 0, 1 of a
    # four-slot cache decoding together at different lengths (index_put_ into the rows' slots)
    one = [(ids(10, 61), [0], [0], [9])] + [([[t]], [p], [0], [0]) for p, t in enumerate(ids(4, 62), start=10)]
    one = [([x] if isinstance(x[0], int) else x, st, sl, la) for x, st, sl, la in one]
    many = [([ids(7, 63)], [0], [2], [6]), ([ids(3, 64)], [0], [0], [2]), ([ids(5, 65)], [0], [1], [4]),
            ([[11], [12], [13]], [7, 3, 5], [2, 0, 1], [0, 0, 0]), ([[14], [15], [16]], [8, 4, 6], [2, 0, 1], [0, 0, 0])]
    outs = []
    for m in (npu_model, host_model):
        got = []
        for n_slots, steps in ((1, one), (4, many)):
            shape = (n_slots, cfg.num_kv_heads, positions, cfg.head_dim)
            kc = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(cfg.num_layers)]
            vc = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(cfg.num_layers)]
            got.append(_run_steps(m, kc, vc, steps))
        outs.append(np.concatenate(got))
    assert {"rms_norm", "scatter_update_"} <= set(c for c in calls if isinstance(c, str))
    assert ("fused_fa", [10]) in calls and ("incre_fa", [11]) in calls      # per-row KV lengths, not capacity
    assert ("incre_fa", [8, 4, 6]) in calls and ("incre_fa", [9, 5, 7]) in calls
    assert rel_l2(outs[0], outs[1]) < 0.02           # same math, two kernel sets, both in bf16
    assert (outs[0].argmax(-1) == outs[1].argmax(-1)).mean() >= 0.8
    # fp32 keeps SDPA: the flash-attention kernels take fp16/bf16 only
    assert "scaled_dot_product_attention" in select_ops(NPU, torch.float32, "Ascend910B4").kernels["attention"]


@pytest.mark.parametrize("soc, fused", [("Ascend910B4", True), ("Ascend910B2C", True), ("Ascend910_9391", True),
                                        ("Ascend910C1", True), ("Ascend310P3", False), ("Ascend910A", False),
                                        ("Ascend910ProB", False), ("Ascend910B", False), ("Ascend910_9591", False),
                                        ("Ascend950PR", False), ("Ascend310B1", False), ("", False)])
def test_kernels_are_chosen_per_chip(soc, fused, monkeypatch):
    """The fused kernels only where documented for this model (Atlas A2/A3); 310P, 910A, 950 and unknown
    chips run SDPA + index_put_, and say why."""
    fake, _ = _fake_torch_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    ops = select_ops(NPU, torch.float16, soc)
    assert (ops.name == "npu") == fused and ops.seq_lens == fused
    if not fused:
        assert ops.name == "npu-sdpa" and "scaled_dot_product_attention" in ops.kernels["attention"]
        assert ops.kernels["why"].startswith(f"{soc}: ")


def _fake_npu_torch(monkeypatch, soc: str):
    """torch.npu as torch_npu adds it, on a machine that has one NPU of `soc`."""
    import glmcore_plugins.ascend_npu as pkg
    fake, _ = _fake_torch_npu()
    fake.__version__ = "2.6.0.post-test"
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    npu = types.SimpleNamespace(is_available=lambda: True, get_device_name=lambda i=0: soc,
                                is_bf16_supported=lambda: soc.startswith("Ascend910"))
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    monkeypatch.setattr(pkg.importlib.util, "find_spec",
                        lambda name, *a: object() if name in ("torch", "torch_npu") else None)
    monkeypatch.setattr(pkg, "_DEVICE", {})
    return pkg


@pytest.mark.parametrize("soc", ["Ascend910B2", "Ascend310P3"])
def test_probe_and_rank_name_the_chip_and_its_kernels(soc, monkeypatch):
    pkg = _fake_npu_torch(monkeypatch, soc)
    torchair = types.ModuleType("torchair")
    torchair.get_npu_backend = lambda **kw: None
    monkeypatch.setitem(sys.modules, "torchair", torchair)
    p = AscendNpuBackend().probe()
    caps = AscendNpuBackend().capabilities()
    assert p.ready and p.device == "npu:0" and p.details["runs on"] == f"Ascend NPU ({soc})"
    assert caps.native_batch
    if soc.startswith("Ascend910B"):
        assert "incre_flash_attention with actual_seq_lengths" in p.details["kernels"] and caps.speed_rank == 100
        assert caps.default_precision == "bf16"
    else:   # a 310P: no bf16, no fused attention: fp16 over SDPA, ranked below a fused-kernel NPU
        assert "scaled_dot_product_attention" in p.details["kernels"] and caps.speed_rank < 100
        assert caps.default_precision == "f16" and "310P" in p.details["soc"]
    assert pkg._soc() == soc


def test_probe_reports_a_broken_torchair_as_not_ready(monkeypatch):
    """torch_npu registers torchair lazily; find_spec on it can raise. The probe must not."""
    import importlib.util
    real_find_spec = importlib.util.find_spec
    _fake_npu_torch(monkeypatch, "Ascend910B3")
    lazy = types.ModuleType("torchair")                      # a lazy module without a spec, as torch_npu makes it
    lazy.__spec__ = None
    monkeypatch.setitem(sys.modules, "torchair", lazy)
    with pytest.raises(ValueError):
        real_find_spec("torchair")                           # what the probe used to call

    def failed_import(name):                                 # torch_npu.dynamo._LazyException: the import error
        raise ImportError("libge_runner.so: cannot open shared object file")   # surfaces on first use
    lazy.__getattr__ = failed_import
    for broken in (lazy, None):                              # None: `import torchair` itself fails
        monkeypatch.setitem(sys.modules, "torchair", broken)
        p = AscendNpuBackend().probe()
        assert not p.ready and "torchair is not importable" in p.reason and "ships with torch_npu" in p.reason
        assert "pip install torchair" not in p.reason + p.install


def test_recompile_limit_on_old_and_new_torch():
    from glmcore_plugins.ascend_npu.session import raise_recompile_limit
    old = types.SimpleNamespace(cache_size_limit=8)           # torch <= 2.6: no recompile_limit
    assert raise_recompile_limit(64, old) == "cache_size_limit" and old.cache_size_limit == 64
    assert not hasattr(old, "recompile_limit")
    new = types.SimpleNamespace(recompile_limit=8, cache_size_limit=8)
    assert raise_recompile_limit(64, new) == "recompile_limit" and new.recompile_limit == 64
    assert raise_recompile_limit() in ("recompile_limit", "cache_size_limit")


def _fake_torchair(get_npu_backend, tiling_option: bool = True):
    """torchair's CompilerConfig as its configs/_option_base.py builds it (torchair fced884): every option is an
    OptionValue declared when the config object is made; assigning any other name raises ValueError("... has no
    option ..."), assigning a declared one sets its OptionValue, whose value must be one it offers (here
    True/False); reading an option gives the OptionValue (truthy like its value; .value is "1"/"0").
    tiling_option=False is torchair 6.0.rc1, whose experimental_config has no tiling_schedule_optimize."""

    class OptionValue:
        def __init__(self, default, optional):
            self.optional, self._value = optional, default

        def __bool__(self):
            return bool(self._value)

        @property
        def value(self):
            return {True: "1", False: "0"}.get(self._value, self._value)

        @value.setter
        def value(self, v):
            if v not in self.optional:
                raise ValueError(f"Value {v!r} not in optional list {self.optional!r}")
            self._value = v

    class NpuBaseConfig:
        def __init__(self):
            object.__setattr__(self, "_fixed_attrs", [k for k, v in vars(self).items() if isinstance(v, OptionValue)])

        def __setattr__(self, key, value):
            if hasattr(self, "_fixed_attrs"):
                if key not in self._fixed_attrs:
                    raise ValueError(f"{type(self).__name__} has no option {key}, all options {self._fixed_attrs}")
                getattr(self, key).value = value
            else:
                object.__setattr__(self, key, value)

    class ExperimentalConfig(NpuBaseConfig):
        def __init__(self):
            self.frozen_parameter = OptionValue(False, [True, False])
            self.memory_efficiency = OptionValue(False, [True, False])
            if tiling_option:
                self.tiling_schedule_optimize = OptionValue(False, [True, False])
            super().__init__()

    class CompilerConfig:
        def __init__(self):
            self.experimental_config = ExperimentalConfig()

    torchair = types.ModuleType("torchair")
    torchair.CompilerConfig, torchair.get_npu_backend = CompilerConfig, get_npu_backend
    return torchair


def test_torchair_stand_in_refuses_what_torchair_refuses():
    config = _fake_torchair(None).CompilerConfig()
    with pytest.raises(ValueError, match="has no option tiling_schedule_optimise"):
        config.experimental_config.tiling_schedule_optimise = True      # misspelled
    with pytest.raises(ValueError, match="not in optional list"):
        config.experimental_config.frozen_parameter = "yes"
    with pytest.raises(ValueError, match="has no option tiling_schedule_optimize"):
        _fake_torchair(None, tiling_option=False).CompilerConfig().experimental_config.tiling_schedule_optimize = True


@pytest.mark.parametrize("tiling_option", [True, False])
def test_npu_compiler_sets_tiling_schedule_optimize_only_where_torchair_has_it(tiling_option):
    """torchair 6.0.rc1 has no tiling_schedule_optimize (its experimental_config.py); setting it there
    raises ValueError, so the compiler sets it only where the config declares it, and says so."""
    from glmcore_plugins.ascend_npu.session import npu_compiler
    configs = []
    torchair = _fake_torchair(lambda compiler_config: configs.append(compiler_config) or "npu-backend", tiling_option)
    backend, options = npu_compiler(torchair, dynamic_lengths=True)
    assert backend == "npu-backend" and configs[0].experimental_config.frozen_parameter.value == "1"
    tiling = getattr(configs[0].experimental_config, "tiling_schedule_optimize", None)
    assert (tiling.value if tiling_option else tiling) == ("1" if tiling_option else None)
    assert ("tiling_schedule_optimize=True" in options) == tiling_option


@pytest.mark.parametrize("release", [None, "6.0.rc1-v2r1", "6.0.rc2-v2r3"])
def test_new_lengths_reuse_the_compiled_graphs_on_every_admitted_torch_npu(make_tiny, monkeypatch, release):
    """The per-row KV lengths must stay graph inputs: a prefill chunk at start 0 and one of the same bucket at
    start 8 (lengths 8 and 16) run one graph, and two decode steps at lengths 17 and 18 one more. The kernels are
    registered with torch.library under op-plugin's schemas of each release with Meta kernels, so dynamo treats
    them as it treats torch_npu's (and refuses an argument the schema lacks); the step is compiled as on the NPU
    (dynamic=True, static tensor shapes) by a counting backend. An int[] length would specialize each value: a
    graph per length. master: the fused infer kernel with lengths; 6.0.rc1 (its fused kernel's lengths int[]):
    the prompt kernel without lengths; 6.0.rc2's v2r3 (torch_npu v2.3.1): no fused kernel, a prompt kernel
    without sparse_mode, int[] decode lengths -- no lengths anywhere, the mask alone bounds each row."""
    from glmcore_plugins.ascend_npu import session as sess
    fake, calls = _fake_torch_npu(release)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    graphs = []

    def eager_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setitem(sys.modules, "torchair", _fake_torchair(lambda compiler_config: eager_backend))
    monkeypatch.setattr(sess, "select_ops", lambda device, dtype, soc: select_ops(NPU, dtype, soc))
    cfg, w = model(make_tiny, "chatglm3")
    opts = AscendNpuBackend().resolve(LoadOptions(precision="bf16", capacity=32, extra={"buckets": "8"}))
    runner = sess.StepRunner(cfg, w, opts, AscendNpuBackend().capabilities(), torch.device("cpu"), 1, "Ascend910B4")
    runner.on_npu = True                                       # tensors on the CPU, the NPU's compile path
    runner._step = runner._compile()
    torch._dynamo.reset()
    chunk = torch.tensor([ids(8, 81)])
    outs = [runner.call(chunk, [0], [0], [7])[0], runner.call(chunk, [8], [0], [7])[0]]
    outs += [runner.call(torch.tensor([[t]]), [p], [0], [0])[0] for p, t in ((16, 5), (17, 6))]
    prefill_calls = [c for c in calls if isinstance(c, tuple) and c[0] != "incre_fa"]   # one per layer and call
    decode_calls = [c for c in calls if isinstance(c, tuple) and c[0] == "incre_fa"]
    assert len(prefill_calls) == len(decode_calls) == 2 * cfg.num_layers
    kernels = runner.ops.kernels["attention"]
    if release is None:
        assert {c[0] for c in prefill_calls} == {"fused_fa"}
        assert [c[1] for c in prefill_calls] == [[8]] * cfg.num_layers + [[16]] * cfg.num_layers   # each row's KV length
    else:
        assert set(prefill_calls) == {("prompt_fa", None)} and "npu_prompt_flash_attention without lengths" in kernels
    if release == "6.0.rc2-v2r3":
        assert set(decode_calls) == {("incre_fa", None)} and "npu_incre_flash_attention without lengths" in kernels
        assert not runner.ops.seq_lens
    else:
        assert [c[1] for c in decode_calls] == [[17]] * cfg.num_layers + [[18]] * cfg.num_layers
    assert len(graphs) == 2, f"{len(graphs)} graphs for two prefill chunks of one bucket and two decode steps"
    assert all(torch.isfinite(o).all() for o in outs)


def test_kernels_without_the_arguments_we_pass_fall_back_to_sdpa(monkeypatch):
    """A torch_npu whose incremental kernel lacks an argument the call passes (here num_key_value_heads, GQA) is
    not called with it: SDPA runs instead, and the kernel table says why."""
    from glmcore_plugins.ascend_npu.ops import schema_args
    fake, _ = _fake_torch_npu("6.0.rc2-v2r3")
    assert "sparse_mode" not in schema_args(fake.npu_prompt_flash_attention)
    assert schema_args(fake.npu_incre_flash_attention)["actual_seq_lengths"] == "int[]?"
    lacking = types.SimpleNamespace(default=types.SimpleNamespace(_schema=(
        "npu_incre_flash_attention(Tensor query, Tensor key, Tensor value, *, Tensor? atten_mask=None, "
        "int num_heads=1, float scale_value=1.0, str input_layout=\"BSH\") -> Tensor")))
    monkeypatch.setattr(fake, "npu_incre_flash_attention", lacking)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    ops = select_ops(NPU, torch.bfloat16, "Ascend910B4")
    assert ops.name == "npu-sdpa" and "scaled_dot_product_attention" in ops.kernels["attention"]
    assert "lacks ['num_key_value_heads']" in ops.kernels["why"]


def _paged_batch(make_tiny, monkeypatch, mode, release=None, n_slots=3):
    """(cfg, weights, an AscendBatchSession on the stand-in NPU kernels of `release`, calls) on the CPU."""
    from glmcore_plugins.ascend_npu import session as sess
    fake, calls = _fake_torch_npu(release)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(sess, "select_ops", lambda device, dtype, soc: select_ops(NPU, dtype, soc))
    cfg, w = model(make_tiny, "chatglm3")
    opts = AscendNpuBackend().resolve(LoadOptions(precision="bf16", capacity=64, extra={
        "mode": mode, "block_size": "16", "buckets": "8", "batch_buckets": "4"}))
    b = sess.AscendBatchSession(cfg, w, opts, AscendNpuBackend().capabilities(), torch.device("cpu"), n_slots,
                                "Ascend910B4")
    return cfg, w, b, calls


def test_paged_cache_batch_decode_matches_the_host_and_shares_prefixes(make_tiny, monkeypatch):
    """A batch on page-attention kernels keeps its KV in blocks: decode reads each row's blocks through the block
    table, a prefix copy is a block-table edit (shared blocks, reference-counted), a write into a shared block
    copies it first, a reset frees the slot's blocks. Same logits as the host's unpaged batch (bf16, other
    kernels), step for step."""
    cfg, w, paged, calls = _paged_batch(make_tiny, monkeypatch, "eager")
    tables = paged.runner.tables
    assert tables is not None and paged.runner.k_cache[0].shape == (tables.n_blocks, cfg.num_kv_heads, 16, cfg.head_dim)
    assert "page attention" in paged.runner.ops.kernels["attention"]
    host = AscendNpuBackend().load_batch(cfg, w, LoadOptions(precision="bf16", capacity=64, extra={
        "device": "cpu", "mode": "eager"}), 3)
    assert host.runner.tables is None
    script = [("step", [(0, ids(20, 1)), (1, ids(5, 2))]), ("step", [(0, [7]), (1, [8])]), ("step", [(0, [9]), (1, [10])]),
              ("copy", 0, 2, 18),                   # block 0 shared whole, block 1 (positions 16, 17) shared in part
              ("step", [(2, ids(3, 3))]),           # slot 2 writes at 18: its own copy of block 1
              ("step", [(0, [11]), (1, [12]), (2, [13])]),
              ("copy", 2, 1, 10), ("step", [(1, ids(4, 4)), (2, [14])]),     # slot 1 writes into shared block 0
              ("reset", 0), ("step", [(0, ids(9, 5))]), ("step", [(0, [15]), (1, [16]), (2, [17])])]
    shared_seen, got, want = False, [], []
    for op in script:
        if op[0] == "step":
            got.append(paged.step(op[1]))
            want.append(host.step(op[1]))
        elif op[0] == "copy":
            for s in (paged, host):
                s.copy_prefix(*op[1:])
            src, dst, n = op[1:]
            assert (tables.table[dst, :-(-n // 16)] == tables.table[src, :-(-n // 16)]).all()   # no copy made
            shared_seen = shared_seen or bool((tables.refs > 1).any())
        else:
            for s in (paged, host):
                s.reset(op[1])
            assert (tables.table[op[1]] == 0).all()
    assert shared_seen
    # two bf16 kernel sets: held to conformance's bf16 row (a row read from a wrong block is another row entirely)
    from glmcore_conformance.metrics import compare, out_of_bounds
    from glmcore_conformance.tolerances import TOLERANCES
    assert not out_of_bounds(compare(np.concatenate(want), np.concatenate(got)), TOLERANCES["bf16"].bounds())
    decodes = [c for c in calls if isinstance(c, tuple) and c[0] in ("paged_fa", "incre_fa")]
    assert decodes and {c[0] for c in decodes} == {"paged_fa"}
    assert ("paged_fa", [23, 8, 22]) in calls and ("paged_fa", [10, 15, 24]) in calls     # each row's length
    # every block is referenced exactly as often as the tables name it; a reset of all returns them all
    held = tables.table[tables.table != 0]
    assert (np.bincount(held, minlength=tables.n_blocks)[1:] == tables.refs[1:]).all()
    for slot in range(3):
        paged.reset(slot)
    assert sorted(tables.free) == [b for b in range(1, tables.n_blocks) if tables.refs[b] == 0]
    assert tables.refs[1:].sum() == (tables.table != 0).sum()


@pytest.mark.parametrize("size", ["20", "0", "x"])
def test_block_size_must_be_a_multiple_of_16(size):
    from glmcore_plugins.ascend_npu.session import parse_block_size
    with pytest.raises(BackendError, match=f"block_size={size!r} is not a multiple of 16.*--opt block_size=128"):
        parse_block_size(size)
    assert parse_block_size(None) == 128 and parse_block_size("32") == 32


def _cache_gathers(gm) -> list[str]:
    """The nodes of a captured graph that gather from a KV cache (index_select or tensor indexing of a cache
    input): the copies of every row's slot that page attention avoids."""
    import operator
    caches = {n for n in gm.graph.nodes if n.op == "placeholder" and "cache" in n.name}
    found = []
    for n in gm.graph.nodes:
        if not n.args or n.args[0] not in caches:
            continue
        index = n.args[1] if len(n.args) > 1 else None
        tensor_index = isinstance(index, torch.fx.Node) or (isinstance(index, tuple) and any(
            isinstance(i, torch.fx.Node) for i in index))
        if n.target in (torch.index_select, "index_select") or (n.target is operator.getitem and tensor_index):
            found.append(n.name)
    return found


@pytest.mark.parametrize("release", [None, "6.0.rc2-v2r3"])
def test_paged_batch_decode_graph_gathers_no_cache(make_tiny, monkeypatch, release):
    """The captured batched-decode graph reads the paged cache in place: no index_select (or tensor indexing) of
    a cache input. Where page attention is not available (6.0.rc2's v2r3: int[] decode lengths) the unpaged
    cache is gathered per row, which the check finds."""
    graphs = []

    def eager_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    cfg, w, b, calls = _paged_batch(make_tiny, monkeypatch, "graph", release)
    monkeypatch.setitem(sys.modules, "torchair", _fake_torchair(lambda compiler_config: eager_backend))
    b.runner.on_npu = True
    b.runner._step = b.runner._compile()
    torch._dynamo.reset()
    b.step([(0, ids(6, 1)), (1, ids(3, 2))])
    graphs.clear()
    out = b.step([(0, [5]), (1, [6]), (2, [7])])               # three rows, padded to the batch bucket of 4
    assert len(graphs) == 1 and np.isfinite(out).all()
    gathers = _cache_gathers(graphs[0])
    if release is None:
        assert b.runner.tables is not None and gathers == []
        assert [c for c in calls if isinstance(c, tuple) and c[0] == "paged_fa"][-1][1] == [7, 4, 1, 1]
    else:
        assert b.runner.tables is None and gathers                 # [B, Hkv, S, D] copies of the rows' slots


def test_npu_graph_mode_marks_caches_static_and_lengths_dynamic(make_tiny, monkeypatch):
    """On the NPU: frozen parameters, the KV caches' addresses marked static (frozen_parameter.md), and
    with per-row lengths dynamic=True + mark_static inputs + tiling_schedule_optimize (torchair's
    'path 4' for FA with actual_seq_lengths). torch.compile and torchair are stand-ins here."""
    from glmcore_plugins.ascend_npu import session as sess
    fake, _ = _fake_torch_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    configs, compiled, marked = [], [], {"address": [], "static": []}
    torchair = _fake_torchair(lambda compiler_config: configs.append(compiler_config) or "npu-backend")
    monkeypatch.setitem(sys.modules, "torchair", torchair)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(kw) or fn)
    monkeypatch.setattr(torch._dynamo, "mark_static_address", lambda t: marked["address"].append(t))
    monkeypatch.setattr(torch._dynamo, "mark_static", lambda t: marked["static"].append(t))
    monkeypatch.setattr(sess, "select_ops", lambda device, dtype, soc: select_ops(NPU, dtype, soc))
    cfg, w = model(make_tiny, "chatglm3")
    opts = AscendNpuBackend().resolve(LoadOptions(precision="bf16", capacity=32, extra={"buckets": "8"}))
    device = torch.device("cpu")                              # tensors on the CPU, kernels the fake NPU's
    runner = sess.StepRunner(cfg, w, opts, AscendNpuBackend().capabilities(), device, 3, "Ascend910B4")
    runner.on_npu = True
    runner._step = runner._compile()
    caches = runner.k_cache + runner.v_cache
    experimental = configs[0].experimental_config
    assert experimental.frozen_parameter.value == "1" and experimental.tiling_schedule_optimize.value == "1"
    assert compiled[-1]["dynamic"] is True and compiled[-1]["fullgraph"] is True
    assert all(any(t is c for t in marked["address"]) for c in caches)
    assert "tiling_schedule_optimize=True" in runner.compiler
    marked["static"].clear()
    runner.call(torch.zeros((2, 1), dtype=torch.long), [3, 5], [0, 2], [0, 0])
    assert len(marked["static"]) == 4                           # ids, start, slots, last: static shapes
    # without length-taking kernels (another chip) the graph stays fully static
    runner = sess.StepRunner(cfg, w, opts, AscendNpuBackend().capabilities(), device, 1, "Ascend310P3")
    runner.on_npu = True
    runner._compile()
    assert compiled[-1]["dynamic"] is False and not getattr(configs[-1].experimental_config,
                                                            "tiling_schedule_optimize", False)


def test_on_an_ascend_npu_graph_mode_runs_torchair_and_matches(make_tiny):
    probe = AscendNpuBackend().probe()
    if not probe.device.startswith("npu"):
        pytest.skip(f"needs an Ascend NPU with torch_npu; the probe found {probe.device} "
                    f"(torch_npu: {probe.details.get('torch_npu')})")
    cfg, w = model(make_tiny, "chatglm3")
    s = AscendNpuBackend().load(cfg, w, LoadOptions(precision="bf16" if "bf16" in device_precisions(probe.device)
                                                    else "f16", capacity=CAP))
    assert s.report()["compiler"].startswith("torchair") and s.ops.name == "npu"
    script = [("p", ids(20, 71)), ("d", ids(8, 72))]
    got, want = run(s, script), run(reference(cfg, w), script)
    assert rel_l2(got, want) < 0.06
    assert math.isfinite(float(got.sum()))


# ---------------------------------------------------------------- the native batch session (contract v2)

@pytest.fixture(scope="module")
def batch(make_tiny):
    cfg, w = model(make_tiny, "chatglm3")
    b = AscendNpuBackend().load_batch(cfg, w, LoadOptions(precision="f32", capacity=64, extra={
        "device": "cpu", "buckets": "8,32", "batch_buckets": "2,4"}), 4)
    yield cfg, w, b
    b.close()


class Mirror:
    """One torch reference session per slot, fed what the batch session's slot holds."""

    def __init__(self, cfg, w, n):
        self.refs = [reference(cfg, w, 64) for _ in range(n)]
        self.held = [[] for _ in range(n)]

    def step(self, entries, all_logits=False):
        out = []
        for slot, ids in entries:
            r = self.refs[slot]
            if all_logits or len(ids) > 1 or r.kv_len == 0:
                out.append(r.prefill(ids, all_logits=all_logits))
            else:
                out.append(r.decode(ids[0]))
            self.held[slot] += ids
        return out if all_logits else np.stack(out)

    def reset(self, slot):
        self.refs[slot].reset()
        self.held[slot] = []

    def copy_prefix(self, src, dst, n):
        ids = self.held[src][:n]
        self.reset(dst)
        self.step([(dst, ids)])


def test_batch_matches_the_single_sequence_reference_in_mixed_steps(batch):
    cfg, w, b = batch
    assert b.n_slots == 4 and b.capacity == 64 and b.report()["decode batch buckets"] == [2, 4]
    mirror = Mirror(cfg, w, 4)
    t = iter(ids(200, 90))
    steps = [
        [(0, ids(5, 91)), (1, ids(12, 92)), (2, [next(t)])],          # different lengths; a 1-token start
        [(0, [next(t)]), (1, [next(t)]), (2, [next(t)])],              # 3 decodes: batch bucket 4, one pad row
        [(0, [next(t)]), (3, ids(20, 93))],                            # slot 3 prefills while slot 0 decodes
        "reset 1",
        [(1, ids(3, 94)), (0, [next(t)]), (3, [next(t)]), (2, [next(t)])],   # slot 1 freed and reused
        "copy 3 1 10",                                                 # a shared prefix copied between slots
        [(1, [next(t)]), (2, [next(t)]), (3, [next(t)]), (0, [next(t)])],
        [(2, ids(40, 95)), (1, [next(t)])],                            # a 40-token prompt: chunks 32 + 8
    ]
    for step in steps:
        if isinstance(step, str):
            op, *args = step.split()
            getattr(b, {"reset": "reset", "copy": "copy_prefix"}[op])(*map(int, args))
            getattr(mirror, {"reset": "reset", "copy": "copy_prefix"}[op])(*map(int, args))
            continue
        got, want = b.step(step), mirror.step(step)
        assert got.shape == (len(step), cfg.vocab_size) and got.dtype == np.float32
        assert np.abs(got - want).max() < 1e-3, step
        assert [b.kv_len(s) for s in range(4)] == [r.kv_len for r in mirror.refs]
    # all_logits: every position of a prefill chunk, and a decode row's one
    entries = [(0, ids(6, 96)), (3, [next(t)])]
    got, want = b.step(entries, all_logits=True), mirror.step(entries, all_logits=True)
    assert [g.shape for g in got] == [(6, cfg.vocab_size), (1, cfg.vocab_size)]
    for g, wnt in zip(got, want):
        assert np.abs(g - wnt).max() < 1e-3


def test_batch_compiles_once_per_bucket_and_has_no_graph_breaks(batch):
    cfg, _, b = batch
    for s in range(4):
        b.reset(s)
    b.step([(0, ids(5, 97)), (1, ids(30, 98))])                # prefill buckets 8 and 32
    b.step([(0, [5]), (1, [6])])                                # decode bucket 2
    b.step([(0, [5]), (1, [6]), (2, [7])])                      # decode bucket 4
    warm = b.runner.compiles
    for n in (1, 2, 3, 4, 4, 1):
        b.step([(s, [9]) for s in range(n)])
    b.step([(3, ids(17, 99))])
    assert b.runner.compiles == warm, "a batch size or prompt inside the buckets recompiled"
    m = b.runner.model
    for shape, slots in (((4, 1), [3, 0, 2, 4]), ((2, 1), [1, 4]), ((1, 8), [2]), ((1, 32), [0])):
        ex = explain(m, shape, b.runner.k_cache, b.runner.v_cache, slots)
        assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons


def test_batch_refuses_bad_entries(batch):
    cfg, _, b = batch
    for s in range(4):
        b.reset(s)
    with pytest.raises(BackendError, match="appears twice"):
        b.step([(0, [1]), (0, [2])])
    with pytest.raises(BackendError, match="slot 4 does not exist; slots are 0..3"):
        b.step([(4, [1])])
    with pytest.raises(BackendError, match="outside the vocabulary"):
        b.step([(0, [cfg.vocab_size])])
    with pytest.raises(BackendError, match="exceed the context of 64 in slot 1"):
        b.step([(1, ids(65, 100))])
    with pytest.raises(BackendError, match="cannot copy"):
        b.copy_prefix(0, 1, 1)
    assert [b.kv_len(s) for s in range(4)] == [0, 0, 0, 0]      # a refused step changes nothing


def test_eager_batch_matches_too(make_tiny):
    cfg, w = model(make_tiny, "glm4")
    b = AscendNpuBackend().load_batch(cfg, w, LoadOptions(precision="f32", capacity=32,
                                                          extra={"device": "cpu", "mode": "eager"}), 3)
    mirror = Mirror(cfg, w, 3)
    for entries in ([(0, ids(4, 101)), (2, ids(9, 102))], [(0, [7]), (2, [8]), (1, [9])], [(1, [3]), (2, [4])]):
        assert np.abs(b.step(entries) - mirror.step(entries)).max() < 1e-3
