"""Backend cpu_int4: quantization and tile layout, the C kernels against exact emulation and against each
other, the whole model against the torch reference on the dequantized weights, the StreamingLLM shift,
the on-disk cache, `glmcore convert`, options and errors."""
from __future__ import annotations

import contextlib
import ctypes as C
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from glmcore.backend import LoadOptions, registry
from glmcore.config import ModelConfig
from glmcore.scheduler import Scheduler, WindowPolicy
from glmcore.errors import BackendError, GlmcoreError, StepError
from glmcore import arch
from glmcore.synth import init_tensor
from glmcore.weights import load_weights
from glmcore_plugins.cpu_int4 import CpuInt4Backend, native, quant

from glmcore.arch.glm import GLM  # noqa: E402
FAMILIES = GLM.synthetic_families   # every dense family (the glm4-0414 post norms and GLM-Edge full rotary included)
ROOT = Path(__file__).resolve().parents[1]


def ready_or_skip():
    p = CpuInt4Backend().probe()
    if not p.ready:
        pytest.skip(f"cpu_int4 not ready: {p.reason}")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    ready_or_skip()
    return tmp_path_factory.mktemp("int4-cache")


def load(cfg, weights, cache, capacity=256, **extra):
    with contextlib.redirect_stderr(io.StringIO()):
        return CpuInt4Backend().load(cfg, weights, LoadOptions(capacity=capacity, cache_dir=cache, extra=extra))


def torch_ref(cfg, weights, capacity=256):
    pytest.importorskip("torch")
    from glmcore_plugins.torch_ref import TorchBackend
    return TorchBackend().load(cfg, weights, LoadOptions(capacity=capacity))


def dequantized(session) -> dict:
    return quant.dequantized_weights(session.meta, np.asarray(session._blob))


def cosine(a, b) -> float:
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def run(session, prompt, steps):
    """Teacher-forced: all prompt positions, then one decode per token of `steps`."""
    out = [session.prefill(prompt, all_logits=True)]
    out += [session.decode(t)[None] for t in steps]
    return np.concatenate(out)


def close_to(got, ref, cos_min=0.9995, top1_min=0.9):
    """The int8 activations are the only approximation left against the dequantized reference: logits
    agree to cos >= 0.9995 (measured 0.9998) and in top-1 on >= 90% of positions (measured 95-98%)."""
    c, top1 = cosine(got, ref), float((got.argmax(-1) == ref.argmax(-1)).mean())
    assert c >= cos_min and top1 >= top1_min, f"cosine {c:.6f}, top-1 agreement {top1:.3f}"
    return c, top1


def toy_config(layers=2, vocab=512, kv=2, heads=4, head_dim=16, hidden=64, ffn=160, base=10000.0) -> ModelConfig:
    return ModelConfig(family="chatglm3", hidden_size=hidden, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv, head_dim=head_dim, ffn_hidden_size=ffn, vocab_size=vocab,
                       max_seq_len=4096, rope_base=base, norm_eps=1e-5)


def toy_weights(cfg, seed=0) -> dict:
    return {n: init_tensor(n, spec, cfg, seed) for n, spec in arch.of(cfg).tensors(cfg).items()}


# ---------------------------------------------------------------- quantization and layout

@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("scale_dtype", ["f16", "bf16"])
def test_int4_tiles_roundtrip(group, sym, scale_dtype):
    rng = np.random.default_rng(group)
    w = rng.standard_normal((37, 200), dtype=np.float32)        # rows not a multiple of 16, k not of the group
    q, d, m = quant.quantize4(w, group, sym, scale_dtype)
    assert q.min() >= 0 and q.max() <= 15 and q.shape == (37, -(-200 // group) * group)
    deq = quant.dequantize(q, d, m, group, 4, 200)
    buf = quant.tile4(q, d, m, group)
    assert buf.nbytes == quant.tile_nbytes(37, 200, 4, group, not sym)
    assert np.array_equal(quant.untile(buf, 37, 200, 4, group, not sym, scale_dtype), deq)
    # within one step of the group's scale (half a step, plus clipping at the code range's end)
    step = np.repeat(np.abs(d.astype(np.float32)), group, axis=1)[:, :200]
    assert np.all(np.abs(deq - w) <= 1.01 * step + 1e-6)
    if sym:   # Q4_0: the largest-magnitude value of each group maps to code 0 and is reproduced up to scale rounding
        g = np.pad(w, ((0, 0), (0, q.shape[1] - 200))).reshape(37, -1, group)
        idx = np.abs(g).argmax(-1)
        assert np.all(np.take_along_axis(q.reshape(37, -1, group), idx[..., None], -1) == 0)


def test_int8_tiles_roundtrip():
    w = np.random.default_rng(0).standard_normal((20, 96), dtype=np.float32)
    q, d = quant.quantize8(w, 32, "f16")
    assert np.abs(q).max() == 127
    buf = quant.tile8(q, d, 32)
    deq = quant.untile(buf, 20, 96, 8, 32, False, "f16")
    assert np.array_equal(deq, quant.dequantize(q, d, None, 32, 8, 96))
    assert np.abs(deq - w).max() < np.abs(w).max() / 127


def test_half_conversion_matches_numpy(cache):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(4000).astype(np.float32) * 10.0 ** rng.integers(-9, 6, 4000),
                        np.float32([0.0, -0.0, 65504, 65519.99, 65520, 1e6, -1e6, 6.1e-5, 5.96e-8, 2.98e-8, 1e-9])])
    x = x.astype(np.float32)
    h = np.empty(x.size, np.uint16)
    native.lib().glmi4_f2h(x.ctypes.data, h.ctypes.data, x.size)
    with np.errstate(over="ignore"):
        assert np.array_equal(h, x.astype(np.float16).view(np.uint16))
    back = np.empty(x.size, np.float32)
    native.lib().glmi4_h2f(h.ctypes.data, back.ctypes.data, x.size)
    assert np.array_equal(back, h.view(np.float16).astype(np.float32))


# ---------------------------------------------------------------- kernels

def isa_or_skip(isa: str) -> int:
    ready_or_skip()
    if not native.supported(isa):
        pytest.skip(f"this CPU cannot run the {isa} kernels (flags: expected path {native.expected_isa()})")
    return native.isa_index(isa)


def emulate(x, w_deq, group):
    """What the integer kernel computes, in float64: the kernels' own int8 activations times the weights."""
    rows = []
    for r in x:
        q, dx, _ = native.quant_act(r, group, 0)
        rows.append(q[: x.shape[1]].astype(np.float64) * np.repeat(dx, 32)[: x.shape[1]])
    return np.stack(rows) @ w_deq.astype(np.float64).T


@pytest.mark.parametrize("isa", native.ISAS)
@pytest.mark.parametrize("bits,group,sym,scale_dtype", [
    (4, 32, True, "f16"), (4, 64, True, "bf16"), (4, 128, True, "f16"),
    (4, 32, False, "bf16"), (4, 64, False, "f16"), (4, 128, False, "bf16"),
    (8, 32, True, "f16"), (8, 128, True, "bf16")])
def test_kernel_matches_exact_emulation(isa, bits, group, sym, scale_dtype):
    i = isa_or_skip(isa)
    rng = np.random.default_rng(bits + group)
    n, k = 53, 320                                      # partial last tile, k padded for group 64/128
    w = rng.standard_normal((n, k), dtype=np.float32)
    if bits == 4:
        q, d, m = quant.quantize4(w, group, sym, scale_dtype)
        buf, deq = quant.tile4(q, d, m, group), quant.dequantize(q, d, m, group, 4, k)
    else:
        q, d = quant.quantize8(w, group, scale_dtype)
        buf, deq = quant.tile8(q, d, group), quant.dequantize(q, d, None, group, 8, k)
    mat = native.make_mat(buf, n, k, bits, group, bits == 4 and not sym, scale_dtype)
    # the fast kernels block tokens by 16 (group 32: int4 below 32 tokens, int8 always), 8, 4, then the 1-3 left
    # (AVX2: 2 and 1); int4 unpacks tiles from 32 tokens on
    for M in (1, 2, 3, 6, 9, 16, 23, 40):
        x = (rng.standard_normal((M, k)) * rng.uniform(0.1, 10, (M, 1))).astype(np.float32)
        ref = emulate(x, deq, group)
        alone = np.concatenate([native.matmul(mat, x[t:t + 1], i, 1) for t in range(M)])
        for threads in (1, 2):
            got = native.matmul(mat, x, i, threads)
            assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), (M, threads)
            # the same bits whatever else is in the batch: a sequence's output never depends on its neighbours
            assert np.array_equal(got, alone), (M, threads)


@pytest.mark.parametrize("isa", native.ISAS[1:])
def test_activation_quantization_identical_across_isas(isa):
    i = isa_or_skip(isa)
    x = np.random.default_rng(3).standard_normal(333).astype(np.float32) * 3
    x[40:72] = 0.0                                        # an all-zero block
    for group in (32, 64, 128):
        a, b = native.quant_act(x, group, 0), native.quant_act(x, group, i)
        for u, v in zip(a, b):
            assert np.array_equal(u, v)
        assert np.abs(a[0]).max() == 127


def test_fast_kernel_is_used_when_the_cpu_has_it(cache):
    """Fails if dispatch silently falls back to plain C on a CPU that has AVX2 or AVX-512 VNNI."""
    expected = native.expected_isa()
    if expected == "plain":
        pytest.skip("this CPU has neither AVX2+FMA+F16C nor AVX-512 VNNI; only the plain path can run")
    assert native.ISAS[native.lib().glmi4_best_isa()] == expected
    cfg = toy_config()
    s = load(cfg, toy_weights(cfg), cache)
    assert native.ISAS[s.isa] == expected and s.info()["isa"] == expected
    lib = native.lib()
    before = [lib.glmi4_kernel_calls(i) for i in range(len(native.ISAS))]
    s.prefill([1, 2, 3])
    s.decode(4)
    after = [lib.glmi4_kernel_calls(i) for i in range(len(native.ISAS))]
    fast = native.isa_index(expected)
    assert after[fast] - before[fast] >= 2 * (4 * cfg.num_layers + 1)
    assert after[0] == before[0], "the plain C kernels ran although the CPU has a fast path"
    assert CpuInt4Backend().probe().details["isa"] == expected
    s.close()


@pytest.mark.parametrize("isa", native.ISAS[1:])
def test_fast_path_equals_plain_path_whole_model(isa, cache):
    isa_or_skip(isa)
    cfg = toy_config()
    w = toy_weights(cfg)
    ids = list(range(3, 70))
    outs = []
    for which in ("plain", isa):
        s = load(cfg, w, cache, isa=which, kv_dtype="f32")
        outs.append(run(s, ids[:50], ids[50:]))
        s.close()
    assert np.abs(outs[0] - outs[1]).max() <= 1e-4 * np.abs(outs[0]).max()


# ---------------------------------------------------------------- the whole model against the reference

@pytest.fixture(scope="module")
def tiny(make_tiny):
    made = {}

    def get(family):
        if family not in made:
            d = make_tiny(family)
            cfg = ModelConfig.from_dir(d)
            made[family] = (cfg, load_weights(d, cfg))
        return made[family]
    return get


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("sym", [True, False])
def test_matches_reference_on_dequantized_weights(family, group, sym, tiny, cache):
    cfg, w = tiny(family)
    s = load(cfg, w, cache, group_size=group, sym=sym)
    ref = torch_ref(cfg, dequantized(s))
    ids = list(np.random.default_rng(7).integers(0, cfg.vocab_size, 72))
    got, want = run(s, ids[:56], ids[56:]), run(ref, ids[:56], ids[56:])
    close_to(got, want)
    # reset and reuse: the same sequence gives the same logits
    s.reset()
    assert s.kv_len == 0
    assert np.allclose(s.prefill(ids[:56]), got[55], rtol=0, atol=1e-4 * np.abs(got).max())
    s.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_agreement_with_original_weights(family, tiny, cache):
    """The int4 weights themselves change the logits (tiny random models are sensitive): report and bound it."""
    cfg, w = tiny(family)
    ref = torch_ref(cfg, w)
    ids = list(np.random.default_rng(8).integers(0, cfg.vocab_size, 64))
    want = run(ref, ids[:48], ids[48:])
    lines = []
    for group in (32, 128):
        got = run(load(cfg, w, cache, group_size=group), ids[:48], ids[48:])
        c, top1 = cosine(got, want), float((got.argmax(-1) == want.argmax(-1)).mean())
        lines.append(f"{family} int4 g{group}: cosine {c:.4f}, top-1 {top1:.2f}")
        assert c > 0.85 and top1 > 0.3, lines[-1]
    print("; ".join(lines))


def test_near_capacity_and_chunked_prefill(tiny, cache):
    """A prompt longer than one native chunk (128) that fills the cache exactly, then overflow."""
    cfg, w = tiny("chatglm3")
    s = load(cfg, w, cache, capacity=300)
    ref = torch_ref(cfg, dequantized(s), capacity=300)
    ids = list(np.random.default_rng(9).integers(0, cfg.vocab_size, 300))
    got = np.concatenate([s.prefill(ids[:299], all_logits=True), s.decode(ids[299])[None]])
    want = np.concatenate([ref.prefill(ids[:299], all_logits=True), ref.decode(ids[299])[None]])
    close_to(got, want)
    assert s.kv_len == 300 == s.capacity
    with pytest.raises(StepError):
        s.decode(1)
    s.close()


# ---------------------------------------------------------------- StreamingLLM shift

def torch_shift(ref, n_keep, n_discard):
    """The reference semantics of a window shift: keep the cached K/V of the kept tokens and rotate their
    keys to the new positions (undo the old rotation, apply the new one, with the reference's own rotary;
    independent of conformance.reference.shift_in_place, which rotates by the delta). ref: a torch
    reference Session, a one-slot view of its batch (per layer caches [slot, kv head, position, dim])."""
    import torch
    from glmcore_plugins.torch_ref.model import apply_rotary, rotary_tables
    b, n = ref.batch, ref.kv_len
    kept = list(range(n_keep)) + list(range(n_keep + n_discard, n))
    cos_o, sin_o = rotary_tables(b.cfg, torch.tensor(kept))
    cos_n, sin_n = rotary_tables(b.cfg, torch.arange(len(kept)))
    for k_cache, v_cache in zip(b.k_cache, b.v_cache):
        k = apply_rotary(k_cache[0, :, kept].transpose(0, 1), cos_o, -sin_o)      # inverse rotation
        k_cache[0, :, : len(kept)] = apply_rotary(k, cos_n, sin_n).transpose(0, 1)
        v_cache[0, :, : len(kept)] = v_cache[0, :, kept].clone()
    b.lens[0] = len(kept)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
def test_shift_matches_reference_rerotation(family, kv_dtype, tiny, cache):
    cfg, w = tiny(family)
    s = load(cfg, w, cache, capacity=64, kv_dtype=kv_dtype)
    ref = torch_ref(cfg, dequantized(s), capacity=64)
    rng = np.random.default_rng(11)
    ids = list(rng.integers(0, cfg.vocab_size, 60))
    s.prefill(ids)
    ref.prefill(ids)
    got, want = [], []
    for n_keep, n_discard in ((4, 28), (4, 30), (0, 20)):     # repeated shifts wrap the ring buffer
        s.shift(n_keep, n_discard)
        torch_shift(ref, n_keep, n_discard)
        assert s.kv_len == ref.kv_len
        more = list(rng.integers(0, cfg.vocab_size, 64 - s.kv_len))
        got.append(run(s, more[:-6], more[-6:]))
        want.append(run(ref, more[:-6], more[-6:]))
        assert s.kv_len == 64
    close_to(np.concatenate(got), np.concatenate(want))
    s.close()


def test_shift_equals_reprefill_for_one_layer(cache):
    """With one layer a token's K/V depend only on the token and its position, so re-rotating in place must
    equal recomputing the kept tokens at their new positions: this isolates the shift-RoPE arithmetic.
    f32 cache: equal to float rounding. f16 cache: the shifted keys are rounded to f16 twice, so allow the
    error that storing in f16 causes anyway (measured: 0.79% shift vs 0.74% f16-vs-f32, of the max logit)."""
    cfg = toy_config(layers=1, base=500000.0)
    w = toy_weights(cfg, seed=3)
    ids = list(np.random.default_rng(12).integers(0, cfg.vocab_size, 200))
    tail = ids[120:160]
    out = {}
    for kv_dtype in ("f32", "f16"):
        a = load(cfg, w, cache, capacity=128, kv_dtype=kv_dtype)
        b = load(cfg, w, cache, capacity=128, kv_dtype=kv_dtype)
        a.prefill(ids[:120])
        a.shift(4, 70)
        assert a.kv_len == 50
        b.prefill(ids[:4] + ids[74:120])
        out[kv_dtype, "shift"] = np.stack([a.decode(t) for t in tail])
        out[kv_dtype, "recompute"] = np.stack([b.decode(t) for t in tail])
        a.close()
        b.close()

    def rel(x, y):
        return float(np.abs(x - y).max() / np.abs(y).max())
    assert rel(out["f32", "shift"], out["f32", "recompute"]) < 2e-5
    f16_storage = rel(out["f16", "recompute"], out["f32", "recompute"])
    assert rel(out["f16", "shift"], out["f16", "recompute"]) < 2 * f16_storage + 1e-4
    assert cosine(out["f16", "shift"], out["f16", "recompute"]) > 0.9999


def test_scheduler_window_uses_shift_past_capacity(tiny, cache):
    """The core's window policy drives shift() on this backend: a stream twice the capacity runs, and its
    logits track the reference doing the same shifts."""
    cfg, w = tiny("glm4")
    s = load(cfg, w, cache, capacity=48)
    ref = torch_ref(cfg, dequantized(s), capacity=48)
    sched = Scheduler(s.batch, CpuInt4Backend().capabilities())
    slot, window = sched.slots[0], WindowPolicy("window", n_keep=4)
    ids = [int(t) for t in np.random.default_rng(13).integers(0, cfg.vocab_size, 120)]
    sched.feed(slot, ids[:40], window)
    ref.prefill(ids[:40])
    got, want = [], []
    for t in ids[40:]:
        if ref.kv_len + 1 > 48:
            torch_shift(ref, 4, (ref.kv_len - 4) // 2)
        got.append(sched.feed(slot, [t], window))
        want.append(ref.decode(t))
    assert slot.shifts >= 3 and s.kv_len == len(slot.tokens) <= 48
    close_to(np.stack(got), np.stack(want))
    s.close()


def test_shift_rejects_bad_ranges(cache):
    cfg = toy_config()
    s = load(cfg, toy_weights(cfg), cache, capacity=32)
    s.prefill([1, 2, 3, 4, 5])
    with pytest.raises(GlmcoreError):
        s.shift(3, 3)
    s.shift(2, 0)
    assert s.kv_len == 5
    s.close()


# ---------------------------------------------------------------- cache, convert, options, registry

def test_cache_is_reused_and_memory_mapped(tiny, tmp_path):
    ready_or_skip()
    cfg, w = tiny("chatglm3")
    s1 = load(cfg, w, tmp_path, group_size=64)
    files = list(tmp_path.glob("cpu_int4-*/weights.bin"))
    assert len(files) == 1
    mtime = files[0].stat().st_mtime_ns
    s2 = load(cfg, w, tmp_path, group_size=64)
    assert files[0].stat().st_mtime_ns == mtime and s2.packed_dir == s1.packed_dir
    assert isinstance(s2._blob, np.memmap)            # weights are mapped, not copied
    load(cfg, w, tmp_path, group_size=128)
    assert len(list(tmp_path.glob("cpu_int4-*/weights.bin"))) == 2   # options are part of the key
    s1.close()
    s2.close()


def test_convert_cli_and_load_packed(make_tiny, tmp_path, cache):
    ready_or_skip()
    model = make_tiny("glm4")
    out = tmp_path / "packed"
    r = subprocess.run([sys.executable, "-m", "glmcore.cli", "convert", "--backend", "cpu_int4", "--model", str(model),
                        "--out", str(out), "--group-size", "128"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "100%" in r.stderr and "bits per weight" in r.stderr and "MiB" in r.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["options"]["group_size"] == 128
    assert meta["stats"]["file_bytes"] == (out / "weights.bin").stat().st_size
    cfg = ModelConfig.from_dir(model)
    w = load_weights(model, cfg)
    a = load(cfg, w, cache, packed=str(out))
    b = load(cfg, w, cache, group_size=128)
    ids = [5, 6, 7, 8, 9]
    assert np.array_equal(a.prefill(ids), b.prefill(ids))
    other = ModelConfig.from_dir(make_tiny("chatglm3"))
    with pytest.raises(BackendError, match="different model"):
        load(other, load_weights(make_tiny("chatglm3"), other), cache, packed=str(out))


def test_bits_per_weight_on_real_shapes():
    """Layout arithmetic on the 1b shape (no data): g32 sym = 4.5 bits, g128 asym = 4.25."""
    from glmcore.arch.glm import SIZES
    sz = SIZES["1b"]
    cfg = ModelConfig("chatglm3", sz["hidden_size"], 1, sz["num_attention_heads"], sz["multi_query_group_num"],
                      sz["kv_channels"], sz["ffn_hidden_size"], 65024, 8192, 10000.0, 1e-5)
    for o, bpw in ((quant.QuantOptions(32, True), 4.5), (quant.QuantOptions(128, False), 4.25),
                   (quant.QuantOptions(128, True), 4.125)):
        stats = quant.packed_stats(cfg, quant.packed_layout(cfg, o), 0)
        assert abs(stats["linear_bits_per_weight"] - bpw) < 1e-9


@pytest.mark.parametrize("extra,match", [
    ({"group_size": 48}, "group_size 48"), ({"scale_dtype": "f8"}, "scale_dtype"), ({"head_bits": 2}, "head_bits"),
    ({"kv_dtype": "int8"}, "kv_dtype"), ({"grup_size": 32}, "unknown option"), ({"isa": "neon"}, "unknown isa")])
def test_bad_options_are_clear_errors(extra, match, cache):
    cfg = toy_config()
    with pytest.raises(BackendError, match=match):
        load(cfg, toy_weights(cfg), cache, **extra)


def test_unsupported_isa_is_refused(cache):
    ready_or_skip()
    missing = [i for i in native.ISAS if not native.supported(i)]
    if not missing:
        pytest.skip("this CPU supports every kernel variant")
    cfg = toy_config()
    with pytest.raises(BackendError, match="not supported by this CPU"):
        load(cfg, toy_weights(cfg), cache, isa=missing[0])


def test_bad_tokens_and_closed_session(cache):
    cfg = toy_config()
    s = load(cfg, toy_weights(cfg), cache)
    with pytest.raises(GlmcoreError, match="outside the vocabulary"):
        s.prefill([1, cfg.vocab_size])
    with pytest.raises(GlmcoreError):
        s.prefill([])
    assert s.kv_len == 0
    s.close()
    with pytest.raises(GlmcoreError, match="closed"):
        s.decode(1)


def test_registered_and_probed():
    entry = registry().entries.get("cpu_int4")
    assert entry is not None and entry.backend is not None, entry
    p = registry().probe("cpu_int4")
    caps = entry.backend.capabilities()
    assert caps.can_shift and caps.weight_formats == ("int4",)
    if p.ready:
        assert p.details["isa"] in native.ISAS and p.details["threads"] >= 1
    else:
        assert p.reason


def test_benchmark_smoke(tmp_path):
    """benchmarks/bench_cpu_int4.py runs end to end at the tiny size (CI smoke)."""
    ready_or_skip()
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cpu_int4.py"), "--size", "tiny",
                        "--prefill", "16", "--decode", "8", "--no-torch", "--no-openvino"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "GLMCORE_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "decode" in r.stdout and "tok/s" in r.stdout and "peak RSS" in r.stdout
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cpu_int4.py"), "--size", "tiny",
                        "--prefill", "16", "--decode", "4", "--batch", "1,3", "--group-size", "32", "--repeat", "1"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "GLMCORE_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line.split() for line in r.stdout.splitlines() if line.split()[:1] in (["1"], ["3"])]
    assert "native batch steps" in r.stdout and [row[0] for row in rows] == ["1", "3"]
    assert all(float(row[4]) > 0 for row in rows)          # aggregate decode tok/s per batch size


def test_conformance_suite_all_variants(tmp_path, monkeypatch):
    """The project's conformance suite on this backend, every variant it declares (group 32/64/128,
    symmetric and asymmetric, bf16 scales, the plain C path), one family here for time; `glmcore
    conformance --backend cpu_int4` runs all three."""
    ready_or_skip()
    pytest.importorskip("torch")
    from glmcore_conformance import format_table, run_suite
    monkeypatch.setenv("GLMCORE_CACHE", str(tmp_path))
    report = run_suite([CpuInt4Backend()], families=["glm4"], decode_steps=16, threads=2)
    assert report.passed, format_table(report)
    assert len({r.config for r in report.results}) == len(CpuInt4Backend().conformance_variants())
    # the tight comparison ran: the reference on the dequantized weights, window shift included
    assert {r.case for r in report.results if r.against == "own weights"} >= {"prefill", "decode", "window_shift"}


# ---------------------------------------------------------------- batch sessions (contract v2)

def load_batch(cfg, weights, cache, n_slots, capacity=256, **extra):
    with contextlib.redirect_stderr(io.StringIO()):
        return CpuInt4Backend().load_batch(cfg, weights, LoadOptions(capacity=capacity, cache_dir=cache, extra=extra),
                                           n_slots)


class SingleMirror:
    """The single-sequence reference of every slot: one Int4Session per slot (same packed weights, same
    kernels), driven with the slot's own operations. A copied prefix is rebuilt by replaying the source's
    operations (prefill and shift), so the mirror holds exactly what the copy should."""

    def __init__(self, cfg, weights, cache, n_slots, capacity, **extra):
        self.refs = [load(cfg, weights, cache, capacity=capacity, **extra) for _ in range(n_slots)]
        self.log = [[] for _ in range(n_slots)]     # per slot: ("ids", ids) or ("shift", keep, discard)
        self.got, self.want = [], []

    def step(self, batch, entries, all_logits=False):
        out = batch.step(entries, all_logits)
        for k, (slot, ids) in enumerate(entries):
            r = self.refs[slot]
            want = r.prefill(ids, all_logits=True) if all_logits else (
                r.prefill(ids) if len(ids) > 1 else r.decode(ids[0]))
            self.log[slot].append(("ids", list(ids)))
            self.got.append(np.reshape(out[k], (-1, out[k].shape[-1])))
            self.want.append(np.reshape(want, (-1, want.shape[-1])))
        assert [batch.kv_len(i) for i in range(len(self.refs))] == [r.kv_len for r in self.refs]
        return out

    def shift(self, batch, slot, keep, discard):
        batch.shift(slot, keep, discard)
        self.refs[slot].shift(keep, discard)
        self.log[slot].append(("shift", keep, discard))

    def reset(self, batch, slot):
        batch.reset(slot)
        self.refs[slot].reset()
        self.log[slot] = []

    def copy_prefix(self, batch, src, dst, n):
        batch.copy_prefix(src, dst, n)
        if n == self.refs[src].kv_len:
            log = list(self.log[src])
        else:                                       # a part of a never-shifted slot: its first n ids
            assert all(op[0] == "ids" for op in self.log[src])
            log = [("ids", [t for op in self.log[src] for t in op[1]][:n])] if n else []
        self.refs[dst].reset()
        for op in log:
            if op[0] == "ids":
                self.refs[dst].prefill(op[1])
            else:
                self.refs[dst].shift(op[1], op[2])
        self.log[dst] = log

    def close(self):
        for r in self.refs:
            r.close()


def mixed_batch_scenario(cfg, w, cache, isa, **extra):
    """Slots of different lengths; a slot prefilling a chunk while others decode; a step longer than one
    native chunk (128 tokens) split inside an entry; a window shift in one slot and a ring that wraps;
    a prefix copied between slots (whole, wrapped, and in part); a slot freed and reused."""
    rng = np.random.default_rng(21)

    def ids(n):
        return [int(i) for i in rng.integers(0, cfg.vocab_size, n)]
    cap = 160
    b = load_batch(cfg, w, cache, 4, capacity=cap, isa=isa, **extra)
    m = SingleMirror(cfg, w, cache, 4, cap, isa=isa, **extra)
    m.step(b, [(0, ids(20)), (1, ids(7)), (2, ids(1))], all_logits=True)
    m.step(b, [(0, ids(1)), (1, ids(23)), (2, ids(1)), (3, ids(5))])
    m.step(b, [(2, ids(100)), (3, ids(45)), (0, ids(1))])            # 146 tokens: two native chunks
    m.copy_prefix(b, 0, 3, 10)                                        # slot 3 drops its 50, takes 10 of slot 0
    m.step(b, [(3, ids(4)), (1, ids(1))])
    m.shift(b, 1, 4, 26)                                              # slot 1: base moves to 26
    m.step(b, [(1, ids(1)), (0, ids(1)), (3, ids(1))])
    m.step(b, [(1, ids(140)), (2, ids(1))], all_logits=True)          # slot 1 now wraps around its ring
    m.reset(b, 2)                                                     # slot 2 freed, then reused
    m.copy_prefix(b, 1, 2, b.kv_len(1))                               # a wrapped, shifted prefix
    m.step(b, [(2, ids(3)), (0, ids(9)), (1, ids(1)), (3, ids(1))])
    m.copy_prefix(b, 3, 3, 6)                                         # src == dst: keep the first 6
    for _ in range(3):
        m.step(b, [(s, ids(1)) for s in (3, 1, 0, 2)])
    assert b.kv_len(1) > 140 and b.kv_len(3) == 9
    got, want = np.concatenate(m.got), np.concatenate(m.want)
    m.close()
    b.close()
    return got, want


@pytest.mark.parametrize("isa", native.ISAS)
def test_batch_steps_equal_single_sequences(isa, tiny, cache):
    """Every slot's logits in mixed steps equal the single-sequence session's, at the f32 row (the same
    packed weights and kernels: only the grouping of tokens into matrix blocks differs), through each
    kernel variant this CPU has."""
    from glmcore_conformance.metrics import compare, out_of_bounds
    from glmcore_conformance.tolerances import TOLERANCES
    isa_or_skip(isa)
    cfg, w = tiny("glm4")                               # qkv bias, GQA
    got, want = mixed_batch_scenario(cfg, w, cache, isa)
    figures = compare(want, got)
    assert not out_of_bounds(figures, TOLERANCES["f32"].bounds()), figures
    assert got.shape[0] == 197          # every position of the all-logits steps, the last of the others


@pytest.mark.parametrize("family", ["glm4-0414", "glm-edge"])
def test_batch_steps_equal_single_sequences_post_norms_and_full_rotary(family, tiny, cache):
    """glm4's post norms (a row-local norm of each sublayer's output) and GLM-Edge's whole-head rotary
    (in steps and in the shift) keep a slot's logits those of the single-sequence session."""
    ready_or_skip()
    from glmcore_conformance.metrics import compare, out_of_bounds
    from glmcore_conformance.tolerances import TOLERANCES
    cfg, w = tiny(family)
    got, want = mixed_batch_scenario(cfg, w, cache, "auto")
    assert not out_of_bounds(compare(want, got), TOLERANCES["f32"].bounds())


def test_batch_asym_group128_f32_cache(tiny, cache):
    ready_or_skip()
    from glmcore_conformance.metrics import compare, out_of_bounds
    from glmcore_conformance.tolerances import TOLERANCES
    cfg, w = tiny("chatglm2")
    got, want = mixed_batch_scenario(cfg, w, cache, "auto", group_size=128, sym=False, kv_dtype="f32")
    figures = compare(want, got)
    assert not out_of_bounds(figures, TOLERANCES["f32"].bounds()), figures


def test_batch_is_native_and_maps_the_weights_once(cache):
    cfg = toy_config()
    caps = CpuInt4Backend().capabilities()
    assert caps.native_batch and caps.can_shift
    b = load_batch(cfg, toy_weights(cfg), cache, 3, capacity=32)
    assert b.n_slots == 3 and b.capacity == 32 and isinstance(b._blob, np.memmap)
    assert b.info()["slots"] == 3
    lib = native.lib()
    before = sum(lib.glmi4_kernel_calls(i) for i in range(len(native.ISAS)))
    out = b.step([(0, [1, 2, 3]), (2, [4]), (1, [5, 6])])
    calls = sum(lib.glmi4_kernel_calls(i) for i in range(len(native.ISAS))) - before
    assert out.shape == (3, cfg.vocab_size) and out.dtype == np.float32
    assert calls == 4 * cfg.num_layers + 1          # one product per weight matrix for all three entries
    assert [b.kv_len(i) for i in range(3)] == [3, 2, 1]
    b.close()


def test_batch_errors_leave_every_slot_unchanged(cache):
    cfg = toy_config()
    b = load_batch(cfg, toy_weights(cfg), cache, 2, capacity=8)
    b.step([(0, [1, 2, 3]), (1, [4])])
    bad = [([(0, [1]), (0, [2])], "twice"), ([(2, [1])], "slot 2 does not exist"), ([(1, [])], "empty"),
           ([(1, [1]), (0, [cfg.vocab_size])], "outside the vocabulary")]
    for entries, match in bad:
        with pytest.raises(GlmcoreError, match=match):
            b.step(entries)
    with pytest.raises(StepError, match="exceed the context of 8 in slot 0"):     # the core's check
        b.step([(1, [1]), (0, [1, 2, 3, 4, 5, 6])])
    assert [b.kv_len(0), b.kv_len(1)] == [3, 1]
    with pytest.raises(GlmcoreError, match="holds 1"):
        b.copy_prefix(1, 0, 2)
    with pytest.raises(GlmcoreError, match="cannot shift"):
        b.shift(1, 1, 1)
    with pytest.raises(StepError, match="at least one"):
        b.step([])
    b.close()
    with pytest.raises(GlmcoreError, match="closed"):
        b.kv_len(0)


# ---------------------------------------------------------------- the AVX-VNNI tier on CPUs without it

@pytest.fixture(scope="module")
def avxvnni_emulated(tmp_path_factory):
    """The library built with the AVX-VNNI tier's vpdpbusd done exactly by AVX2 instructions: every kernel of the
    tier but the one instruction, on any AVX2 CPU (CPUs with AVX-VNNI run the real tier in the tests above)."""
    ready_or_skip()
    if not native.supported("avx2"):
        pytest.skip("the emulated AVX-VNNI tier needs AVX2")
    cc = native.compiler()
    if cc is None:
        pytest.skip("no C compiler to build the emulated AVX-VNNI tier")
    out = tmp_path_factory.mktemp("avxvnni") / "glmi4-avxvnni-emulated.so"
    subprocess.run(cc.split() + native.build_flags() + ["-DGLMI4_EMULATE_AVXVNNI", str(native.SOURCE), "-o",
                                                         str(out), "-lm"], check=True, capture_output=True)
    return out


def test_avxvnni_tier_gives_the_avx2_tiers_bits(avxvnni_emulated):
    """Exact integer block sums and the same float work in the same order: the AVX-VNNI tier's products equal
    the AVX2 tier's bit for bit, at every group, symmetry, width and batch (1/2/4-token blocks, unpacked
    tiles from 16 tokens on, threads)."""
    lib = C.CDLL(str(avxvnni_emulated))
    native._declare(lib)
    vx, avx2 = native.isa_index("avxvnni"), native.isa_index("avx2")
    assert lib.glmi4_abi_version() == native.ABI and lib.glmi4_isa_name(vx) == b"avxvnni-emulated"
    assert lib.glmi4_isa_supported(vx) and lib.glmi4_best_isa() in (vx, native.isa_index("avx512vnni"))
    rng = np.random.default_rng(7)
    for bits, group, sym, sd in ((4, 32, True, "f16"), (4, 64, True, "bf16"), (4, 128, False, "f16"),
                                 (4, 32, False, "bf16"), (8, 32, True, "f16"), (8, 128, True, "bf16")):
        n, k = 53, 320
        w = rng.standard_normal((n, k), dtype=np.float32)
        if bits == 4:
            q, d, m = quant.quantize4(w, group, sym, sd)
            buf = quant.tile4(q, d, m, group)
        else:
            q, d = quant.quantize8(w, group, sd)
            buf = quant.tile8(q, d, group)
        mat = native.make_mat(buf, n, k, bits, group, bits == 4 and not sym, sd)
        for M in (1, 2, 3, 7, 16, 21, 40):
            x = (rng.standard_normal((M, k)) * rng.uniform(0.1, 10, (M, 1))).astype(np.float32)
            for threads in (1, 2):
                outs = []
                for isa in (avx2, vx):
                    out = np.empty((M, n), np.float32)
                    assert lib.glmi4_matmul(isa, C.byref(mat), M, x.ctypes.data, out.ctypes.data, threads) == 0
                    outs.append(out)
                assert np.array_equal(*outs), (bits, group, sym, M, threads)
    before = lib.glmi4_kernel_calls(vx)
    out = np.empty((1, 53), np.float32)
    lib.glmi4_matmul(vx, C.byref(mat), 1, rng.standard_normal((1, 320), dtype=np.float32).ctypes.data,
                     out.ctypes.data, 1)
    assert lib.glmi4_kernel_calls(vx) == before + 1       # the tier's own kernels ran


def test_avxvnni_tier_passes_the_kernel_tests(avxvnni_emulated):
    """This file's tests of every tier (exactness against the emulation, batch independence, the whole model
    against the plain path, batch steps against single sequences), on the emulated AVX-VNNI tier."""
    env = {**os.environ, "GLMCORE_INT4_LIB": str(avxvnni_emulated)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                        "-m", "not slow", "-k", "avxvnni and not tier", __file__],
                       capture_output=True, text=True, env=env, timeout=900, cwd=Path(__file__).parents[1])
    assert r.returncode == 0, r.stdout[-3000:]
    passed = int(r.stdout.strip().splitlines()[-1].split(" passed")[0].split()[-1])
    assert passed >= 10 and " skipped" not in r.stdout.splitlines()[-1], r.stdout[-1000:]
