"""Calibrated INT4 (glmcore/gptq.py): GPTQ's values lie on each backend's own int4 grid (the unchanged packers
give them back exactly), they beat round to nearest on the layer's output error, the calibration forward
is the model's forward, and the `quant=gptq` option reaches the packed file, the cache key and the errors."""
from __future__ import annotations

import types

import numpy as np
import pytest

from glmcore import gptq
from glmcore.backend import LoadOptions
from glmcore.config import ModelConfig
from glmcore.errors import BackendError, GlmcoreError
from glmcore.weights import load_weights
from glmcore_plugins.cpu_int4 import CpuInt4Backend, _calibrated
from glmcore_plugins.cpu_int4 import quant as q4
from glmcore_plugins.cpu_int4.quant import QuantOptions


def _layer(rng, n=48, k=320, t=2048):
    """A weight and correlated activations with a few loud channels (what makes GPTQ differ from RTN)."""
    w = rng.standard_normal((n, k)).astype(np.float32)
    mix = rng.standard_normal((k, k)).astype(np.float32) / np.sqrt(k)
    x = rng.standard_normal((t, k)).astype(np.float32) @ mix
    x[:, rng.choice(k, 8, replace=False)] *= 10
    return w, x


def _cpu_grid(group, sym):
    """cpu_int4's grid for GPTQ, as the plugin builds it."""
    extra = {"quant": "gptq", "group_size": group, "sym": sym}
    captured = {}

    def fake_calibrated(cfg, weights, grid, group_of, key, calib, progress=None):
        captured.update(grid=grid, key=key)
    import glmcore.gptq as g
    real, g.calibrated = g.calibrated, fake_calibrated
    try:
        _calibrated(types.SimpleNamespace(arch="glm"), {}, QuantOptions.from_extra(extra), extra, None)   # a dense GLM
    finally:
        g.calibrated = real
    return captured


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("sym", [True, False])
def test_values_round_trip_through_the_cpu_int4_packer(group, sym):
    rng = np.random.default_rng(1)
    w, x = _layer(rng, k=320)                       # 320: the last g128 group is partial (zero-padded)
    grid = _cpu_grid(group, sym)["grid"]
    out = gptq.gptq(w, x.T @ x / len(x), lambda blk: grid("layers.0.qkv.weight", blk), group)
    q, d, m = q4.quantize4(out, group, sym, "f16")
    back = q4.dequantize(q, d, m, group, 4, out.shape[1])
    assert np.array_equal(back, out)                # the packer keeps GPTQ's codes: same format, same values
    rtn = q4.dequantize(*q4.quantize4(w, group, sym, "f16"), group, 4, w.shape[1])
    err = lambda v: float(np.mean((x @ (w - v).T) ** 2))       # noqa: E731
    assert err(out) < 0.8 * err(rtn)                # and the layer's output error is well below RTN's


@pytest.mark.parametrize("group", [64, None])        # None: per channel, one group wider than GPTQ's block
def test_values_round_trip_through_the_openvino_int4_packer(group):
    quant = pytest.importorskip("glmcore_plugins.openvino_amx.quant")

    def grid(blk):                                  # as OpenVINOBackend._weights describes quantize_sym's grid
        amax = np.abs(blk).max(1)
        scale = np.where(amax > 0, amax / 7, 1.0).astype(np.float16).astype(np.float32)
        return scale, np.zeros_like(scale), -7, 7
    w, x = _layer(np.random.default_rng(2), k=320)
    out = gptq.gptq(w, x.T @ x / len(x), grid, group or 320)
    assert np.array_equal(quant.dequantize_sym(*quant.quantize_sym(out, 4, group)), out)


def test_calibration_forward_matches_the_torch_reference(make_tiny):
    torch_ref = pytest.importorskip("glmcore_plugins.torch_ref")
    d = make_tiny("chatglm3")
    cfg = ModelConfig.from_dir(d)
    w = load_weights(d, cfg)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 24))
    *_, (_, _, x) = gptq.layer_inputs(cfg, w, ids)
    h = gptq._rms(x, np.asarray(w["final_norm.weight"], np.float32), cfg.norm_eps)
    ours = h @ np.asarray(w["lm_head.weight"], np.float32).T
    ref = torch_ref.TorchBackend()
    for b in range(2):
        s = ref.load(cfg, w, LoadOptions(capacity=32))
        want = s.prefill([int(t) for t in ids[b]], all_logits=True)
        assert np.allclose(ours[b], want, atol=2e-3 * np.abs(want).max())
        s.close()


def test_quant_gptq_packs_the_calibrated_values(make_tiny, tmp_path):
    p = CpuInt4Backend().probe()
    if not p.ready:
        pytest.skip(p.reason)
    d = make_tiny("chatglm3")
    cfg = ModelConfig.from_dir(d)
    w = load_weights(d, cfg)
    calib = tmp_path / "calib.txt"
    calib.write_text("春风又绿江南岸，明月何时照我还。\nThe quick brown fox jumps over the lazy dog.\n" * 20)
    extra = {"quant": "gptq", "calib": str(calib), "group_size": 32}
    cw = _calibrated(cfg, w, QuantOptions.from_extra(extra), extra, None)
    be = CpuInt4Backend()
    opts = LoadOptions(cache_dir=tmp_path / "cache", extra=extra)
    packed = be.conformance_weights(cfg, w, opts)[0]
    name = "layers.0.ffn_up.weight"
    assert np.array_equal(packed[name], cw[name])                     # the file holds GPTQ's values
    rtn = be.conformance_weights(cfg, w, LoadOptions(cache_dir=tmp_path / "cache", extra={"group_size": 32}))[0]
    assert not np.array_equal(packed[name], rtn[name])                # ... not RTN's
    assert np.array_equal(packed["embed.weight"], rtn["embed.weight"])    # the embeddings stay RTN
    # the cache key follows the calibration text
    calib.write_text("另一段文字。" * 50)
    assert _calibrated(cfg, w, QuantOptions.from_extra(extra), extra, None).fingerprint() != cw.fingerprint()
    assert cw.fingerprint() != w.fingerprint()


@pytest.mark.parametrize("extra, match", [
    ({"quant": "awq"}, "quant='awq' is not supported"),
    ({"calib": "x.txt"}, "add --opt quant=gptq"),
])
def test_bad_quant_options_are_clear_errors(extra, match):
    with pytest.raises(BackendError, match=match):
        _calibrated(None, {}, QuantOptions(), extra, None)


def test_calibration_text_errors(tmp_path):
    with pytest.raises(GlmcoreError, match="cannot be read"):
        gptq.calibration_text(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(GlmcoreError, match="is empty"):
        gptq.calibration_text(tmp_path / "empty.txt")
    assert gptq.calibration_text()[0].strip()                          # the shipped sample is there
    seqs = gptq.calibration_sequences(list(range(1000)), [7, 8], seq_len=100, max_seqs=4)
    assert seqs.shape == (4, 100) and (seqs[:, :2] == [7, 8]).all()


def test_convert_quant_gptq_writes_the_calibrated_values(make_tiny, tmp_path):
    from glmcore import cli
    p = CpuInt4Backend().probe()
    if not p.ready:
        pytest.skip(p.reason)
    d = make_tiny("chatglm3")
    calib = tmp_path / "calib.txt"
    calib.write_text("床前明月光，疑是地上霜。举头望明月，低头思故乡。\n" * 30)
    out = tmp_path / "packed"
    assert cli.main(["convert", "--backend", "cpu_int4", "--model", str(d), "--out", str(out), "--quant", "gptq",
                     "--calib", str(calib), "--group-size", "32"]) == 0
    cfg = ModelConfig.from_dir(d)
    w = load_weights(d, cfg)
    extra = {"quant": "gptq", "calib": str(calib), "group_size": 32}
    want = _calibrated(cfg, w, QuantOptions.from_extra(extra), extra, None)
    meta, blob = q4.read_packed(out, cfg)
    got = q4.dequantized_weights(meta, np.asarray(blob))
    assert np.array_equal(got["layers.1.qkv.weight"], want["layers.1.qkv.weight"])
    # it loads as a packed model of the original checkpoint (its seal names the checkpoint it came from)
    s = CpuInt4Backend().load(cfg, w, LoadOptions(extra={"packed": str(out)}))
    s.close()
