"""Backend ascend_npu: the graph-captured GLM model against the torch reference, in eager and graph mode;
one compile per static shape, zero graph breaks, a static KV cache that decode never grows; the NPU
kernel dispatch checked against the documented torch_npu signatures; options, probe and errors.

Graph-mode sessions compile with inductor (tens of seconds each on 2 cores), so the graph tests share
one compiled session with small prefill buckets (8, 32: three graphs with decode)."""
from __future__ import annotations

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
from glmcore_plugins.ascend_npu.model import GLMGraphModel, to_device  # noqa: E402
from glmcore_plugins.ascend_npu.ops import select_ops  # noqa: E402
from glmcore_plugins.torch_ref import TorchBackend  # noqa: E402

FAMILIES = ("chatglm2", "chatglm3", "glm4")
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

@pytest.fixture(scope="module")
def graph(make_tiny):
    cfg, w = model(make_tiny, "chatglm3")
    s = ascend(cfg, w, buckets="8,32")                  # no mode given: graph is the default
    yield cfg, w, s
    s.close()


def test_graph_matches_reference_through_buckets_chunks_and_appends(graph):
    cfg, w, s = graph
    assert s.mode == "graph" and s.report()["compiler"] == "inductor" and s.report()["prefill buckets"] == [8, 32]
    assert s.compiles <= 1          # the decode graph, compiled at load (0: this process compiled it before)
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
    s.prefill(ids(5, 31))                              # bucket 8
    s.prefill(ids(20, 32))                             # bucket 32
    s.decode(7)                                        # decode
    warm = s.compiles
    assert warm <= 3                                   # buckets 8 and 32, and decode: nothing else, ever
    for n in (1, 3, 8, 9, 17, 32):
        s.prefill(ids(n, 40 + n))
    for t in ids(30, 33):
        s.decode(t)
    assert s.compiles == warm, "a prefill length inside the buckets or a decode step recompiled"


def test_graph_has_no_graph_breaks(graph):
    _, _, s = graph
    m = s.model
    for t in (1, 8, 32):                               # decode and both prefill buckets
        ids_t = torch.zeros(t, dtype=torch.long)
        with torch.inference_mode():
            ex = torch._dynamo.explain(m.forward)(ids_t, torch.zeros(1, dtype=torch.long),
                                                  torch.zeros(1, dtype=torch.long), s.k_cache, s.v_cache)
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

def _fake_torch_npu():
    """torch_npu's documented kernels, emulated on the CPU with the documented signatures (keyword
    names, BNSD layout, atten_mask True = masked out, GQA through num_key_value_heads), so the dispatch
    layer's calls are checked without the hardware. Wrong keywords raise TypeError."""
    calls = []

    def npu_rms_norm(self, gamma, epsilon=1e-06):
        calls.append("rms_norm")
        assert self.dtype == gamma.dtype
        rstd = torch.rsqrt(self.float().pow(2).mean(-1, keepdim=True) + epsilon)
        return (self.float() * rstd * gamma.float()).to(self.dtype), rstd

    def _fa(query, key, value, atten_mask, num_heads, scale_value, input_layout, num_key_value_heads):
        assert input_layout == "BNSD" and query.is_contiguous() and query.dtype in (torch.float16, torch.bfloat16)
        assert query.shape[1] == num_heads and key.shape[1] == num_key_value_heads
        g = num_heads // num_key_value_heads
        k = key.float().repeat_interleave(g, 1)
        v = value.float().repeat_interleave(g, 1)
        s = query.float() @ k.transpose(-1, -2) * scale_value
        s = s.masked_fill(atten_mask, float("-inf"))
        return (s.softmax(-1) @ v).to(query.dtype)

    def npu_prompt_flash_attention(query, key, value, *, pse_shift=None, padding_mask=None, atten_mask=None,
                                   actual_seq_lengths=None, deq_scale1=None, quant_scale1=None, deq_scale2=None,
                                   quant_scale2=None, quant_offset2=None, num_heads=1, scale_value=1.0,
                                   pre_tokens=2147473647, next_tokens=0, input_layout="BSH",
                                   num_key_value_heads=0, actual_seq_lengths_kv=None, sparse_mode=0):
        calls.append("prompt_fa")
        assert sparse_mode == 0 and next_tokens >= key.shape[2]     # the mask alone decides
        assert atten_mask.shape == (1, 1, query.shape[2], key.shape[2])
        return _fa(query, key, value, atten_mask, num_heads, scale_value, input_layout, num_key_value_heads)

    def npu_incre_flash_attention(query, key, value, *, padding_mask=None, pse_shift=None, atten_mask=None,
                                  actual_seq_lengths=None, dequant_scale1=None, quant_scale1=None,
                                  dequant_scale2=None, quant_scale2=None, quant_offset2=None, antiquant_scale=None,
                                  antiquant_offset=None, block_table=None, kv_padding_size=None, num_heads=1,
                                  scale_value=1.0, input_layout="BSH", num_key_value_heads=0, block_size=0,
                                  inner_precise=1):
        calls.append("incre_fa")
        assert query.shape[2] == 1 and atten_mask.shape == (1, 1, 1, key.shape[2])
        return _fa(query, key, value, atten_mask, num_heads, scale_value, input_layout, num_key_value_heads)

    def scatter_update_(data, indices, updates, axis):
        calls.append("scatter_update_")
        assert axis == -2 and indices.dtype == torch.long and indices.dim() == 1
        for b in range(data.shape[0]):
            data[b].narrow(data.dim() - 3, int(indices[b]), updates.shape[-2]).copy_(updates[b])
        return data

    mod = types.ModuleType("torch_npu")
    mod.__dict__.update(npu_rms_norm=npu_rms_norm, npu_prompt_flash_attention=npu_prompt_flash_attention,
                        npu_incre_flash_attention=npu_incre_flash_attention, scatter_update_=scatter_update_)
    return mod, calls


def test_npu_dispatch_uses_the_documented_kernels_and_matches(make_tiny, monkeypatch):
    fake, calls = _fake_torch_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    cfg, w = model(make_tiny, "chatglm3")
    cpu, slots = torch.device("cpu"), 64
    npu = types.SimpleNamespace(type="npu")           # torch.device("npu") exists only with torch_npu
    ops = select_ops(npu, torch.bfloat16)
    assert ops.name == "npu" and "npu_incre_flash_attention" in ops.kernels["attention"]
    npu_model = GLMGraphModel(cfg, w, cpu, torch.bfloat16, ops, slots)
    host_model = GLMGraphModel(cfg, w, cpu, torch.bfloat16, select_ops(cpu, torch.bfloat16), slots)
    shape = (1, cfg.num_kv_heads, slots, cfg.head_dim)
    outs = []
    for m in (npu_model, host_model):
        kc = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(cfg.num_layers)]
        vc = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(cfg.num_layers)]
        rows = []
        with torch.inference_mode():
            prompt = torch.tensor(ids(10, 61))
            rows.append(m(prompt, torch.tensor([0]), torch.tensor([9]), kc, vc)[0])
            for pos, t in enumerate(ids(4, 62), start=10):
                rows.append(m(torch.tensor([t]), torch.tensor([pos]), torch.tensor([0]), kc, vc)[0])
        outs.append(torch.cat(rows).numpy())
    assert {"rms_norm", "prompt_fa", "incre_fa", "scatter_update_"} <= set(calls)
    assert rel_l2(outs[0], outs[1]) < 0.02           # same math, two kernel sets, both in bf16
    assert (outs[0].argmax(-1) == outs[1].argmax(-1)).mean() >= 0.8
    # fp32 keeps SDPA: the flash-attention kernels take fp16/bf16 only
    assert "scaled_dot_product_attention" in select_ops(npu, torch.float32).kernels["attention"]


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
