"""Backend tpu_bm1684x: the static-graph deployment, checked through its host emulation.

onnxruntime runs the exact exported ONNX parts here and is held to the torch reference on all three
families in f32 and f16. The TPU-MLIR step is checked by running the generated compile.sh against
stub tools that log their arguments, and the quantize tables against TPU-MLIR's op naming; the device
runtime adapter by a stand-in for sophon.sail that follows sail's real Python binding (src/bind.cpp,
src/engine.cpp, src/tensor.cpp of sophgo/sophon-sail) and runs the same parts. Neither TPU-MLIR nor a
BM1684X exist on this machine: the real-hardware test below is skipped unless both the Sophon runtime
and a compiled bmodel are present.
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
from glmcore.backend import Capabilities, SessionAdapter  # noqa: E402
from glmcore.scheduler import Scheduler, WindowPolicy  # noqa: E402
from glmcore.errors import BackendError  # noqa: E402
from glmcore.weights import load_weights  # noqa: E402
from glmcore_plugins.torch_ref import TorchBackend  # noqa: E402
from glmcore_plugins.tpu_bm1684x.export import export_parts, read_manifest  # noqa: E402
from glmcore_plugins.tpu_bm1684x.graphs import part_specs  # noqa: E402
from glmcore_plugins.tpu_bm1684x.session import OrtRunner, StaticGraphSession, decode_mask, prefill_mask  # noqa: E402
from glmcore_plugins.tpu_bm1684x.spec import MASK_VALUE  # noqa: E402

FAMILIES = ["chatglm2", "chatglm3", "glm4", "glm4-0414", "glm-edge"]
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


def test_window_policy_through_the_scheduler(model, cache_dir):
    """Past capacity the core slides the window by re-prefilling (the backend cannot shift in place)."""
    _, cfg, w = model("glm4")
    caps = tpu.TpuBm1684xBackend().capabilities()
    assert not caps.can_shift
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, 3 * S).tolist()
    policy = WindowPolicy("window", n_keep=4)
    ours = Scheduler(SessionAdapter([load(cfg, w, cache_dir)]), caps)
    theirs = Scheduler(SessionAdapter([ref_session(cfg, w)]), Capabilities())

    def stream(sched):
        slot = sched.slots[0]
        return [sched.feed(slot, ids[:20], policy)] + [sched.feed(slot, [t], policy) for t in ids[20:]], slot.shifts

    (got, shifts), (want, ref_shifts) = stream(ours), stream(theirs)
    assert shifts == ref_shifts > 0
    assert_close(np.stack(got), np.stack(want), "f32")


def test_decode_top1_is_argmax_of_decode(model, cache_dir):
    _, cfg, w = model("chatglm3")
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, 12).tolist()
    a, b = load(cfg, w, cache_dir), load(cfg, w, cache_dir)
    a.prefill(ids[:8]), b.prefill(ids[:8])
    for t in ids[8:]:
        assert b.decode_top1(t) == int(np.argmax(a.decode(t)))


def test_batch_slots_share_one_set_of_parts(model, cache_dir):
    """Several sequences (the core's SessionAdapter) open the parts once: forked sessions share the
    runner, keep their own KV, and the runner closes with the last of them. Loading the parts per slot
    held 4x the model (a 1b eval with 4 slots went past 24 GB)."""
    from glmcore.backend import SessionAdapter
    _, cfg, w = model("chatglm3")
    backend = tpu.TpuBm1684xBackend()
    opts = backend.resolve(LoadOptions(capacity=S, cache_dir=cache_dir))
    batch = SessionAdapter.load(backend, cfg, w, opts, 3)
    runners = {id(s.runner) for s in batch.sessions}
    assert len(runners) == 1
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, 12).tolist()
    got = batch.step([(0, ids[:7]), (1, ids[3:12]), (2, ids[:2])])
    for (a, b), logits in zip([(0, 7), (3, 12), (0, 2)], got):
        assert_close(logits, ref_session(cfg, w).prefill(ids[a:b]), "f32")
    runner = batch.sessions[0].runner
    batch.sessions[0].close(), batch.sessions[0].close()       # a second close of one session counts once
    assert runner.sessions                                     # the others still run on it
    assert_close(batch.step([(1, [ids[0]])])[0], ref_session(cfg, w).prefill(ids[3:12] + [ids[0]]), "f32")
    batch.close()
    assert not runner.sessions


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
    assert progress[-1].startswith("not compiling: TPU-MLIR commands not on PATH: model_transform")
    assert read_manifest(out / "onnx")["key"]["dtype"] == "f32"      # TPU-MLIR quantizes from f32
    script = (out / "compile.sh").read_text()
    assert subprocess.run(["bash", "-n", str(out / "compile.sh")]).returncode == 0
    assert os.access(out / "compile.sh", os.X_OK)
    for needle in ('QUANTIZE="${QUANTIZE:-W4F16}"', "CHIP=bm1684x", '"$MODEL_TRANSFORM" --model_name',
                   '"$MODEL_DEPLOY" --mlir', '--chip "$CHIP"', "--quantize_table", "--q_group_size 64",
                   '"$MODEL_TOOL" --combine', 'OUT="${OUT:-chatglm3_${QUANTIZE,,}_seq32.bmodel}"'):
        assert needle in script
    for part in read_manifest(out / "onnx")["parts"]:
        table = (out / "qtable" / f"{part['name']}.qtable").read_text().splitlines()[1:]
        graph = onnx.load(str(out / "onnx" / f"{part['name']}.onnx"), load_external_data=False).graph
        assert all(line.endswith(" F32") for line in table)
        names = {line.split()[0] for line in table}
        # TPU-MLIR names an op "{first output}_{OpType}" (OnnxConverter.py); a bare output name matches nothing
        tpu_mlir_names = {f"{n.output[0]}_{n.op_type}" for n in graph.node}
        assert names <= tpu_mlir_names and not names & {o for n in graph.node for o in n.output}
        norms = {"embedding": [], "embedding_cache": [], "lm_head": ["final_norm"], "greedy_head": []}.get(
            part["name"], ["input_norm", "post_attn_norm"])
        assert len(table) == 7 * len(norms)                   # Pow ReduceMean Add Sqrt Div Mul Mul per RMSNorm
        for norm in norms:   # the fused top.RMSNormOp keeps the name of the norm's last (weight) Mul
            last_mul = [n for n in graph.node if n.name.startswith(f"/{norm}/") and n.op_type == "Mul"][-1]
            assert last_mul.input[1] == norm and f"{last_mul.output[0]}_Mul" in names
    progress.clear()
    backend.convert(cfg, w, opts, out, progress.append)
    assert any(p.startswith("reusing the exported ONNX parts") for p in progress)
    with pytest.raises(BackendError, match="unknown --quantize"):
        backend.convert(cfg, w, backend.resolve(LoadOptions(extra={"seq_len": S, "quantize": "INT3"})), out, print)


STUB = """#!/usr/bin/env bash
if [ "${{1:-}}" = "--help" ]; then echo "  --high_precision   some ops will force to be float32"; exit 0; fi
echo "$(basename "$0") $*" >> "$STUB_LOG"
while [ $# -gt 0 ]; do
  if [ "$1" = "{output_flag}" ]; then touch "$2"; fi
  shift
done
"""


def stub_tools(bin_dir: Path, suffix: str, skip=()) -> None:
    """Logging stand-ins for TPU-MLIR's commands, named as a source install (model_transform.py ...)
    or as a pip install registers them (suffix "")."""
    bin_dir.mkdir()
    for tool, flag in (("model_transform", "--mlir"), ("model_deploy", "--model"), ("model_tool", "-o")):
        if tool in skip:
            continue
        name = tool + (suffix if tool != "model_tool" else "")
        (bin_dir / name).write_text(STUB.format(output_flag=flag))
        (bin_dir / name).chmod(0o755)


@pytest.mark.parametrize("suffix", [".py", ""])
def test_compile_script_runs_tpu_mlir_commands(model, tmp_path, monkeypatch, suffix):
    """With TPU-MLIR's commands on PATH (stubs that log their arguments), convert runs compile.sh."""
    _, cfg, w = model("glm4")
    stub_tools(tmp_path / "bin", suffix)
    log = tmp_path / "tools.log"
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("STUB_LOG", str(log))
    from glmcore_plugins.tpu_bm1684x.compile import tpu_mlir_status
    ok, why = tpu_mlir_status()
    assert ok and f"model_deploy{suffix}" in why
    backend, out, progress = tpu.TpuBm1684xBackend(), tmp_path / "out", []
    backend.convert(cfg, w, backend.resolve(LoadOptions(extra={"seq_len": S})), out, progress.append)
    names = [p["name"] for p in read_manifest(out / "onnx")["parts"]]
    assert "greedy_head" in names and "lm_head_top1" not in names
    calls = log.read_text().splitlines()
    transforms = [c for c in calls if c.startswith("model_transform")]
    deploys = {c.split("--mlir ")[1].split(".mlir")[0]: c for c in calls if c.startswith("model_deploy")}
    assert [c.split("--model_name ")[1].split()[0] for c in transforms] == names
    assert all(f"--model_def ../../onnx/{n}.onnx" in c for n, c in zip(names, transforms))
    assert sorted(deploys) == sorted(names)
    for name, c in deploys.items():
        assert "--chip bm1684x" in c and "--high_precision" in c and f"--quantize_table ../../qtable/{name}.qtable" in c
        assert "--ignore_f16_overflow" not in c       # newer TPU-MLIR rejects it; older ones default to the safe side
        if name == "greedy_head":                      # TopK over f32 logits, no weights: nothing to quantize
            assert "--quantize F32" in c and "--quant_input" not in c
        elif name.startswith("embedding"):             # GLM-4 defaults to the BF16 family, embedding in BF16
            assert "--quantize BF16" in c and "--q_group_size" not in c
        else:   # the group size goes to the W8 modes too (current model_deploy quantizes W8 per group)
            assert "--quantize W8BF16" in c and "--q_group_size 64" in c
            assert ("--quant_output" in c) == (name != "lm_head")
    combine = [c for c in calls if c.startswith("model_tool")]
    assert len(combine) == 1
    assert combine[0].split()[2:-2] == [f"build/{n}/{n}.bmodel" for n in names]
    assert (out / "glm4_w8bf16_seq32.bmodel").is_file()
    assert f"compiling block_cache_{cfg.num_layers - 1} (W8BF16)" in progress
    assert "wrote glm4_w8bf16_seq32.bmodel" in progress
    assert progress[-1].endswith(f"--opt bmodel={out / 'glm4_w8bf16_seq32.bmodel'}")


def test_tool_detection_names_what_is_missing(model, tmp_path, monkeypatch):
    from glmcore_plugins.tpu_bm1684x.compile import tpu_mlir_status
    stub_tools(tmp_path / "bin", ".py", skip=("model_tool",))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    ok, why = tpu_mlir_status()
    assert not ok and "model_tool" in why and "model_deploy" not in why
    # the script itself stops with the same diagnosis when run by hand without the tool
    _, cfg, w = model("chatglm2")
    backend, out = tpu.TpuBm1684xBackend(), tmp_path / "out"
    backend.convert(cfg, w, backend.resolve(LoadOptions(extra={"seq_len": S})), out, lambda m: None)
    r = subprocess.run(["/bin/bash", str(out / "compile.sh")], capture_output=True, text=True,
                       env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "STUB_LOG": str(tmp_path / "log")})
    assert r.returncode == 2 and "model_tool(.py) not found on PATH" in r.stderr


def test_quantize_modes_per_family(model, tmp_path):
    """GLM-4 defaults to the BF16 family (LLM-TPU's GLM4 compile.sh); ChatGLM to W8F16; W4BF16 takes a group size."""
    from glmcore_plugins.tpu_bm1684x.spec import QUANTIZE_MODES, default_quantize
    assert {"W8BF16", "W4BF16", "BF16"} <= set(QUANTIZE_MODES)
    assert default_quantize("glm4") == "W8BF16" and default_quantize("chatglm3") == "W8F16"
    _, cfg, w = model("chatglm3")
    backend = tpu.TpuBm1684xBackend()
    backend.convert(cfg, w, backend.resolve(LoadOptions(extra={"seq_len": S})), tmp_path / "a", lambda m: None)
    assert 'QUANTIZE="${QUANTIZE:-W8F16}"' in (tmp_path / "a" / "compile.sh").read_text()
    backend.convert(cfg, w, backend.resolve(LoadOptions(extra={"seq_len": S, "quantize": "w4bf16", "group_size": 64})),
                    tmp_path / "b", lambda m: None)
    script = (tmp_path / "b" / "compile.sh").read_text()
    assert 'QUANTIZE="${QUANTIZE:-W4BF16}"' in script and "--q_group_size 64" in script
    # W8F16/W8BF16 take it too: current model_deploy applies --q_group_size to them (default 64 there)
    backend.convert(cfg, w, backend.resolve(LoadOptions(extra={"seq_len": S, "quantize": "W8F16", "group_size": 128})),
                    tmp_path / "c", lambda m: None)
    lines = (tmp_path / "c" / "compile.sh").read_text().splitlines()
    at = lines.index('GROUP_ARGS=""')
    for mode, want in (("W8F16", "--q_group_size 128"), ("W8BF16", "--q_group_size 128"), ("BF16", "")):
        r = subprocess.run(["bash", "-c", "\n".join(lines[at:at + 2] + ['echo "$GROUP_ARGS"'])],
                           capture_output=True, text=True, env={"QUANTIZE": mode})
        assert r.stdout.strip() == want, (mode, r.stdout, r.stderr)


def test_parts_over_a_protobuf_go_to_tpu_mlir_as_torchscript(model, tmp_path, monkeypatch):
    """GLM-4's f32 embedding and output layer (151,552 x 4,096 x 4 bytes) exceed a protobuf: like LLM-TPU's
    GLM4 compile.sh they are compiled from TorchScript .pt with --input_shapes/--input_types. Here the
    limit is lowered so the tiny model takes that path; the .pt must compute what the ONNX part does."""
    import torch
    monkeypatch.setattr(tpu, "PROTOBUF_LIMIT", 0)
    _, cfg, w = model("glm4")
    backend, out, progress = tpu.TpuBm1684xBackend(), tmp_path / "out", []
    backend.convert(cfg, w, backend.resolve(LoadOptions(extra={"seq_len": S})), out, progress.append)
    assert any("embedding: f32 weights exceed one protobuf" in p for p in progress)
    script = (out / "compile.sh").read_text()
    assert f'compile_part embedding "../../onnx/embedding.pt --input_shapes [[1,{S}]] --input_types int32"' in script
    assert 'compile_part embedding_cache "../../onnx/embedding.pt --input_shapes [[1,1]] --input_types int32"' in script
    assert f'compile_part lm_head "../../onnx/lm_head.pt --input_shapes [[1,{cfg.hidden_size}]]"' in script
    assert 'compile_part greedy_head "../../onnx/greedy_head.onnx"' in script
    run = OrtRunner(out / "onnx", read_manifest(out / "onnx")).run
    ids = np.arange(S, dtype=np.int32).reshape(1, S) % cfg.vocab_size
    emb = torch.jit.load(str(out / "onnx" / "embedding.pt"))
    np.testing.assert_allclose(emb(torch.from_numpy(ids)).numpy(), run("embedding", {"input_ids": ids})[0], rtol=0, atol=0)
    h = np.random.default_rng(0).standard_normal((1, cfg.hidden_size)).astype(np.float32)
    head = torch.jit.load(str(out / "onnx" / "lm_head.pt"))
    np.testing.assert_allclose(head(torch.from_numpy(h)).numpy(), run("lm_head", {"hidden_states": h})[0], atol=1e-4)


def test_torchscript_exporter_keyword_only_where_torch_has_it(monkeypatch):
    """torch.onnx.export gained `dynamo` in torch 2.5; the extra allows torch >= 2.3."""
    import torch

    from glmcore_plugins.tpu_bm1684x.graphs import torchscript_exporter
    assert torchscript_exporter() == {"dynamo": False}

    def old_export(model, args, f, export_params=True, verbose=False, opset_version=None, input_names=None,
                   output_names=None, do_constant_folding=True):
        pass
    monkeypatch.setattr(torch.onnx, "export", old_export)
    assert torchscript_exporter() == {}


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

class SailEngineError(RuntimeError):
    pass


def tpu_mlir_torch_names(path: Path) -> tuple[list, list, set]:
    """What TPU-MLIR's torch front end (python/transform/TorchConverter.py, TorchHelper.py) calls the
    tensors and ops of a TorchScript file: it loads it and reads `inlined_graph`; inputs are the graph
    inputs after `self` by debugName(); outputs the returned value's debugName(), or a returned tuple's
    elements'; an op is named after its node's first output, and aten::rsqrt becomes a Sqrt op
    "{name}_sqrt" and a Reciprocal "{name}". Returns (inputs, outputs, op names)."""
    import torch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = torch.jit.load(str(path), map_location="cpu").inlined_graph
    outputs = []
    for value in g.outputs():
        maker = value.node()
        tuple_like = maker.kind() in ("prim::TupleConstruct", "prim::ListConstruct")
        outputs.extend(v.debugName() for v in maker.inputs()) if tuple_like else outputs.append(value.debugName())
    ops = set()
    for node in g.nodes():
        if node.kind().startswith("aten::"):
            first = list(node.outputs())[0].debugName()
            ops |= {first, f"{first}_sqrt"} if node.kind() == "aten::rsqrt" else {first}
    return [v.debugName() for v in list(g.inputs())[1:]], outputs, ops


def bmodel_16bit_io(onnx_path: Path, quant_input: bool, quant_output: bool) -> dict[str, list[bool]]:
    """Which float inputs and outputs of a part TPU-MLIR's model_deploy makes 16-bit, by position, derived from
    their consumers as tpu-mlir's StripIOQuant pass does (lib/Dialect/Tpu/Transforms/StripIOQuant.cpp):

    - StripInputQuantTpuCastPattern (--quant_input): an input keeps its cast, hence its F32 type, unless the
      input has ONE use (`if (!out.hasOneUse()) return failure();`) and that use is a Cast from F32 to F16/BF16
      (`isF32toF16`), directly or behind one Reshape/Unsqueeze of one use (`handleTyOp<tpu::ReshapeOp>`). A
      Cast to 16 bits exists only where the consumer is lowered in 16 bits: ops the quantize table keeps F32 (the
      RMSNorms, export.norm_op_names) take the F32 input as it is.
    - StripOutputQuantTpuCastPattern (--quant_output): an output is 16-bit when its value is a 16-bit op's
      result (`isF16toF32` cast before the return), i.e. not an F32-table op's.

    The host's f16 parts carry Casts the compiled f32 graph does not: they are looked through."""
    import onnx

    from glmcore_plugins.tpu_bm1684x.export import norm_op_names
    m = onnx.load(str(onnx_path), load_external_data=False)
    f32_ops = set(norm_op_names(m))
    consumers, producer = {}, {}
    for node in m.graph.node:
        for x in node.input:
            consumers.setdefault(x, []).append(node)
        for x in node.output:
            producer[x] = node

    def uses(value):          # the ops reading value, through host-only Casts
        out = []
        for node in consumers.get(value, []):
            out += uses(node.output[0]) if node.op_type == "Cast" else [node]
        return out

    def is_f32(node):
        return f"{node.output[0]}_{node.op_type}" in f32_ops

    def input_16bit(value):
        users = uses(value)
        if len(users) != 1:
            return False
        if users[0].op_type in ("Reshape", "Unsqueeze"):
            users = uses(users[0].output[0])
            if len(users) != 1:
                return False
        return not is_f32(users[0])

    def output_16bit(value):
        node = producer[value]
        while node.op_type == "Cast":
            node = producer[node.input[0]]
        return not is_f32(node)

    return {"inputs": [quant_input and input_16bit(v.name) for v in m.graph.input],
            "outputs": [quant_output and output_16bit(v.name) for v in m.graph.output]}


def fake_sail(parts_dir: Path, io_dtype: str, torchscript_dir: Path | None = None):
    """A stand-in for sophon.sail (a test double, not the SDK) that follows sail's real Python binding:

    - `Engine.process(graph, {name: ndarray})` is bound as a map of pybind11 `array_t<float>`
      (src/bind.cpp): every array is converted to float32 on the way in; it needs SYSI/SYSIO mode;
      INT32 inputs are scaled back from float, F16/BF16 inputs throw "not supported" and 16-bit outputs
      are returned read with float strides (src/engine.cpp, scale_input_tensor / process).
    - `Engine.process(graph, {name: Tensor}, {name: Tensor})` runs on tensors' device memory.
    - `Tensor(handle, shape, dtype, own_sys, own_dev)`; `update_data` overloads take float32, int8,
      uint8, int32, uint32, int16, uint16 arrays (other dtypes are converted to float32 by pybind11
      first) and refuse an item size that is not the tensor's (src/tensor.cpp); `asnumpy()` returns
      uint16 for F16/BF16 tensors.

    - `update_data` (src/tensor.cpp, Tensor_CC::update_data) refuses an array whose ndim or shape is not
      the tensor's ("invalid argument"), and for F32/INT32 tensors one whose format is not float32/int32
      ("Wrong dtype of input array!"): int32 data into an F32 tensor fails although both are 4 bytes.

    The 'bmodel' declares each float input and output F32 or 16-bit (io_dtype: f32, f16, bf16) as
    --quant_input/--quant_output make it in tpu-mlir (bmodel_16bit_io: an input read by an RMSNorm or by several
    ops stays F32, e.g. a block's input_states and lm_head's hidden_states), and runs the
    host ONNX parts in parts_dir (f16 parts for f16, f32 parts otherwise). Graphs compiled from a
    TorchScript part in torchscript_dir (embedding.pt for embedding and embedding_cache, lm_head.pt) have
    the tensor names TPU-MLIR gives them: the traced graph's debugName()s (TorchConverter.py)."""
    import ml_dtypes
    manifest = json.loads((parts_dir / "manifest.json").read_text())
    specs = {p["name"]: p for p in manifest["parts"]}
    part_float = np.dtype(manifest["key"]["dtype"].replace("f", "float"))
    sail = types.ModuleType("sophon.sail")
    sail.IOMode = types.SimpleNamespace(SYSI=0, SYSO=1, SYSIO=2, DEVIO=3)
    sail.Dtype = types.SimpleNamespace(BM_FLOAT32="f32", BM_FLOAT16="f16", BM_BFLOAT16="bf16", BM_INT32="i32")
    np_of = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16),
             "i32": np.dtype(np.int32)}
    sail.get_available_tpu_num = lambda: 1
    bound = (np.float32, np.int8, np.uint8, np.int32, np.uint32, np.int16, np.uint16)   # update_data overloads

    pt_names = {}                                      # graph -> (input names, output names) as TPU-MLIR names them
    for graph, pt in (("embedding", "embedding.pt"), ("embedding_cache", "embedding.pt"), ("lm_head", "lm_head.pt")):
        if torchscript_dir is not None and (torchscript_dir / pt).is_file():
            pt_names[graph] = tpu_mlir_torch_names(torchscript_dir / pt)[:2]

    # compile.sh's flags per part: (--quant_input, --quant_output); greedy_head is compiled F32 without them
    quant_io = {"lm_head": (True, False), "greedy_head": (False, False)}
    stripped = {name: bmodel_16bit_io(parts_dir / f"{name}.onnx", *quant_io.get(name, (True, True)))
                for name in specs}

    def declared(dt: str, graph: str, which: str, position: int) -> str:
        if dt == "int32":
            return "i32"
        return io_dtype if stripped[graph][which][position] else "f32"

    class Handle:
        def __init__(self, device_id):
            self.device_id = device_id

    class Tensor:
        def __init__(self, handle, shape, dtype, own_sys_data=False, own_dev_data=False):
            assert isinstance(handle, Handle) and own_dev_data
            self._shape, self._dtype = list(shape), dtype
            self.mem = np.zeros(int(np.prod(shape)) * np_of[dtype].itemsize, np.uint8)   # device memory

        def shape(self):
            return list(self._shape)

        def dtype(self):
            return self._dtype

        def update_data(self, data):
            a = np.asarray(data)
            if a.dtype.type not in bound:
                a = a.astype(np.float32)              # pybind11's conversion pass: array_t<float> takes it
            if list(a.shape) != self._shape:          # ndim first, then every dim
                raise SailEngineError("invalid argument")
            exact = {"f32": np.float32, "i32": np.int32}.get(self._dtype)    # F16/BF16: any 2-byte data
            if a.dtype.itemsize != np_of[self._dtype].itemsize or (exact and a.dtype.type is not exact):
                raise SailEngineError("Wrong dtype of input array!")
            if a.nbytes > self.mem.nbytes:
                raise SailEngineError("size out of range")
            self.mem[:a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)

        def asnumpy(self):
            view = np.uint16 if np_of[self._dtype].itemsize == 2 else np_of[self._dtype]
            return self.mem.view(view).reshape(self._shape).copy()

    class Engine:
        def __init__(self, path, device_id, mode):
            assert Path(path).is_file()
            self.mode = mode
            self.sessions = {n: ort.InferenceSession(str(parts_dir / f"{n}.onnx")) for n in specs}

        def get_graph_names(self):
            return list(specs)

        def _io(self, graph, which):
            names = [n for n, _, _ in specs[graph][which]]
            if graph in pt_names:
                names = pt_names[graph][0 if which == "inputs" else 1]
            return {name: (tuple(shape), declared(dt, graph, which, i))
                    for i, (name, (_, shape, dt)) in enumerate(zip(names, specs[graph][which], strict=True))}

        def get_input_names(self, graph):
            return list(self._io(graph, "inputs"))

        def get_output_names(self, graph):
            return list(self._io(graph, "outputs"))

        def get_input_shape(self, graph, name):
            return list(self._io(graph, "inputs")[name][0])

        def get_output_shape(self, graph, name):
            return list(self._io(graph, "outputs")[name][0])

        def get_input_dtype(self, graph, name):
            return self._io(graph, "inputs")[name][1]

        def get_output_dtype(self, graph, name):
            return self._io(graph, "outputs")[name][1]

        def _run(self, graph, values: dict) -> dict:
            """values: numpy arrays in the declared dtypes, by this bmodel's names -> outputs likewise.
            The ONNX part behind a graph is fed by position."""
            part_in = {n: values[name].astype(np.int32 if dt == "int32" else np.float32 if dt == "float32" else part_float)
                       for (n, _, dt), name in zip(specs[graph]["inputs"], self.get_input_names(graph), strict=True)}
            outs = self.sessions[graph].run(None, part_in)
            return {n: o.astype(np_of[self.get_output_dtype(graph, n)]) for n, o in zip(self.get_output_names(graph), outs)}

        def process(self, graph, inputs, outputs=None, core_list=()):
            if outputs is None:                        # the numpy overload: map<string, array_t<float>>
                if self.mode not in (sail.IOMode.SYSI, sail.IOMode.SYSIO):
                    raise SailEngineError("bad input")   # "If input type is numpy.array, IOMode must be SYSIO or SYSI!"
                values = {}
                for n, a in inputs.items():
                    a = np.ascontiguousarray(a, dtype=np.float32)
                    dt = self.get_input_dtype(graph, n)
                    if dt not in ("f32", "i32"):
                        raise SailEngineError("not supported")   # scale_input_tensor: F16/BF16 inputs
                    values[n] = a.astype(np.int32) if dt == "i32" else a
                result = {}
                for n, o in self._run(graph, values).items():
                    raw = o.view(np.uint8).reshape(-1)      # 16-bit outputs read with float strides
                    if o.dtype.itemsize == 2:
                        raw = np.concatenate([raw, np.zeros_like(raw)])
                    result[n] = raw.view(np.float32).reshape(o.shape) if o.dtype != np.int32 else o.astype(np.float32)
                return result
            assert set(inputs) == set(self.get_input_names(graph)) and set(outputs) == set(self.get_output_names(graph))
            values = {}
            for n, t in inputs.items():
                assert isinstance(t, Tensor), (graph, n)
                values[n] = t.mem.view(np_of[self.get_input_dtype(graph, n)]).reshape(self.get_input_shape(graph, n))
            for n, o in self._run(graph, values).items():
                outputs[n].mem[:] = np.ascontiguousarray(o).view(np.uint8).reshape(-1)

    sail.Handle, sail.Tensor, sail.Engine = Handle, Tensor, Engine
    pkg = types.ModuleType("sophon")
    pkg.__spec__ = importlib.machinery.ModuleSpec("sophon", None)
    pkg.sail = sail
    return pkg, sail


def test_fake_sail_follows_the_binding(model, cache_dir):
    """The stand-in refuses what the real sail refuses: 16-bit data through the numpy overload or
    through a float32 array, and numpy input in DEVIO mode."""
    _, cfg, w = model("chatglm3")
    load(cfg, w, cache_dir, "f16").close()
    parts = cache_dir / "tpu_bm1684x" / f"{w.fingerprint()}-seq{S}-f16"
    _, sail = fake_sail(parts, "f16")
    e = sail.Engine(__file__, 0, sail.IOMode.SYSIO)
    with pytest.raises(SailEngineError, match="not supported"):        # the 16-bit mask and history K/V
        e.process("block_cache_0", {n: np.zeros(e.get_input_shape("block_cache_0", n), np.float32)
                                    for n in e.get_input_names("block_cache_0")})
    t = sail.Tensor(sail.Handle(0), [1, cfg.hidden_size], sail.Dtype.BM_FLOAT16, False, True)
    with pytest.raises(SailEngineError, match="Wrong dtype"):
        t.update_data(np.zeros((1, cfg.hidden_size), np.float16))      # pybind11 makes it float32 first
    t.update_data(np.ones((1, cfg.hidden_size), np.float16).view(np.uint16))
    assert t.asnumpy().dtype == np.uint16 and (t.asnumpy().view(np.float16) == 1).all()
    with pytest.raises(SailEngineError, match="bad input"):
        sail.Engine(__file__, 0, sail.IOMode.DEVIO).process("embedding_cache", {"input_ids": np.zeros((1, 1))})
    # update_data checks ndim and every dim, then the format of 4-byte tensors (src/tensor.cpp)
    with pytest.raises(SailEngineError, match="invalid argument"):
        t.update_data(np.ones((cfg.hidden_size,), np.uint16))            # ndim 1 into [1, H]
    with pytest.raises(SailEngineError, match="invalid argument"):
        t.update_data(np.ones((1, cfg.hidden_size - 1), np.uint16))      # a dim off
    f32 = sail.Tensor(sail.Handle(0), [1, 4], sail.Dtype.BM_FLOAT32, False, True)
    with pytest.raises(SailEngineError, match="Wrong dtype"):
        f32.update_data(np.ones((1, 4), np.int32))                       # 4 bytes, but not float
    i32 = sail.Tensor(sail.Handle(0), [1, 4], sail.Dtype.BM_INT32, False, True)
    with pytest.raises(SailEngineError, match="Wrong dtype"):
        i32.update_data(np.ones((1, 4), np.float32))
    f32.update_data(np.ones((1, 4), np.float32)), i32.update_data(np.ones((1, 4), np.int32))
    # tpu-mlir's StripIOQuant strips an input's cast only where the input has one use, cast to 16 bits: lm_head's
    # hidden_states feeds the F32 final norm twice, so it stays F32; --quant_output is not passed for lm_head, so
    # the logits stay F32. A block's input_states feeds its F32 input norm and the residual add: F32; the history
    # K/V (one Concat) and the mask (Reshape, then the 16-bit score Add) lose their casts, as do the block's outputs.
    F32, F16 = sail.Dtype.BM_FLOAT32, sail.Dtype.BM_FLOAT16
    assert e.get_input_dtype("lm_head", e.get_input_names("lm_head")[0]) == F32
    assert e.get_output_dtype("lm_head", e.get_output_names("lm_head")[0]) == F32
    assert [e.get_input_dtype("block_cache_0", n) for n in e.get_input_names("block_cache_0")] == \
        [F32, sail.Dtype.BM_INT32, F16, F16, F16]
    assert {e.get_output_dtype("block_cache_0", n) for n in e.get_output_names("block_cache_0")} == {F16}
    assert e.get_output_dtype("embedding", "input_embed") == F16
    _, sail16 = fake_sail(cache_dir / "tpu_bm1684x" / f"{w.fingerprint()}-seq{S}-f16", "bf16")
    e = sail16.Engine(__file__, 0, sail16.IOMode.DEVIO)
    assert e.get_input_dtype("block_cache_0", "history_k") == sail16.Dtype.BM_BFLOAT16
    assert e.get_input_dtype("lm_head", "hidden_states") == sail16.Dtype.BM_FLOAT32


@pytest.mark.parametrize("precision", ["f32", "f16", "bf16"])
def test_device_runtime_adapter_with_stand_in_sail(model, cache_dir, tmp_path, monkeypatch, precision):
    """The sail-based path runs the same session logic: with a stand-in runtime over the same parts it
    must give the host emulation's logits bit for bit (f32, f16), and a BF16 'bmodel' (16-bit I/O and
    KV cache in bf16) must stay within bf16 rounding of them. (The real SDK is untested here.)"""
    _, cfg, w = model("chatglm3")
    host = load(cfg, w, cache_dir, "f16" if precision == "f16" else "f32")
    parts = cache_dir / "tpu_bm1684x" / f"{w.fingerprint()}-seq{S}-{'f16' if precision == 'f16' else 'f32'}"
    bmodel = tmp_path / "model.bmodel"
    bmodel.write_text("stand-in")
    pkg, sail = fake_sail(parts, precision)
    monkeypatch.setitem(sys.modules, "sophon", pkg)
    monkeypatch.setitem(sys.modules, "sophon.sail", sail)
    backend = tpu.TpuBm1684xBackend()
    probe = backend.probe()
    assert probe.device == "bm1684x" and probe.details["runtime"].startswith("device (sophon.sail")
    dev = load(cfg, w, cache_dir, capacity=None, bmodel=str(bmodel))
    assert type(dev.runner).__name__ == "SailRunner" and dev.capacity == S
    assert dev.k[0].dtype.name == {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[precision]
    device_matches_host(dev, host, np.random.default_rng(7).integers(0, cfg.vocab_size, 19).tolist(), 12, precision)
    with pytest.raises(BackendError, match="compiled for SEQ_LEN"):
        load(cfg, w, cache_dir, capacity=S + 1, bmodel=str(bmodel))
    with pytest.raises(BackendError, match="needs a compiled bmodel"):
        load(cfg, w, cache_dir, runtime="device")


def converted_with_torchscript(model, tmp_path, monkeypatch):
    """`glmcore convert` of the tiny GLM-4 with the protobuf limit lowered, so that its embedding and
    lm_head go to TPU-MLIR as TorchScript .pt as the real GLM-4's do. Returns (cfg, weights, backend, out)."""
    monkeypatch.setattr(tpu, "PROTOBUF_LIMIT", 0)
    _, cfg, w = model("glm4")
    backend, out = tpu.TpuBm1684xBackend(), tmp_path / "out"
    backend.convert(cfg, w, backend.resolve(LoadOptions(extra={"seq_len": S})), out, lambda m: None)
    return cfg, w, backend, out


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_glm4_bmodel_with_torchscript_parts_runs_by_position(model, tmp_path, monkeypatch, precision):
    """GLM-4's embedding and lm_head go to TPU-MLIR as TorchScript, and TPU-MLIR names their tensors by
    the traced graph's debugName()s ("x.1", ...), not input_ids/hidden_states: the device runtime must
    address every graph's tensors by position (get_input_names(graph)[i]), as sophon-demo and LLM-TPU
    do, and take SEQ_LEN from the embedding's first input. The stand-in sail names them as TPU-MLIR does."""
    import torch
    cfg, w, backend, out = converted_with_torchscript(model, tmp_path, monkeypatch)
    pkg, sail = fake_sail(out / "onnx", precision, torchscript_dir=out / "onnx")
    e = sail.Engine(__file__, 0, sail.IOMode.DEVIO)
    traced = torch.jit.load(str(out / "onnx" / "embedding.pt")).inlined_graph
    assert e.get_input_names("embedding") == [list(traced.inputs())[1].debugName()] != ["input_ids"]
    assert e.get_input_names("lm_head") != ["hidden_states"] and e.get_output_names("lm_head") != ["logits"]
    monkeypatch.setitem(sys.modules, "sophon", pkg)
    monkeypatch.setitem(sys.modules, "sophon.sail", sail)
    bmodel = out / "glm4.bmodel"
    bmodel.write_text("stand-in")
    dev = backend.load(cfg, w, backend.resolve(LoadOptions(precision="f32", extra={"bmodel": str(bmodel)})))
    assert type(dev.runner).__name__ == "SailRunner" and dev.capacity == S
    host = StaticGraphSession(OrtRunner(out / "onnx", read_manifest(out / "onnx")), cfg, S)
    device_matches_host(dev, host, np.random.default_rng(9).integers(0, cfg.vocab_size, 16).tolist(), 10, precision)


def test_every_quantize_table_entry_names_an_op_of_its_graph(model, tmp_path, monkeypatch):
    """TPU-MLIR ignores quantize-table names it does not find (TopToTpuPass init_qtable), so a table in
    the ONNX part's names applied to lm_head.pt would leave the final norm in BF16 silently. Each
    table must name ops of the graph it is applied to: TorchConverter names a .pt op after its first
    output's debugName() and lowers rsqrt to "{name}_sqrt" + "{name}"; the ONNX front end "{output}_{OpType}"."""
    _, _, _, out = converted_with_torchscript(model, tmp_path, monkeypatch)
    script = (out / "compile.sh").read_text()
    for part in read_manifest(out / "onnx")["parts"]:
        name = part["name"]
        source = "embedding" if name == "embedding_cache" else name
        table = [line.split()[0] for line in (out / "qtable" / f"{name}.qtable").read_text().splitlines()[1:]]
        if f'compile_part {name} "../../onnx/{source}.pt ' in script:          # compiled from the .pt
            ops = tpu_mlir_torch_names(out / "onnx" / f"{source}.pt")[2]
        else:
            graph = onnx.load(str(out / "onnx" / f"{name}.onnx"), load_external_data=False).graph
            ops = {f"{n.output[0]}_{n.op_type}" for n in graph.node}
        assert set(table) <= ops, (name, sorted(set(table) - ops))
    lm_head = [line.split()[0] for line in (out / "qtable" / "lm_head.qtable").read_text().splitlines()[1:]]
    assert len(lm_head) == 7 and any(n.endswith("_sqrt") for n in lm_head)   # pow mean add sqrt rsqrt mul mul


def device_matches_host(dev, host, ids, n_prompt, precision):
    """A prompt of n_prompt ids (every position's logits), decode of the rest but the last, then the greedy
    fast path on the last (greedy_head reads lm_head's output tensor on the device): the stand-in
    device equals the host emulation bit for bit in f32/f16, within bf16 rounding in bf16."""
    got = [dev.prefill(ids[:n_prompt], all_logits=True)] + [dev.decode(t)[None] for t in ids[n_prompt:-1]]
    want = [host.prefill(ids[:n_prompt], all_logits=True)] + [host.decode(t)[None] for t in ids[n_prompt:-1]]
    got, want = np.concatenate(got), np.concatenate(want)
    if precision == "bf16":
        assert rel_l2(got, want) < 0.05
    else:
        assert np.array_equal(got, want)
    assert dev.decode_top1(ids[-1]) == int(np.argmax(host.decode(ids[-1])))


def rel_l2(a, b):
    return float((np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)).max())


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


@pytest.mark.parametrize("parts", [[{"group": "embed"}], [{"name": 3}], [{"name": "../../x"}], ["embedding"]])
def test_a_manifest_whose_parts_are_not_plain_names_is_stale(tmp_path, parts):
    """The cache entry's manifest is untrusted: a part without a name, or named by a path, makes it stale (rebuilt),
    never a KeyError or a file opened outside the entry (found by tests/test_fuzz.py's mutations)."""
    import json

    from glmcore_plugins.tpu_bm1684x.export import MANIFEST, is_current, read_manifest
    (tmp_path / MANIFEST).write_text(json.dumps({"key": {"k": 1}, "parts": parts}))
    assert read_manifest(tmp_path) is None and not is_current(tmp_path, {"k": 1})
