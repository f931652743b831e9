"""Property-based fuzzing of every file format glmcore reads (issue 14).

Hypothesis mutates valid files -- safetensors headers and bytes, .bin zips and the tensors their pickle
describes, GGUF files, index/config/tokenizer JSON, tokenizer models, cpu_int4 packed meta.json, OpenVINO IR, ONNX
cache entries -- and each batch of mutated files is loaded by tests/fuzz_worker.py in a process of its
own, so a crash (SIGSEGV) fails the test instead of killing it. Every load must succeed or raise a
GlmcoreError with a one-line message. Packed models and IRs are re-sealed after the mutation: a
stranger's converted model comes with a valid seal, and must still never crash glmcore.

Size: GLMCORE_FUZZ_EXAMPLES examples (default 4) of BATCH files per format; about a minute on 2 cores.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from filekit import bin_bytes, f32

HERE = Path(__file__).resolve().parent
BATCH = 12
FUZZ = settings(max_examples=int(os.environ.get("GLMCORE_FUZZ_EXAMPLES", "4")), deadline=None, database=None,
                suppress_health_check=list(HealthCheck))

# ------------------------------------------------------------------ mutations

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64 + 1])
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=8)
JSON_EDIT = st.tuples(st.integers(0, 10**6), st.sampled_from(["replace", "delete", "wrap"]), JSON_VALUES)
BYTE_EDIT = st.tuples(st.sampled_from(["flip", "truncate", "insert", "zero"]), st.floats(0, 1),
                      st.binary(min_size=1, max_size=16))


def _paths(node, path=()):
    yield path
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield from _paths(v, path + (k,))


def mutate_json(doc, edits):
    for idx, how, value in edits:
        paths = list(_paths(doc))
        path = paths[idx % len(paths)]
        if not path:
            doc = value if how == "replace" else [doc]
            continue
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        if how == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = value if how == "replace" else [parent[path[-1]]]
    return doc


def mutate_bytes(data: bytes, edits) -> bytes:
    b = bytearray(data)
    for how, where, blob in edits:
        at = min(int(where * len(b)), max(len(b) - 1, 0))
        if how == "flip" and b:
            b[at] ^= blob[0] | 1                     # always a change
        elif how == "truncate":
            del b[min(at, len(b) - 1):]
        elif how == "insert":
            b[at:at] = blob
        elif b:
            b[at:at + len(blob)] = bytes(len(b[at:at + len(blob)]))
    return bytes(b)


def mutate_numbers(text: str, edits) -> str:
    """Replace numbers in a text file (an IR's .xml: offsets, sizes, shapes, ids) with drawn integers."""
    for idx, _, value in edits:
        found = list(re.finditer(r"-?\d+", text))
        if found:
            m = found[idx % len(found)]
            v = value if isinstance(value, int) and not isinstance(value, bool) else -1
            text = text[:m.start()] + str(v) + text[m.end():]
    return text


# ------------------------------------------------------------------ the worker

def run_batch(tmp_path: Path, jobs: list[dict]) -> None:
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(HERE / "fuzz_worker.py"), str(tmp_path / "jobs.json")],
                       capture_output=True, text=True, timeout=300, env=env)
    lines = r.stdout.splitlines()
    if r.returncode != 0:
        last = [ln for ln in lines if ln.startswith("start ")]
        i = int(last[-1].split()[1]) if last else 0
        pytest.fail(f"the loader crashed (exit {r.returncode}) on {jobs[i]}:\n{r.stderr[-3000:]}")
    results = [json.loads(ln) for ln in lines if ln.startswith("{")]
    assert len(results) == len(jobs), r.stderr[-3000:]
    for res in results:
        assert "bug" not in res, f"{jobs[res['i']]}: not a GlmcoreError:\n{res['bug']}"
        if "error" in res:
            assert "\n" not in res["message"] and res["message"].strip(), res


def _case_dir(tmp_path: Path, base: Path, i: int, changed: str) -> Path:
    """A copy of base/ where every file but `changed` is a symlink (cheap), `changed` a real copy."""
    d = tmp_path / f"case{i}"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir()
    for f in base.iterdir():
        if f.is_file():
            if f.name == changed:
                shutil.copyfile(f, d / f.name)
            else:
                (d / f.name).symlink_to(f)
    return d


# ------------------------------------------------------------------ safetensors and .bin

@pytest.fixture(scope="module")
def ckpt(make_tiny):
    return make_tiny("chatglm3")


@FUZZ
@given(st.lists(st.one_of(st.tuples(st.just("header"), st.lists(JSON_EDIT, min_size=1, max_size=3)),
                          st.tuples(st.just("bytes"), st.lists(BYTE_EDIT, min_size=1, max_size=3))),
                min_size=BATCH, max_size=BATCH))
def test_safetensors(ckpt, tmp_path_factory, cases):
    tmp = tmp_path_factory.mktemp("st")
    data = next(ckpt.glob("model-00002-*.safetensors")).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    jobs = []
    for i, (kind, edits) in enumerate(cases):
        if kind == "header":
            header = json.dumps(mutate_json(json.loads(data[8:8 + n]), edits), allow_nan=True).encode()
            blob = struct.pack("<Q", len(header)) + header + data[8 + n:]
        else:
            blob = mutate_bytes(data, edits)
        (tmp / f"{i}.safetensors").write_bytes(blob)
        jobs.append({"kind": "safetensors", "path": str(tmp / f"{i}.safetensors")})
    run_batch(tmp, jobs)


INTS = st.integers(-2**40, 2**40) | st.sampled_from([0, 1, -1, 5, 6, 2**31, 2**62])
TENSOR = st.tuples(st.sampled_from(["0", "1", "x"]), INTS, st.lists(INTS, max_size=3), st.lists(INTS, max_size=3))


@FUZZ
@given(st.lists(st.one_of(st.tuples(st.just("tensors"), st.dictionaries(st.sampled_from("abc"), TENSOR,
                                                                        min_size=1, max_size=3)),
                          st.tuples(st.just("bytes"), st.lists(BYTE_EDIT, min_size=1, max_size=3))),
                min_size=BATCH, max_size=BATCH))
def test_bin(make_tiny, tmp_path_factory, cases):
    tmp = tmp_path_factory.mktemp("bin")
    data = sorted(make_tiny("chatglm3", "bin").glob("pytorch_model-*.bin"))[-1].read_bytes()
    jobs = []
    for i, (kind, spec) in enumerate(cases):
        if kind == "tensors":        # the pickle describes views that may lie about their storage
            blob = bin_bytes({k: (key, off, tuple(size), tuple(stride)) for k, (key, off, size, stride) in spec.items()},
                             {"0": f32(6), "1": f32(1)})
        else:
            blob = mutate_bytes(data, spec)
        (tmp / f"{i}.bin").write_bytes(blob)
        jobs.append({"kind": "bin", "path": str(tmp / f"{i}.bin")})
    run_batch(tmp, jobs)


GGUF_FAMILIES = ("glm4", "glm4-0414", "chatglm3",      # each tokenizer the metadata rebuilds
                 "glm4-moe", "glm4-moe-lite")         # and the MoE architectures (glm4moe, deepseek2)


@pytest.fixture(scope="module")
def gguf_files(make_tiny, tmp_path_factory):
    from gguf_kit import write_gguf
    tmp = tmp_path_factory.mktemp("gguf")
    return {f: write_gguf(make_tiny(f), tmp / f"{f}.gguf", "Q4_0") for f in GGUF_FAMILIES}


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(GGUF_FAMILIES), st.booleans(), st.lists(BYTE_EDIT, min_size=1, max_size=3)),
                min_size=BATCH, max_size=BATCH))
def test_gguf(gguf_files, tmp_path_factory, cases):
    """GGUF files (issue 40): byte edits anywhere, or only in the header (counts, lengths, types, dims, offsets,
    the vocabulary and merges)."""
    tmp = tmp_path_factory.mktemp("gguf")
    jobs = []
    for i, (family, header_only, edits) in enumerate(cases):
        data = gguf_files[family].read_bytes()
        header = _gguf_header_size(gguf_files[family])
        blob = mutate_bytes(data[:header], edits) + data[header:] if header_only else mutate_bytes(data, edits)
        (tmp / f"{i}.gguf").write_bytes(blob)
        jobs.append({"kind": "gguf", "path": str(tmp / f"{i}.gguf"), "cache": str(tmp / "cache")})
    run_batch(tmp, jobs)


@functools.lru_cache(maxsize=None)
def _gguf_header_size(path: Path) -> int:
    """Where the pristine file's tensor data starts (parsed once per file: gguf-py reads the whole vocabulary)."""
    from gguf import GGUFReader
    return GGUFReader(path).data_offset


# ------------------------------------------------------------------ checkpoint JSON and tokenizer files

CKPT_FILES = {  # family, file, how it is mutated
    "config": ("chatglm3", "config.json", "json"),
    "index": ("chatglm3", "model.safetensors.index.json", "json"),
    "moe_config": ("glm4-moe", "config.json", "json"),
    "latent_config": ("glm4-moe-lite", "config.json", "json"),
    "tokenizer_config": ("glm4", "tokenizer_config.json", "json"),
    "sentencepiece": ("chatglm3", "tokenizer.model", "bytes"),
    "tiktoken": ("glm4", "tokenizer.model", "bytes"),
}


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(sorted(CKPT_FILES)), st.lists(JSON_EDIT, min_size=1, max_size=3),
                          st.lists(BYTE_EDIT, min_size=1, max_size=3)), min_size=BATCH, max_size=BATCH))
def test_checkpoint_files(make_tiny, tmp_path_factory, cases):
    tmp = tmp_path_factory.mktemp("ckpt")
    jobs = []
    for i, (which, json_edits, byte_edits) in enumerate(cases):
        family, name, how = CKPT_FILES[which]
        d = _case_dir(tmp, make_tiny(family), i, name)
        f = d / name
        if how == "json":
            f.write_text(json.dumps(mutate_json(json.loads(f.read_text()), json_edits), allow_nan=True))
        else:
            f.write_bytes(mutate_bytes(f.read_bytes(), byte_edits))
        jobs.append({"kind": "checkpoint", "path": str(d)})
    run_batch(tmp, jobs)


# ------------------------------------------------------------------ converted models

def _convert(backend, model, out, *argv):
    r = subprocess.run([sys.executable, "-m", "glmcore.cli", "convert", "--backend", backend, "--model", str(model),
                        "--out", str(out), "--threads", "1", *argv], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.skip(f"{backend} cannot convert here: {r.stderr.strip().splitlines()[-1]}")
    return out


@pytest.fixture(scope="module")
def packed(ckpt, make_tiny, tmp_path_factory):
    """Packed models and their checkpoints: a dense one, and GLM-4.7-Flash's layout (experts, the latent
    attention's matrices, the NextN layer)."""
    models = {"dense": ckpt, "latent-moe": make_tiny("glm4-moe-lite")}
    return {k: (m, _convert("cpu_int4", m, tmp_path_factory.mktemp("packed") / k)) for k, m in models.items()}


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(["dense", "latent-moe"]), st.lists(JSON_EDIT, min_size=1, max_size=3)),
                min_size=BATCH, max_size=BATCH))
def test_cpu_int4_packed_meta(packed, tmp_path_factory, cases):
    from glmcore.cache import seal, source_of
    tmp = tmp_path_factory.mktemp("meta")
    jobs = []
    for i, (which, edits) in enumerate(cases):
        model, base = packed[which]
        d = _case_dir(tmp, base, i, "meta.json")
        (d / "meta.json").write_text(json.dumps(mutate_json(json.loads((d / "meta.json").read_text()), edits)))
        (d / "glmcore-entry.json").unlink()
        seal(d, source_of(base))                     # a forged seal: only meta.json's own checks remain
        jobs.append({"kind": "packed", "path": str(d), "model": str(model)})
    run_batch(tmp, jobs)


@pytest.fixture(scope="module")
def ir(ckpt, tmp_path_factory):
    pytest.importorskip("openvino")
    return _convert("openvino_amx", ckpt, tmp_path_factory.mktemp("ir") / "ir", "--weights", "int8")


@FUZZ
@given(st.lists(st.one_of(st.tuples(st.just("xml"), st.lists(JSON_EDIT, min_size=1, max_size=2)),
                          st.tuples(st.just("bin"), st.lists(BYTE_EDIT, min_size=1, max_size=2))),
                min_size=BATCH // 2, max_size=BATCH // 2))
def test_openvino_ir(ckpt, ir, tmp_path_factory, cases):
    from glmcore.cache import seal, source_of
    tmp = tmp_path_factory.mktemp("irf")
    jobs = []
    for i, (kind, edits) in enumerate(cases):
        name = "openvino_model.xml" if kind == "xml" else "openvino_model.bin"
        d = _case_dir(tmp, ir, i, name)
        f = d / name
        if kind == "xml":
            f.write_text(mutate_numbers(f.read_text(), edits))
        else:
            f.write_bytes(mutate_bytes(f.read_bytes(), edits))
        (d / "glmcore-entry.json").unlink()
        seal(d, source_of(ir))
        jobs.append({"kind": "ir", "path": str(d), "model": str(ckpt)})
    run_batch(tmp, jobs)


@pytest.fixture(scope="module")
def onnx_entry(ckpt, tmp_path_factory):
    pytest.importorskip("onnxruntime")
    from glmcore.backend import LoadOptions, registry
    from glmcore.config import ModelConfig
    from glmcore.weights import load_weights
    if not registry().probe("tpu_bm1684x").ready:
        pytest.skip("tpu_bm1684x host emulation not ready")
    cache = tmp_path_factory.mktemp("onnxcache")
    cfg = ModelConfig.from_dir(ckpt)
    registry().get("tpu_bm1684x").load(cfg, load_weights(ckpt, cfg),
                                       LoadOptions("f32", "f32", 16, threads=1, cache_dir=cache)).close()
    return next((cache / "tpu_bm1684x").iterdir())


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 100), st.lists(BYTE_EDIT, min_size=1, max_size=2)),
                min_size=BATCH, max_size=BATCH))
def test_onnx_cache_entry(onnx_entry, tmp_path_factory, cases):
    tmp = tmp_path_factory.mktemp("onnxf")
    files = sorted(f.name for f in onnx_entry.iterdir() if f.is_file() and f.name != "glmcore-entry.json")
    jobs = []
    for i, (which, edits) in enumerate(cases):
        name = files[which % len(files)]
        d = _case_dir(tmp, onnx_entry, i, name)
        before = (d / name).read_bytes()
        after = mutate_bytes(before, edits)
        if after == before:
            after = before + b"\0"
        (d / name).write_bytes(after)
        jobs.append({"kind": "onnx_entry", "path": str(d)})
    run_batch(tmp, jobs)
