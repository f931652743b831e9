import json
import os
import subprocess
import sys

import pytest

from glmcore.cli import main


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache")
    old = os.environ.get("GLMCORE_CACHE")
    os.environ["GLMCORE_CACHE"] = str(path)
    yield path
    if old is None:
        del os.environ["GLMCORE_CACHE"]
    else:
        os.environ["GLMCORE_CACHE"] = old


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_run_on_demo_model_streams_text_and_timing(cache, capsys):
    rc, out, err = run(capsys, "run", "--backend", "torch", "--prompt", "你好", "--max-new-tokens", "12",
                       "--seed", "3")
    assert rc == 0 and out.strip()
    assert "built-in demo model" in err and "trained on classical Chinese poems" in err
    assert "time to first token" in err and "decode" in err and "tok/s" in err
    assert len(list((cache / "demo").glob("demo-chatglm3-poet-*/config.json"))) == 1
    for special in ("<|user|>", "<|assistant|>", "<|observation|>", "[gMASK]", "sop"):
        assert special not in out


def test_run_same_seed_same_text(cache, capsys):
    args = ("run", "--backend", "torch", "--prompt", "hello", "--max-new-tokens", "16", "--seed", "7",
            "--temperature", "1.0")
    assert run(capsys, *args)[1] == run(capsys, *args)[1]


@pytest.mark.parametrize("argv,match", [
    (["run", "--backend", "nope", "--prompt", "x"], "unknown backend 'nope'"),
    (["run", "--backend", "torch", "--model", "/no/such/dir", "--prompt", "x"], "does not exist"),
    (["run", "--backend", "torch", "--prompt", "x", "--top-p", "1.5"], "invalid top-p"),
    (["run", "--backend", "torch", "--prompt", "x", "--temperature", "-1"], "invalid temperature"),
    (["run", "--backend", "torch", "--prompt", "x", "--presence-penalty", "3"], "invalid presence penalty"),
    (["run", "--backend", "torch", "--prompt", "x", "--frequency-penalty", "-2.5"], "invalid frequency penalty"),
    (["run", "--backend", "torch", "--prompt", "x", "--max-new-tokens", "0"], "max-new-tokens"),
    (["run", "--backend", "torch", "--prompt", "long " * 40, "--ctx", "16"], "exceed the context of 16"),
    (["run", "--backend", "torch", "--prompt", "x", "--precision", "int3"], "no precision 'int3'"),
    (["run", "--backend", "torch", "--prompt", "x", "--opt", "novalue"], "expected KEY=VALUE"),
    (["run", "--backend", "torch", "--prompt", "x", "--ctx", "1"], "invalid --ctx 1"),
    (["run", "--backend", "torch", "--prompt", "x", "--threads", "0"], "invalid --threads 0"),
    (["convert", "--backend", "torch", "--model", "/no/such/dir", "--out", "/tmp/x"], "is not a checkpoint directory"),
])
def test_errors_are_one_line_exit_2(cache, capsys, argv, match):
    rc, out, err = run(capsys, *argv)
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and match in lines[0] and "Traceback" not in err


def test_penalty_flags_reach_the_sampler():
    import argparse
    from glmcore.cli import add_gen_args, sampling
    p = argparse.ArgumentParser()
    add_gen_args(p)
    params = sampling(p.parse_args(["--presence-penalty", "0.5", "--frequency-penalty", "-1.25"]))
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1.25)


def test_window_overflow_keeps_generating(cache, capsys):
    rc, out, err = run(capsys, "run", "--backend", "torch", "--prompt", "hi", "--ctx", "24", "--overflow", "window",
                       "--max-new-tokens", "40", "--temperature", "0")
    assert rc == 0 and "window shifts" in err


def test_backends_lists_every_builtin(capsys):
    rc, out, _ = run(capsys, "backends", "--json")
    rows = {r["backend"]: r for r in json.loads(out)}
    assert rc == 0 and rows["torch"]["ready"]
    assert {"torch", "openvino_amx", "tpu_bm1684x", "ascend_npu", "cpu_int4"} <= set(rows)
    for r in rows.values():
        assert r["ready"] or r["why not"]


def test_make_model_cli(tmp_path, capsys):
    rc, out, _ = run(capsys, "make-model", "--family", "glm4", "--size", "tiny", "--out", str(tmp_path),
                     "--format", "bin", "--shards", "3")
    assert rc == 0 and "random weights" in out
    assert len(list(tmp_path.glob("pytorch_model-0000?-of-00003.bin"))) == 3
    assert (tmp_path / "tokenizer.model").is_file() and (tmp_path / "pytorch_model.bin.index.json").is_file()
    assert sum(f.stat().st_size for f in tmp_path.iterdir()) < 5_000_000


def test_make_model_offers_the_moe_sizes(tmp_path, capsys):
    """--size takes every architecture's sizes (GLM-4.5-Air, GLM-4.6/4.7 355B, GLM-4.7-Flash); a size the family
    lacks is one line naming the family's sizes."""
    rc, _, err = run(capsys, "make-model", "--family", "glm4-moe", "--size", "flash", "--out", str(tmp_path / "x"))
    assert rc == 2 and "unknown size 'flash' for glm4-moe; choose tiny, small, air, 355b" in err


@pytest.mark.slow
def test_make_model_writes_the_flash_shape(tmp_path, capsys):
    rc, out, _ = run(capsys, "make-model", "--family", "glm4-moe-lite", "--size", "flash", "--layers", "1",
                     "--dtype", "f16", "--out", str(tmp_path / "flash"))
    assert rc == 0 and "glm4-moe-lite flash" in out
    assert json.loads((tmp_path / "flash" / "config.json").read_text())["kv_lora_rank"] == 512


def test_convert_without_conversion_step(cache, capsys, make_tiny, tmp_path):
    rc, _, err = run(capsys, "convert", "--backend", "torch", "--model", str(make_tiny("chatglm3")), "--out",
                     str(tmp_path))
    assert rc == 2 and "no conversion step" in err


def test_chat_session_commands(cache, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {
        "name": "get_weather", "description": "weather", "parameters": {"type": "object", "properties": {}}}}]))
    script = f"hello\n/system be brief\nsecond\n/tools {tools}\nthird\n/reset\n/bogus\n/quit\n"
    p = subprocess.run([sys.executable, "-m", "glmcore.cli", "chat", "--backend", "torch", "--max-new-tokens", "8",
                        "--seed", "1"], input=script, capture_output=True, text=True, timeout=300,
                       env={**os.environ})
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("assistant> ") == 3
    for msg in ("system prompt set", "1 tools loaded: get_weather", "conversation cleared", "unknown command /bogus"):
        assert msg in p.stderr


@pytest.mark.parametrize("kw,match", [({"family": "chatglm1"}, "unknown family"), ({"size": "70b"}, "unknown size"),
                                      ({"fmt": "gguf"}, "unknown format")])
def test_make_model_refuses_bad_arguments(tmp_path, kw, match):
    from glmcore.errors import GlmcoreError
    from glmcore.synth import make_model
    args = {"family": "chatglm3", "size": "tiny", "fmt": "safetensors", **kw}
    with pytest.raises(GlmcoreError, match=match):
        make_model(args["family"], args["size"], tmp_path, fmt=args["fmt"])
