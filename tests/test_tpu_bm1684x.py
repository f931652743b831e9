"""Backend tpu_bm1684x: the static-graph deployment, checked through its host emulation.

onnxruntime runs the exact exported ONNX parts here and is held to the torch reference on all three
families in f32 and f16. The TPU-MLIR step is checked by running the generated compile.sh against
stub tools that log their arguments; the device runtime adapter by a stand-in for sophon.sail that
runs the same parts. Neither TPU-MLIR nor a BM1684X exist on this machine: the real-hardware test
below is skipped unless both the Sophon runtime and a compiled bmodel are present.
"""
from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import glmcore_plugins.tpu_bm1684x as tpu  # noqa: E402
from glmcore.backend import LoadOptions  # noqa: E402
from glmcore.config import ModelConfig  # noqa: E402
from glmcore.engine import Engine, WindowPolicy  # noqa: E402
from glmcore.errors import BackendError  # noqa: E402
from glmcore.weights import load_weights  # noqa: E402
from glmcore_plugins.torch_ref import TorchBackend  # noqa: E402
from glmcore_plugins.tpu_bm1684x.export import export_parts, read_manifest  # noqa: E402
from glmcore_plugins.tpu_bm1684x.graphs import part_specs  # noqa: E402
from glmcore_plugins.tpu_bm1684x.session import OrtRunner, decode_mask, prefill_mask  # noqa: E402
from glmcore_plugins.tpu_bm1684x.spec import MASK_VALUE  # noqa: E402

FAMILIES = ["chatglm2", "chatglm3", "glm4"]
S = 32                     # SEQ_LEN of most tests: small keeps them fast, the logic is the same at 512


@pytest.fixture(scope="module")
def model(make_tiny):
    cache = {}

    def get(family):
        if family not in cache:
            d = make_tiny(family)
            cfg = ModelConfig.from_dir(d)
            cache[family] = (d, cfg, load_weights(d, cfg))
        return cache[family]
    return get


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tpu-cache")


def load(cfg, w, cache_dir, precision="f32", capacity=S, **extra):
    backend = tpu.TpuBm1684xBackend()
    opts = backend.resolve(LoadOptions(precision=precision, capacity=capacity, cache_dir=cache_dir, extra=extra))
    return backend.load(cfg, w, opts)


def ref_session(cfg, w, capacity=S):
    return TorchBackend().load(cfg, w, LoadOptions(capacity=capacity))


def assert_close(got, want, precision):
    """f32: the graphs are the reference's math, so only summation order differs (measured <= 3e-5).
    f16: weights, activations and the KV cache in fp16, norms and softmax in fp32: measured max|d|
    <= 0.08 on logits of scale ~25; top-1 must agree wherever the reference's margin is clear."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == np.float32
    if precision == "f32":
        np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)
        return
    atol = 0.25
    assert np.abs(got - want).max() <= atol, np.abs(got - want).max()
    w2 = want.reshape(-1, want.shape[-1])
    top2 = np.sort(w2, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * atol
    assert (w2.argmax(-1) == got.reshape(w2.shape).argmax(-1))[clear].all()


# ---------------------------------------------------------------- against the reference

@pytest.mark.parametrize("precision", ["f32", "f16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_reference(model, cache_dir, family, precision):
    _, cfg, w = model(family)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 2 * S).tolist()
    s, ref = load(cfg, w, cache_dir, precision), ref_session(cfg, w)
    assert s.capacity == S and s.kv_len == 0

    # a prompt of length 1, then decode until the buffer is full
    got = [s.prefill(ids[:1], all_logits=True)] + [s.decode(t)[None] for t in ids[1:S]]
    want = [ref.prefill(ids[:1], all_logits=True)] + [ref.decode(t)[None] for t in ids[1:S]]
    assert s.kv_len == S
    assert_close(np.concatenate(got), np.concatenate(want), precision)

    # reset and reuse: a prompt of SEQ_LEN-1 (every position's logits), then the last free slot
    s.reset(), ref.reset()
    assert s.kv_len == 0
    assert_close(s.prefill(ids[S:2 * S - 1], all_logits=True), ref.prefill(ids[S:2 * S - 1], all_logits=True),
                 precision)
    assert_close(s.decode(ids[0]), ref.decode(ids[0]), precision)
    assert s.kv_len == S

    # a chat continuation: prefill into a non-empty cache goes token by token through block_cache
    s.reset(), ref.reset()
    s.prefill(ids[:9]), ref.prefill(ids[:9])
    s.decode(ids[9]), ref.decode(ids[9])
    got = s.prefill(ids[10:20], all_logits=True)
    assert got.shape == (10, cfg.vocab_size) and s.kv_len == 20
    assert_close(got, ref.prefill(ids[10:20], all_logits=True), precision)
    assert_close(s.prefill(ids[20:23]), ref.prefill(ids[20:23]), precision)   # last position only
    s.close()


def test_default_seq_len_is_512_and_fills(model, cache_dir):
    _, cfg, w = model("chatglm3")
    backend = tpu.TpuBm1684xBackend()
    s = backend.load(cfg, w, backend.resolve(LoadOptions(cache_dir=cache_dir)))
    assert s.capacity == 512
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, 512).tolist()
    ref = ref_session(cfg, w, 512)
    assert_close(s.prefill(ids[:511], all_logits=True), ref.prefill(ids[:511], all_logits=True), "f32")
    assert_close(s.decode(ids[511]), ref.decode(ids[511]), "f32")
    assert s.kv_len == 512


def test_window_policy_through_the_engine(model, cache_dir):
    """Past capacity the core slides the window by re-prefilling (the backend cannot shift in place)."""
    _, cfg, w = model("glm4")
    assert not tpu.TpuBm1684xBackend().capabilities().can_shift
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, 3 * S).tolist()
    policy = WindowPolicy("window", n_keep=4)
    ours, theirs = Engine(load(cfg, w, cache_dir), policy), Engine(ref_session(cfg, w), policy)
    got = [ours.feed(ids[:20])] + [ours.feed([t]) for t in ids[20:]]
    want = [theirs.feed(ids[:20])] + [theirs.feed([t]) for t in ids[20:]]
    assert ours.shifts == theirs.shifts > 0
    assert_close(np.stack(got), np.stack(want), "f32")


def test_decode_top1_is_argmax_of_decode(model, cache_dir):
    _, cfg, w = model("chatglm3")
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, 12).tolist()
    a, b = load(cfg, w, cache_dir), load(cfg, w, cache_dir)
    a.prefill(ids[:8]), b.prefill(ids[:8])
    for t in ids[8:]:
        assert b.decode_top1(t) == int(np.argmax(a.decode(t)))


# ---------------------------------------------------------------- the graphs

@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_parts_are_valid_static_onnx(model, tmp_path, dtype):
    _, cfg, w = model("glm4")
    progress = []
    manifest = export_parts(cfg, w, S, dtype, tmp_path / "parts", progress.append)
    specs = part_specs(cfg, S, dtype)
    assert [p["name"] for p in manifest["parts"]] == [p["name"] for p in specs]
    assert len(progress) == len(specs) == 2 * cfg.num_layers + 4
    elem = {"float32": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16, "int32": onnx.TensorProto.INT32}
    for spec in specs:
        path = tmp_path / "parts" / f"{spec['name']}.onnx"
        onnx.checker.check_model(str(path), full_check=True)
        m = onnx.load(str(path), load_external_data=False)
        for declared, actual in ((spec["inputs"], m.graph.input), (spec["outputs"], m.graph.output)):
            assert [v.name for v in actual] == [n for n, _, _ in declared]
            for (_, shape, dt), v in zip(declared, actual):
                dims = v.type.tensor_type.shape.dim
                assert all(d.HasField("dim_value") and not d.dim_param for d in dims), (spec["name"], v.name)
                assert tuple(d.dim_value for d in dims) == shape
                assert v.type.tensor_type.elem_type == elem[dt]
        # weights live in the group's shared file, each array once
        ext = {e.value for t in m.graph.initializer for e in t.external_data if e.key == "location"}
        assert ext <= {f"{spec['group']}.weights"}
        if spec["name"].startswith("block"):
            norms = [n for n in m.graph.node if "norm/" in n.name and n.op_type == "Pow"]
            assert len(norms) == 2 and all(n.input[0] in _float32_values(m) for n in norms)
    layer = tmp_path / "parts" / "layer_0.weights"
    n_bytes = {"f32": 4, "f16": 2}[dtype]
    linear = (cfg.q_size + 2 * cfg.kv_size) * cfg.hidden_size + cfg.q_size * cfg.hidden_size \
        + 3 * cfg.ffn_hidden_size * cfg.hidden_size
    assert layer.stat().st_size < 1.2 * linear * n_bytes      # block_0 and block_cache_0 share one copy


def _float32_values(m) -> set[str]:
    """Names of the values a graph computes in float32 (from ONNX shape inference)."""
    inferred = onnx.shape_inference.infer_shapes(m)
    vals = list(inferred.graph.value_info) + list(inferred.graph.input)
    return {v.name for v in vals if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}


def test_meta_trace_equals_cpu_trace(model, tmp_path):
    """The parts are traced on the meta device (fast); the graph must be what a CPU trace gives."""
    import torch

    from glmcore_plugins.tpu_bm1684x import graphs
    _, cfg, w = model("chatglm3")
    for dtype in ("f16", "f32"):
        for part in part_specs(cfg, 16, dtype)[2:4] + part_specs(cfg, 16, dtype)[-2:]:
            arrays = graphs.group_weights(cfg, w, part["group"], 16, dtype)
            protos = []
            for device in ("meta", "cpu"):
                module = graphs.build_module(part, cfg, dtype, list(arrays))
                inputs = tuple(torch.zeros(t.shape, dtype=t.dtype, device=device)
                               for t in graphs.example_inputs(part))
                weights = tuple(torch.from_numpy(np.array(a)).to(device) for a in arrays.values())
                path = tmp_path / f"{device}.onnx"
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    torch.onnx.export(module, inputs + weights, str(path), dynamo=False, opset_version=15,
                                      input_names=[n for n, _, _ in part["inputs"]] + list(arrays),
                                      output_names=[n for n, _, _ in part["outputs"]], do_constant_folding=True)
                protos.append(onnx.load(str(path)).graph.SerializeToString())
            assert protos[0] == protos[1], (dtype, part["name"])


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_masked_slots_contribute_exactly_zero(model, tmp_path, dtype):
    """Whatever sits in masked slots (prompt padding, the unused head of the KV buffer) must not
    change a single bit of the valid outputs: exp(MASK_VALUE + score - max) underflows to 0.0."""
    _, cfg, w = model("chatglm3")
    manifest = export_parts(cfg, w, S, dtype, tmp_path / "parts")
    run = OrtRunner(tmp_path / "parts", manifest).run
    f = np.float16 if dtype == "f16" else np.float32
    assert f(MASK_VALUE) == MASK_VALUE                 # exact in the graph dtype
    rng = np.random.default_rng(5)
    T, n = 7, 9
    # prefill: the rows past T hold garbage that differs between the two runs
    h = rng.standard_normal((1, S, cfg.hidden_size)).astype(f)
    pos = np.zeros((1, S), np.int32)
    pos[0, :T] = np.arange(T)
    outs = []
    for seed in (6, 7):
        h[0, T:] = 30 * np.random.default_rng(seed).standard_normal((S - T, cfg.hidden_size))
        outs.append(run("block_0", {"input_states": h, "position_ids": pos,
                                    "attention_mask": prefill_mask(S, T).astype(f)}))
    for a, b in zip(*outs):
        assert np.array_equal(a[:, :T], b[:, :T])
    # decode: n cached rows at the tail, garbage before them
    x = rng.standard_normal((1, 1, cfg.hidden_size)).astype(f)
    k = rng.standard_normal((1, S, cfg.num_kv_heads, cfg.head_dim)).astype(f)
    v = rng.standard_normal(k.shape).astype(f)
    outs = []
    for seed in (8, 9):
        g = np.random.default_rng(seed)
        k[:, :S - n] = 30 * g.standard_normal(k[:, :S - n].shape)
        v[:, :S - n] = 30 * g.standard_normal(v[:, :S - n].shape)
        outs.append(run("block_cache_0", {"input_states": x, "position_ids": np.array([[n]], np.int32),
                                          "attention_mask": decode_mask(S, n).astype(f),
                                          "history_k": k, "history_v": v}))
    assert np.array_equal(outs[0][0], outs[1][0])
    for a, b in zip(outs[0][1:], outs[1][1:]):       # the advanced cache agrees on its valid rows
        assert np.array_equal(a[:, S - n - 1:], b[:, S - n - 1:])
    present_k, present_v = outs[0][1:]                # ... which moved up by one slot, unchanged
    assert np.array_equal(present_k[:, S - n - 1:-1], k[:, S - n:])
    assert np.array_equal(present_v[:, S - n - 1:-1], v[:, S - n:])


def test_masks():
    m = prefill_mask(6, 4)[0, 0]
    assert (m[:4] == np.where(np.tri(4, 6, dtype=bool), 0, MASK_VALUE)).all() and (m[4:] == MASK_VALUE).all()
    d = decode_mask(6, 2)[0, 0, 0]
    assert d.tolist() == [MASK_VALUE] * 4 + [0.0] * 3


def test_export_is_reused_and_keyed(model, cache_dir):
    _, cfg, w = model("chatglm2")
    load(cfg, w, cache_dir, capacity=24).close()
    parts = cache_dir / "tpu_bm1684x" / f"{w.fingerprint()}-seq24-f32"
    stamp = (parts / "manifest.json").stat().st_mtime_ns
    load(cfg, w, cache_dir, capacity=24).close()
    assert (parts / "manifest.json").stat().st_mtime_ns == stamp
    load(cfg, w, cache_dir, capacity=None, seq_len=20).close()     # another SEQ_LEN, another export
    assert read_manifest(cache_dir / "tpu_bm1684x" / f"{w.fingerprint()}-seq20-f32")["key"]["seq_len"] == 20


def test_option_errors(model, cache_dir):
    _, cfg, w = model("chatglm3")
    backend = tpu.TpuBm1684xBackend()
    with pytest.raises(BackendError, match="disagree"):
        load(cfg, w, cache_dir, capacity=32, seq_len=64)
    with pytest.raises(BackendError, match="invalid seq_len"):
        load(cfg, w, cache_dir, capacity=None, seq_len="big")
    with pytest.raises(BackendError, match="exceeds the limit"):
        load(cfg, w, cache_dir, capacity=cfg.max_seq_len + 1)
    with pytest.raises(BackendError, match="compute precision"):
        backend.resolve(LoadOptions(precision="f16", weights="f32"))
    assert backend.resolve(LoadOptions(precision="f16")).weights == "f16"
    assert backend.resolve(LoadOptions(weights="f16")).precision == "f16"
    with pytest.raises(BackendError, match="runtime=device"):
        load(cfg, w, cache_dir, runtime="device")
    s = load(cfg, w, cache_dir)
    with pytest.raises(BackendError, match="outside the vocabulary"):
        s.prefill([cfg.vocab_size])
    s.prefill(list(range(S)))
    with pytest.raises(BackendError, match="SEQ_LEN"):
        s.decode(1)


def test_probe_says_which_runtime():
    p = tpu.TpuBm1684xBackend().probe()
    assert p.ready and p.device == "cpu (host emulation)"
    assert p.details["runtime"].startswith(f"host emulation (onnxruntime {ort.__version__})")
    assert "sophon.sail not importable" in p.details["runtime"]
    assert "tpu_mlir" in p.details["compiler"]
    assert tpu.TpuBm1684xBackend().capabilities().speed_rank < 0   # emulation is never the default


# ---------------------------------------------------------------- convert and the TPU-MLIR script

def test_convert_writes_parts_and_script_without_tpu_mlir(model, tmp_path):
    _, cfg, w = model("chatglm3")
    backend = tpu.TpuBm1684xBackend()
    out, progress = tmp_path / "out", []
    opts = backend.resolve(LoadOptions(extra={"seq_len": S, "quantize": "w4f16"}))
    backend.convert(cfg, w, opts, out, progress.append)
    assert any("[1/8] exported embedding.onnx" in p for p in progress)
    assert progress[-1].startswith("not compiling: tpu_mlir is not importable")
    assert read_manifest(out / "onnx")["key"]["dtype"] == "f32"      # TPU-MLIR quantizes from f32
    script = (out / "compile.sh").read_text()
    assert subprocess.run(["bash", "-n", str(out / "compile.sh")]).returncode == 0
    assert os.access(out / "compile.sh", os.X_OK)
    for needle in ('QUANTIZE="${QUANTIZE:-W4F16}"', "CHIP=bm1684x", "model_transform.py --model_name",
                   "model_deploy.py --mlir", '--chip "$CHIP"', "--quantize_table", "--q_group_size 64",
                   "model_tool --combine", 'OUT="${OUT:-chatglm3_${QUANTIZE,,}_seq32.bmodel}"'):
        assert needle in script
    for part in read_manifest(out / "onnx")["parts"]:
        table = (out / "qtable" / f"{part['name']}.qtable").read_text().splitlines()[1:]
        graph = onnx.load(str(out / "onnx" / f"{part['name']}.onnx"), load_external_data=False).graph
        outputs = {o for n in graph.node for o in n.output}
        assert all(line.endswith(" F32") and line.split()[0] in outputs for line in table)
        assert len(table) == (0 if part["name"].startswith("embedding") else
                              1 if part["name"].startswith("lm_head") else 2) * 7   # 7 ops per RMSNorm
    progress.clear()
    backend.convert(cfg, w, opts, out, progress.append)
    assert any(p.startswith("reusing the exported ONNX parts") for p in progress)
    with pytest.raises(BackendError, match="unknown --quantize"):
        backend.convert(cfg, w, backend.resolve(LoadOptions(extra={"seq_len": S, "quantize": "INT3"})), out, print)


STUB = """#!/usr/bin/env bash
if [ "${{1:-}}" = "--help" ]; then echo "  --high_precision   keep norms in F32"; exit 0; fi
echo "$(basename "$0") $*" >> "$STUB_LOG"
while [ $# -gt 0 ]; do
  if [ "$1" = "{output_flag}" ]; then touch "$2"; fi
  shift
done
"""


def test_compile_script_runs_tpu_mlir_commands(model, tmp_path, monkeypatch):
    """With TPU-MLIR 'importable' (stub tools that log their arguments), convert runs compile.sh."""
    _, cfg, w = model("glm4")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, flag in (("model_transform.py", "--mlir"), ("model_deploy.py", "--model"), ("model_tool", "-o")):
        (bin_dir / tool).write_text(STUB.format(output_flag=flag))
        (bin_dir / tool).chmod(0o755)
    log = tmp_path / "tools.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("STUB_LOG", str(log))
    monkeypatch.setattr("glmcore_plugins.tpu_bm1684x.compile.tpu_mlir_status", lambda: (True, "stub tools"))
    backend, out, progress = tpu.TpuBm1684xBackend(), tmp_path / "out", []
    backend.convert(cfg, w, backend.resolve(LoadOptions(extra={"seq_len": S, "quantize": "F16"})), out,
                    progress.append)
    names = [p["name"] for p in read_manifest(out / "onnx")["parts"]]
    calls = log.read_text().splitlines()
    transforms = [c for c in calls if c.startswith("model_transform.py")]
    deploys = {c.split("--mlir ")[1].split(".mlir")[0]: c for c in calls if c.startswith("model_deploy.py")}
    assert [c.split("--model_name ")[1].split()[0] for c in transforms] == names
    assert sorted(deploys) == sorted(names)
    for name, c in deploys.items():
        assert "--chip bm1684x" in c and "--high_precision" in c and f"--quantize_table ../../qtable/{name}.qtable" in c
        assert "--quantize F16" in c and "--q_group_size" not in c
        assert ("--quant_output" in c) == (not name.startswith("lm_head"))
    combine = [c for c in calls if c.startswith("model_tool")]
    assert len(combine) == 1
    assert combine[0].split()[2:-2] == [f"build/{n}/{n}.bmodel" for n in names]
    assert (out / "glm4_f16_seq32.bmodel").is_file()
    assert f"compiling block_cache_{cfg.num_layers - 1} (F16)" in progress
    assert "wrote glm4_f16_seq32.bmodel" in progress
    assert progress[-1].endswith(f"--opt bmodel={out / 'glm4_f16_seq32.bmodel'}")


def test_cli_backends_and_convert(model, tmp_path, capsys):
    from glmcore.backend import registry
    from glmcore.cli import main
    reg = registry()
    added = "tpu_bm1684x" not in reg.entries       # not yet when the installed metadata predates the plugin
    if added:
        reg.register(tpu, "glmcore_plugins.tpu_bm1684x")   # exactly what its entry point does
    try:
        assert main(["backends"]) == 0
        text = capsys.readouterr().out
        assert "tpu_bm1684x" in text and "runtime: host emulation (onnxruntime" in text
        d, _, _ = model("chatglm2")
        assert main(["convert", "--backend", "tpu_bm1684x", "--model", str(d), "--out", str(tmp_path / "c"),
                     "--seq-len", "24", "--quantize", "BF16"]) == 0
        assert 'QUANTIZE="${QUANTIZE:-BF16}"' in (tmp_path / "c" / "compile.sh").read_text()
        assert read_manifest(tmp_path / "c" / "onnx")["key"]["seq_len"] == 24
        assert main(["convert", "--backend", "tpu_bm1684x", "--model", str(d), "--out", str(tmp_path / "c"),
                     "--quantize", "INT8"]) == 2
    finally:
        if added:
            reg.pm.unregister(tpu)
            del reg.entries["tpu_bm1684x"]


# ---------------------------------------------------------------- the device runtime

def fake_sail(parts_dir: Path):
    """A stand-in for sophon.sail (test double, not the SDK): its Engine runs the host ONNX parts and
    checks that every input arrives with the dtype and shape the 'bmodel' declares."""
    manifest = json.loads((parts_dir / "manifest.json").read_text())
    specs = {p["name"]: p for p in manifest["parts"]}
    sail = types.ModuleType("sophon.sail")
    sail.IOMode = types.SimpleNamespace(SYSIO=0)
    sail.Dtype = types.SimpleNamespace(BM_FLOAT32="f32", BM_FLOAT16="f16", BM_INT32="i32")
    code = {"float32": "f32", "float16": "f16", "int32": "i32"}
    sail.get_available_tpu_num = lambda: 1

    class Engine:
        def __init__(self, path, device_id, mode):
            assert Path(path).is_file() and mode == 0
            self.sessions = {n: ort.InferenceSession(str(parts_dir / f"{n}.onnx")) for n in specs}

        def get_graph_names(self):
            return list(specs)

        def get_input_dtype(self, graph, name):
            return code[{n: d for n, _, d in specs[graph]["inputs"]}[name]]

        def get_input_shape(self, graph, name):
            return list({n: s for n, s, _ in specs[graph]["inputs"]}[name])

        def get_output_names(self, graph):
            return [n for n, _, _ in specs[graph]["outputs"]]

        def process(self, graph, inputs):
            for n, shape, dt in specs[graph]["inputs"]:
                assert inputs[n].dtype == np.dtype(dt) and inputs[n].shape == tuple(shape), (graph, n)
            return dict(zip(self.get_output_names(graph), self.sessions[graph].run(None, inputs)))

    sail.Engine = Engine
    pkg = types.ModuleType("sophon")
    pkg.__spec__ = importlib.machinery.ModuleSpec("sophon", None)
    pkg.sail = sail
    return pkg, sail


@pytest.mark.parametrize("precision", ["f32", "f16"])
def test_device_runtime_adapter_with_stand_in_sail(model, cache_dir, tmp_path, monkeypatch, precision):
    """The sail-based path runs the same session logic: with a stand-in runtime over the same parts
    it must give the host emulation's logits bit for bit. (The real SDK is untested here.)"""
    _, cfg, w = model("chatglm3")
    host = load(cfg, w, cache_dir, precision)
    parts = cache_dir / "tpu_bm1684x" / f"{w.fingerprint()}-seq{S}-{precision}"
    bmodel = tmp_path / "model.bmodel"
    bmodel.write_text("stand-in")
    pkg, sail = fake_sail(parts)
    monkeypatch.setitem(sys.modules, "sophon", pkg)
    monkeypatch.setitem(sys.modules, "sophon.sail", sail)
    backend = tpu.TpuBm1684xBackend()
    probe = backend.probe()
    assert probe.device == "bm1684x" and probe.details["runtime"].startswith("device (sophon.sail")
    dev = load(cfg, w, cache_dir, precision, capacity=None, bmodel=str(bmodel))
    assert type(dev.runner).__name__ == "SailRunner" and dev.capacity == S
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, 20).tolist()
    assert np.array_equal(dev.prefill(ids[:12], all_logits=True), host.prefill(ids[:12], all_logits=True))
    for t in ids[12:]:
        assert np.array_equal(dev.decode(t), host.decode(t))
    with pytest.raises(BackendError, match="compiled for SEQ_LEN"):
        load(cfg, w, cache_dir, precision, capacity=S + 1, bmodel=str(bmodel))
    with pytest.raises(BackendError, match="needs a compiled bmodel"):
        load(cfg, w, cache_dir, precision, runtime="device")


def test_device_runtime_on_hardware(model, cache_dir):
    ok, why = tpu.sail_status()
    bmodel = os.environ.get("GLMCORE_BM1684X_BMODEL")
    if not ok or not bmodel:
        pytest.skip(f"needs a BM1684X: {why}" if not ok else "set GLMCORE_BM1684X_BMODEL to a bmodel compiled "
                    "from the tiny chatglm3 checkpoint")
    _, cfg, w = model("chatglm3")
    dev = load(cfg, w, cache_dir, capacity=None, bmodel=bmodel)
    host = load(cfg, w, cache_dir, "f16", capacity=dev.capacity)
    ids = list(range(1, 17))
    assert_close(dev.prefill(ids, all_logits=True), host.prefill(ids, all_logits=True), "f16")
