"""Hostile and broken input: every reader refuses it with the project's one-line error (issue 14).
The fuzz tests (test_fuzz.py) mutate valid files at random; these pin each class seen in the issue."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from filekit import bin_bytes, f32, safetensors_bytes, write
from glmcore.config import ModelConfig
from glmcore.errors import CheckpointError, ConfigError, GlmcoreError, TokenizerError
from glmcore.weights import load_weights, read_safetensors, read_torch_zip

ROOT = Path(__file__).resolve().parents[1]


def _st(header, data=b""):
    return safetensors_bytes(header, data)


def T(dtype="F32", shape=(2,), offs=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offs)}


@pytest.mark.parametrize("header,data,match", [
    ({"a": T(offs=(-8, 0))}, f32(2), "corrupt data for a"),                  # header bytes read as weights
    ({"a": T(), "b": T(offs=(4, 12))}, f32(3), "overlap"),
    (["a"], b"", "not a JSON object"),
    ({"a": T(shape=(2.0,))}, f32(2), "invalid shape"),
    ({"a": T(shape=(-1, -1), offs=(0, 4))}, f32(1), "invalid shape"),
    ({"a": T(shape=(1 << 31, 1 << 31, 1 << 31), offs=(0, 8))}, f32(2), "invalid shape|corrupt data"),
    ({"a": T(shape=(2**40 - 1, 2**40 - 1, 2**40 - 1, 2**40 - 1), offs=(0, 0))}, b"", "corrupt data"),
    ({"a": T(dtype="F8")}, f32(2), "corrupt header entry"),
    ({"a": T(offs=(0, "8"))}, f32(2), "corrupt data"),
    ({"a": "x"}, b"", "corrupt header entry"),
    (b'{"a": 1, "a": 2}', b"", "corrupt header"),
    (b"[" * 100000 + b"]" * 100000, b"", "corrupt header"),
])
def test_safetensors_header_is_validated(tmp_path, header, data, match):
    p = write(tmp_path / "x.safetensors", _st(header, data))
    with pytest.raises(CheckpointError, match=match):
        read_safetensors(p)


@pytest.mark.parametrize("tensor,match", [
    (("0", 0, (2, 3), (3000000, 1)), "reaches element"),     # a stride beyond the storage: SIGSEGV before
    (("0", 0, (2, 3), (-3, 1)), "invalid shape"),            # negative stride: read before the storage
    (("0", 5, (2, 3), (3, 1)), "reaches element"),           # offset past the storage
    (("0", 7, (0,), (1,)), "reaches element"),
    (("9", 0, (2,), (1,)), "storage '9' .* missing"),
    (("0", 0, (2, 3), (3,)), "invalid offset or stride"),
    (("0", -1, (2,), (1,)), "invalid offset"),
    (("0", 0, (2.5,), (1,)), "invalid shape"),
])
def test_bin_tensor_stays_inside_its_storage(tmp_path, tensor, match):
    p = write(tmp_path / "x.bin", bin_bytes({"w": tensor}, {"0": f32(6)}))
    with pytest.raises(CheckpointError, match=match):
        read_torch_zip(p)


def test_bin_valid_views_still_load(tmp_path):
    p = write(tmp_path / "x.bin", bin_bytes({"w": ("0", 1, (2, 2), (3, 1)), "e": ("0", 6, (0,), (1,))},
                                           {"0": f32(6)}))
    out = read_torch_zip(p)
    assert out["w"].tolist() == [[1, 2], [4, 5]] and out["e"].shape == (0,)


def test_a_crash_in_a_reader_is_caught_in_a_subprocess(tmp_path):
    """The strided view that crashed the process before (SIGSEGV) now fails with one line."""
    p = write(tmp_path / "x.bin", bin_bytes({"w": ("0", 0, (4, 4), (1 << 33, 1))}, {"0": f32(6)}))
    code = f"from glmcore.weights import read_torch_zip; import numpy; print(numpy.asarray(read_torch_zip({str(p)!r})['w']).sum())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 1 and "CheckpointError" in r.stderr and "reaches element" in r.stderr


@pytest.fixture
def ckpt(make_tiny, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(make_tiny("chatglm3"), d)
    return d


@pytest.mark.parametrize("index,match", [
    (["weight_map"], "not a valid index"),
    ({"weight_map": ["a"]}, "weight_map is not an object"),
    ({"weight_map": {"a": 3}}, "weight_map is not an object"),
    ({"weight_map": {"a": "../../etc/model.safetensors"}}, "outside the model directory"),
    ({"weight_map": {"a": "/etc/model.safetensors"}}, "outside the model directory"),
    ({"weight_map": {"a": "sub/../../x.safetensors"}}, "outside the model directory"),
])
def test_index_is_validated_and_stays_in_the_directory(ckpt, index, match):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=match):
        load_weights(ckpt, ModelConfig.from_dir(ckpt))


def test_integer_weights_are_refused(tmp_path, make_tiny):
    import numpy as np
    from glmcore.weights import read_safetensors as rs, write_safetensors
    src = make_tiny("chatglm3")
    cfg = ModelConfig.from_dir(src)
    d = tmp_path / "m"
    shutil.copytree(src, d)
    tensors = {}
    for f in sorted(d.glob("model-*.safetensors")):
        tensors.update({k: np.asarray(v) for k, v in rs(f).items()})
        f.unlink()
    (d / "model.safetensors.index.json").unlink()
    name = "transformer.encoder.final_layernorm.weight"
    tensors[name] = tensors[name].astype(np.int32)
    write_safetensors(d / "model.safetensors", tensors)
    with pytest.raises(CheckpointError, match="stored as int32"):
        load_weights(d, cfg)


@pytest.mark.parametrize("mutate,match", [
    (lambda c: [c], "holds a JSON list"),
    (lambda c: {**c, "hidden_size": "64"}, "invalid value|hidden_size"),
    (lambda c: {**c, "num_attention_heads": 0}, "invalid value|num_heads"),
    (lambda c: {**c, "num_layers": 1.5}, "num_layers"),
    (lambda c: {**c, "num_layers": True}, "num_layers"),
    (lambda c: {**c, "padded_vocab_size": 1 << 40}, "vocab_size"),
    (lambda c: {**c, "layernorm_epsilon": "x"}, "norm_eps"),
    (lambda c: {**c, "rope_ratio": [1]}, "invalid value"),
    (lambda c: {**c, "multi_query_group_num": 3}, "KV groups"),
    (lambda c: {**c, "add_qkv_bias": "yes"}, "qkv_bias"),
])
def test_config_values_are_validated(ckpt, mutate, match):
    raw = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(mutate(raw)))
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dir(ckpt)


# ------------------------------------------------------------------ tokenizer files, through the CLI

def _cli(*argv, env_cache=None):
    import os
    env = {**os.environ, "GLMCORE_CACHE": str(env_cache)} if env_cache else None
    return subprocess.run([sys.executable, "-m", "glmcore.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=300)


TOKENIZER_BREAKS = {
    "missing": lambda d: (d / "tokenizer.model").unlink(),
    "empty": lambda d: (d / "tokenizer.model").write_bytes(b""),
    "garbage": lambda d: (d / "tokenizer.model").write_bytes(b"\x0a\x05hello" * 100),
    "wrong family": lambda d: shutil.copyfile(ROOT / "glmcore" / "data" / "glm4_ranks.tiktoken", d / "tokenizer.model"),
    "config not json": lambda d: (d / "tokenizer_config.json").write_text("{"),
    "config a list": lambda d: (d / "tokenizer_config.json").write_text("[]"),
    "config bad added tokens": lambda d: (d / "tokenizer_config.json").write_text('{"added_tokens_decoder": [1]}'),
    "config bad class": lambda d: (d / "tokenizer_config.json").write_text('{"tokenizer_class": 5}'),
}


@pytest.mark.parametrize("case", list(TOKENIZER_BREAKS))
def test_tokenizer_errors_are_one_line_exit_2(ckpt, tmp_path, case):
    TOKENIZER_BREAKS[case](ckpt)
    r = _cli("run", "--backend", "torch", "--model", str(ckpt), "--prompt", "hi", "--max-new-tokens", "2",
             env_cache=tmp_path / "cache")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_tokenizer_larger_than_the_model_vocabulary(ckpt, make_tiny, tmp_path):
    shutil.copyfile(make_tiny("glm4") / "tokenizer.model", ckpt / "tokenizer.model")   # 2048+ ids, 1024 rows
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["_name_or_path"] = "x"
    (ckpt / "tokenizer_config.json").unlink()
    r = _cli("run", "--backend", "torch", "--model", str(ckpt), "--prompt", "hi", env_cache=tmp_path / "c")
    assert r.returncode == 2 and "embedding rows" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_tokenizer_error_is_a_glmcore_error():
    assert issubclass(TokenizerError, GlmcoreError) and issubclass(TokenizerError, ValueError)


# ------------------------------------------------------------------ the CLI's one error path

def test_a_bug_prints_the_traceback_and_asks_for_a_report(monkeypatch, capsys):
    import glmcore.cli as cli

    def boom(a):
        raise RuntimeError("kaboom")
    monkeypatch.setattr(cli, "cmd_backends", boom)
    assert cli.main(["backends"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: kaboom" in err and "please report" in err


def test_bad_input_is_one_line_without_traceback(monkeypatch, capsys):
    import glmcore.cli as cli
    monkeypatch.setattr(cli, "cmd_backends", lambda a: (_ for _ in ()).throw(ConfigError("bad thing; fix it")))
    assert cli.main(["backends"]) == 2
    assert capsys.readouterr().err == "error: bad thing; fix it\n"


# ------------------------------------------------------------------ options are never silently ignored

@pytest.mark.parametrize("backend,argv,match", [
    ("torch", ["--opt", "group_size=64"], "backend 'torch': unknown option 'group_size'; it takes no --opt"),
    ("openvino_amx", ["--opt", "grup_size=64"], "unknown option 'grup_size'; known: ir, group_size"),
    ("tpu_bm1684x", ["--opt", "seqlen=64"], "unknown option 'seqlen'"),
    ("ascend_npu", ["--opt", "bucket=16"], "unknown option 'bucket'"),
    ("cpu_int4", ["--opt", "grup_size=64"], "unknown option 'grup_size'"),
    ("tpu_bm1684x", ["--opt", "bmodel=/no/such.bmodel"], "no such file"),
    ("tpu_bm1684x", ["--weights", "int8"], "no weight format 'int8'"),
    ("", [], "--backend is empty"),
    ("torch", ["--threads", "10000"], "invalid --threads 10000"),
])
def test_bad_options_are_refused(backend, argv, match, tmp_path, make_tiny):
    from glmcore.backend import registry
    if backend and not registry().probe(backend).ready:
        pytest.skip(f"{backend} not ready here: {registry().probe(backend).reason}")
    r = _cli("run", "--backend", backend, "--model", str(make_tiny("chatglm3")), "--prompt", "hi",
             "--max-new-tokens", "1", "--threads", "1", *argv, env_cache=tmp_path / "c")
    assert r.returncode == 2 and match in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_help_shows_defaults_and_convert_needs_a_model():
    r = _cli("run", "--help")
    assert "(default: 256)" in r.stdout and "(default: error)" in r.stdout
    # sampling left out is the checkpoint's recommendation, else glmcore's own value
    assert "generation_config.json, else 0.8)" in " ".join(r.stdout.split())
    r = _cli("convert", "--help")
    assert "demo model" not in r.stdout and "to convert (required)" in r.stdout


# ------------------------------------------------------------------ outputs: never destroy a user's files

def _tree(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_make_model_never_touches_an_existing_checkpoint(make_tiny, tmp_path):
    d = tmp_path / "real"
    shutil.copytree(make_tiny("glm4"), d)
    (d / "model-00009-of-00009.safetensors").write_bytes(b"a shard make-model did not write")
    before = _tree(d)
    r = _cli("make-model", "--family", "chatglm3", "--out", str(d))
    assert r.returncode == 2 and "is not empty" in r.stderr and _tree(d) == before


@pytest.mark.parametrize("argv,match", [
    (["--shards", "0"], "invalid --shards 0"),
    (["--shards", "1000"], "only"),
    (["--out-is-file"], "is a file"),
])
def test_make_model_bad_arguments_are_one_line(tmp_path, argv, match):
    out = tmp_path / "out"
    if argv == ["--out-is-file"]:
        out.write_text("mine")
        argv = []
    r = _cli("make-model", "--family", "chatglm3", "--out", str(out), *argv)
    assert r.returncode == 2 and match in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.is_dir()


def test_make_model_into_an_empty_directory_works(tmp_path):
    (tmp_path / "m").mkdir()
    r = _cli("make-model", "--family", "chatglm3", "--out", str(tmp_path / "m"))
    assert r.returncode == 0 and (tmp_path / "m" / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]                  # no temporary left beside it


def test_convert_refuses_a_non_empty_out_and_a_failed_convert_leaves_nothing(make_tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = _cli("convert", "--backend", "cpu_int4", "--model", str(make_tiny("chatglm3")), "--out", str(out))
    assert r.returncode == 2 and "is not empty" in r.stderr and _tree(out) == {"keep.txt": b"mine"}
    r = _cli("convert", "--backend", "cpu_int4", "--model", str(make_tiny("chatglm3")), "--out",
             str(tmp_path / "new"), "--opt", "scale_dtype=f8")            # fails after --out is made
    assert r.returncode == 2 and "scale_dtype" in r.stderr and not (tmp_path / "new").exists()


def test_conformance_out_file_is_refused_before_running(tmp_path):
    (tmp_path / "f").write_text("x")
    r = _cli("conformance", "--backend", "torch", "--out", str(tmp_path / "f"))
    assert r.returncode == 2 and r.stderr.startswith("error: --out") and "is a file" in r.stderr


# ------------------------------------------------------------------ converted models: provenance, meta

@pytest.fixture(scope="module")
def packed(make_tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "int4"
    r = _cli("convert", "--backend", "cpu_int4", "--model", str(make_tiny("chatglm3")), "--out", str(out))
    assert r.returncode == 0, r.stderr
    return out


def test_packed_model_from_other_weights_is_refused(packed, make_tiny, tmp_path):
    other = tmp_path / "other"
    from glmcore.synth import make_model
    make_model("chatglm3", "tiny", other, seed=5)                        # same config, other weights
    args = ("run", "--backend", "cpu_int4", "--prompt", "hi", "--max-new-tokens", "2", "--threads", "1",
            "--opt", f"packed={packed}")
    assert _cli(*args, "--model", str(make_tiny("chatglm3")), env_cache=tmp_path / "c").returncode == 0
    r = _cli(*args, "--model", str(other), env_cache=tmp_path / "c")
    assert r.returncode == 2 and "converted from a different model" in r.stderr, r.stderr


def _meta_cases():
    def offset_past_file(m):
        m["tensors"]["layers.0.qkv.weight"]["offset"] = 1 << 40

    def norm_past_end(m):
        m["tensors"]["final_norm.weight"]["offset"] = m["stats"]["file_bytes"] - 8

    def negative(m):
        m["tensors"]["lm_head.weight"]["offset"] = -64

    def size(m):
        m["tensors"]["embed.q"]["nbytes"] *= 2

    def options(m):
        m["options"]["group_size"] = 48

    def cfg(m):
        m["config"]["hidden_size"] = "64"

    def stats(m):
        m["stats"]["file_bytes"] += 64

    def int8_norm(m):           # per-tensor bits only for layer matrices
        m["options"]["int8_matrices"] = ["final_norm.weight"]

    def int8_table(m):          # a matrix made int8 that the tensor table (and weights.bin) holds as int4
        m["options"]["int8_matrices"] = ["layers.0.qkv.weight"]

    def int8_kind(m):
        m["options"]["int8_matrices"] = "layers.0.qkv.weight"

    return [offset_past_file, norm_past_end, negative, size, options, cfg, stats, int8_norm, int8_table, int8_kind]


@pytest.mark.parametrize("mutate", _meta_cases(), ids=lambda f: f.__name__)
def test_packed_meta_is_validated_before_the_kernels_see_it(packed, make_tiny, tmp_path, mutate):
    from glmcore_plugins.cpu_int4.quant import read_packed
    d = tmp_path / "p"
    shutil.copytree(packed, d)
    meta = json.loads((d / "meta.json").read_text())
    mutate(meta)
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(GlmcoreError, match="meta.json"):
        read_packed(d, ModelConfig.from_dir(make_tiny("chatglm3")))


def test_ascend_first_compile_says_so(capsys):
    """The first call of a shape compiles a graph (about a minute on 2 cores): the user is told."""
    pytest.importorskip("torch")
    import types
    import torch
    from glmcore_plugins.ascend_npu import session as asc
    runner = types.SimpleNamespace(device="cpu", ops=types.SimpleNamespace(seq_lens=False), on_npu=False, tables=None,
                                   mode="graph", k_cache=None, v_cache=None, compiles=0, compile_seconds=0.0,
                                   _step=lambda *a: "out")
    ids = torch.zeros((1, 16), dtype=torch.long)
    assert asc.StepRunner.call(runner, ids, [0], [0], [15]) == "out"
    assert "ascend_npu: compiling the graph for 1x16 tokens" in capsys.readouterr().err
    asc.StepRunner.call(runner, ids, [0], [0], [15])
    assert capsys.readouterr().err == ""                       # once per shape


def test_interrupted_convert_leaves_no_part_file(make_tiny, tmp_path, monkeypatch, capsys):
    from glmcore.cli import main
    from glmcore_plugins.cpu_int4 import quant

    def interrupted(cfg, weights, o, out, progress=None, fingerprint="", codes=None):
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "weights.bin.part").write_bytes(b"\0" * 4096)
        raise KeyboardInterrupt
    monkeypatch.setattr(quant, "write_packed", interrupted)
    out = tmp_path / "int4"
    assert main(["convert", "--backend", "cpu_int4", "--model", str(make_tiny("chatglm3")), "--out", str(out)]) == 130
    assert not out.exists()


def test_missing_ir_directory_is_named(make_tiny, tmp_path):
    pytest.importorskip("openvino")
    r = _cli("run", "--backend", "openvino_amx", "--model", str(make_tiny("chatglm3")), "--prompt", "hi",
             "--opt", "ir=/nonexistent/ir", env_cache=tmp_path / "c")
    assert r.returncode == 2 and "/nonexistent/ir: no such directory" in r.stderr, r.stderr


@pytest.mark.parametrize("text,match", [("[1, 2", "unreadable"), ("[]", "not a glmcore IR manifest"),
                                        ("\udcff", "unreadable")])
def test_a_damaged_ir_manifest_is_one_line_error(tmp_path, make_tiny, text, match):
    pytest.importorskip("openvino")
    from glmcore.backend import LoadOptions
    from glmcore.config import ModelConfig
    from glmcore.errors import BackendError
    from glmcore_plugins.openvino_amx.session import IR_NAME, MANIFEST, checked_ir
    (tmp_path / IR_NAME).write_text("<net/>")
    (tmp_path / MANIFEST).write_bytes(text.encode("utf-8", "surrogateescape"))
    cfg = ModelConfig.from_dir(make_tiny("chatglm3"))
    with pytest.raises(BackendError, match=match):
        checked_ir(tmp_path, cfg, LoadOptions("f32", "int8"))


@pytest.mark.parametrize("text", ["[]", '{"parts": 5}', "{", '"x"'])
def test_a_damaged_onnx_manifest_means_rebuild(tmp_path, text):
    from glmcore_plugins.tpu_bm1684x.export import MANIFEST, is_current, read_manifest
    (tmp_path / MANIFEST).write_text(text)
    assert read_manifest(tmp_path) is None and not is_current(tmp_path, {"k": 1})


# ------------------------------------------------------------------ issue 27: bytes, special files, the cache

def _one_line_error(r, match):
    err = r.stderr if isinstance(r.stderr, str) else r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2, err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and match in err, err


def test_argv_bytes_that_are_not_utf8_are_one_line(ckpt):
    # Python hands undecodable argv bytes over as lone surrogates; SentencePiece raised on them
    r = subprocess.run([sys.executable, "-m", "glmcore.cli", "run", "--backend", "torch", "--model", str(ckpt),
                        "--prompt", b"a\xffb", "--max-new-tokens", "2"], capture_output=True, timeout=300)
    _one_line_error(r, "--prompt is not valid UTF-8 text (byte 0xff")
    import os
    env = {**os.environ, "GLMCORE_API_KEY": os.fsdecode(b"k\xff")}      # compared as UTF-8 on every request
    r = subprocess.run([sys.executable, "-m", "glmcore.cli", "serve", "--backend", "torch", "--model", str(ckpt),
                        "--port", "0"], capture_output=True, timeout=300, env=env)
    _one_line_error(r, "$GLMCORE_API_KEY is not valid UTF-8 text (byte 0xff")


@pytest.mark.parametrize("kind,match", [("/dev/zero", "larger than"), ("fifo", "pipe"), ("dir", "is a directory"),
                                        ("latin1", "not UTF-8 text (byte 0xff")])
def test_prompts_files_are_read_bounded_and_checked(ckpt, tmp_path, kind, match):
    import os
    path = {"/dev/zero": "/dev/zero", "fifo": tmp_path / "fifo", "dir": tmp_path, "latin1": tmp_path / "p.txt"}[kind]
    if kind == "fifo":
        os.mkfifo(path)                    # no writer: opening it would block forever
    if kind == "latin1":
        path.write_bytes(b"caf\xff\n")
    r = _cli("run", "--backend", "torch", "--model", str(ckpt), "--prompts", str(path), "--max-new-tokens", "2")
    _one_line_error(r, match)


def _chat_bytes(model, script: bytes, *extra):
    return subprocess.run([sys.executable, "-m", "glmcore.cli", "chat", "--backend", "torch", "--model", str(model),
                           "--max-new-tokens", "2", "--threads", "1", *extra], input=script, capture_output=True,
                          timeout=300)


def test_chat_survives_bad_bytes_endless_tool_files_and_a_bare_tools(ckpt):
    r = _chat_bytes(ckpt, b"a\xffb\n/tools /dev/zero\n/tools\n/tools none\nhello\n/quit\n")
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 0 and "Traceback" not in err, err
    assert "error: the line is not valid UTF-8 text (byte 0xff" in err
    assert "error: tools from '/dev/zero' is larger than" in err
    assert "usage: /tools FILE.json" in err and "Is a directory" not in err
    assert "(tools cleared" in err and r.stdout.count(b"assistant> ") == 1


def test_reset_clears_a_system_prompt_that_alone_overflows(ckpt):
    r = _chat_bytes(ckpt, b"hello\n/reset\nhello\n/quit\n", "--ctx", "64", "--system", "long " * 200)
    err = r.stderr.decode()
    assert r.returncode == 0 and "Traceback" not in err, err
    assert "alone fill the context: /reset clears them" in err
    assert "system prompt and tools cleared" in err
    assert err.count("error:") == 1, err                      # the turn after /reset fits


@pytest.mark.parametrize("family", ["chatglm3", "glm4"])
def test_a_fifo_tokenizer_never_hangs_the_load(make_tiny, tmp_path, family):
    import os
    d = tmp_path / "m"
    shutil.copytree(make_tiny(family), d)
    (d / "tokenizer.model").unlink()
    os.mkfifo(d / "tokenizer.model")
    r = _cli("run", "--backend", "torch", "--model", str(d), "--prompt", "hi", "--max-new-tokens", "2")
    _one_line_error(r, "tokenizer.model")


def test_out_symlinks(make_tiny, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    (tmp_path / "dangling").symlink_to(tmp_path / "missing")
    r = _cli("make-model", "--family", "chatglm3", "--out", str(tmp_path / "link"))
    assert r.returncode == 0 and (tmp_path / "empty" / "config.json").is_file(), r.stderr
    assert (tmp_path / "link").is_symlink()
    _one_line_error(_cli("make-model", "--family", "chatglm3", "--out", str(tmp_path / "dangling")), "does not exist")
    _one_line_error(_cli("convert", "--backend", "cpu_int4", "--model", str(make_tiny("chatglm3")), "--out",
                         str(tmp_path / "dangling")), "does not exist")
    assert not (tmp_path / "missing").exists()


def test_cache_prune_removes_only_what_glmcore_wrote(tmp_path, capsys, monkeypatch):
    import os

    from glmcore.cache import ENTRY, build_once
    from glmcore.cli import main
    monkeypatch.setenv("GLMCORE_CACHE", str(tmp_path))
    mine = {"photos/2019/a.jpg": b"jpeg", ".git/config": b"[core]", ".hidden-thing/x": b"x", "notes/todo.txt": b"1"}
    for name, data in mine.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    for d in tmp_path.rglob("*"):
        os.utime(d, (0, 0))                                    # the user's files: untouched for decades
    build_once(tmp_path / "models" / "x", lambda d: (d / "w").write_bytes(b"0"), lambda d: (d / "w").is_file())
    os.utime(tmp_path / "models" / "x" / ENTRY, (0, 0))
    leftover = tmp_path / "models" / ".x-abcdefgh.part"
    leftover.mkdir()
    os.utime(leftover, (0, 0))
    assert main(["cache", "prune", "--older-than", "0"]) == 0
    assert not (tmp_path / "models" / "x").exists() and not leftover.exists()
    assert {n: (tmp_path / n).read_bytes() for n in mine} == mine
    assert main(["cache", "remove", "all"]) == 0 and (tmp_path / "photos/2019/a.jpg").is_file()
    assert main(["cache", "remove", "notes"]) == 2 and (tmp_path / "notes/todo.txt").is_file()
    assert "no glmcore seal" in capsys.readouterr().err


def test_run_slots_zero_is_an_error_as_in_serve(ckpt, tmp_path):
    (tmp_path / "p.txt").write_text("a\nb\n")
    r = _cli("run", "--backend", "torch", "--model", str(ckpt), "--prompts", str(tmp_path / "p.txt"), "--slots", "0")
    _one_line_error(r, "invalid --slots 0")


def test_eval_perplexity_file_is_read_bounded(ckpt):
    r = _cli("eval", "--backend", "torch", "--model", str(ckpt), "--perplexity", "/dev/zero", "--ctx", "32")
    _one_line_error(r, "larger than 256 MiB")


@pytest.mark.parametrize("name,content", [
    ("config.json", "/dev/zero"),                                        # a symlink to an endless device
    ("config.json", "[" * 200000 + "]" * 200000),                       # nested past any recursion limit
    ("model.safetensors.index.json", "[" * 200000 + "]" * 200000),
], ids=["config-dev-zero", "config-deep", "index-deep"])
def test_model_directory_json_is_never_an_endless_or_recursive_read(ckpt, name, content):
    import os
    (ckpt / name).unlink(missing_ok=True)
    if content == "/dev/zero":
        os.symlink(content, ckpt / name)
    else:
        (ckpt / name).write_text(content)
    r = _cli("run", "--backend", "torch", "--model", str(ckpt), "--prompt", "hi", "--max-new-tokens", "2")
    _one_line_error(r, name)


def test_chat_from_an_endless_stdin_is_one_line(ckpt):
    with open("/dev/zero", "rb") as zero:
        r = subprocess.run([sys.executable, "-m", "glmcore.cli", "chat", "--backend", "torch", "--model", str(ckpt),
                            "--threads", "1"], stdin=zero, capture_output=True, timeout=300)
    err = r.stderr.decode()
    assert r.returncode == 2 and "error: a line of input is longer than" in err and "Traceback" not in err, err


def test_many_prompts_do_not_allocate_a_slot_each(ckpt, tmp_path):
    # every slot holds a whole context of KV cache: 100,000 prompt lines once asked for 100,000 slots
    (tmp_path / "p.txt").write_text("hi\n" * 100)
    r = _cli("run", "--backend", "torch", "--model", str(ckpt), "--prompts", str(tmp_path / "p.txt"),
             "--max-new-tokens", "1", "--ctx", "32", "--threads", "1")
    assert r.returncode == 0 and "100 prompts on 64 slots" in r.stderr, r.stderr
