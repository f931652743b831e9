"""Loose CLI checks and misleading messages (issue 41, items 11, 12 and 13, and the errors listed at its end):
each is one line naming the problem and the fix."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def glmcore(*args, stdin=None, env=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "glmcore.cli", *map(str, args)], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def one_line_error(r, match):
    assert r.returncode == 2, (r.returncode, r.stderr[-500:])
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1 and match in r.stderr, r.stderr


@pytest.mark.parametrize("args,match", [
    (["cache", "prune", "--older-than", "nan"], "invalid --older-than nan"),
    (["make-model", "--family", "chatglm3", "--out", "{tmp}/m", "--seed", "-1"], "invalid --seed -1"),
    (["make-model", "--family", "chatglm3", "--out", "/proc/glmcore-x"], "cannot write the checkpoint there"),
    (["convert", "--model", "{tiny}", "--backend", "cpu_int4", "--out", "{cache}"], "glmcore's cache directory itself"),
])
def test_loose_cli_values_are_one_line_errors(tmp_path, make_tiny, args, match):
    cache = tmp_path / "cache"
    args = [a.format(tmp=tmp_path, tiny=make_tiny("chatglm3"), cache=cache) for a in args]
    one_line_error(glmcore(*args, env={"GLMCORE_CACHE": str(cache)}), match)


def test_chat_refuses_an_over_long_line_and_goes_on(make_tiny):
    stdin = "x" * ((1 << 20) + 10) + "\nhello\n/quit\n"
    r = glmcore("chat", "--model", make_tiny("chatglm3"), "--backend", "torch", "--max-new-tokens", "2",
                "--threads", "1", stdin=stdin)
    assert r.returncode == 0, r.stderr[-500:]
    assert "more than 1 Mi; it was not sent" in r.stderr
    assert r.stdout.count("assistant> ") == 1          # the next line was answered


def test_core_dependencies_cover_what_the_core_imports():
    """The README's first install ([torch]) must load every checkpoint kind: each third-party module the core
    imports (tokenizers, jinja2 for tokenizer.json checkpoints) is a core dependency; only the optional
    accelerator paths (torch for tensor parallel and synthetic checkpoints) come with their extra."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip().lower().replace("-", "_") for d in deps}
    optional = {"torch", "torch_npu"}
    imported = set()
    for f in (ROOT / "glmcore").rglob("*.py"):
        if f.relative_to(ROOT / "glmcore").parts[0] in ("server", "evaluate"):     # the [server]/[eval] extras
            continue
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            imported |= {m.split(".")[0] for m in mods}
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m != "glmcore"}
    assert third_party - optional <= names, f"imported by the core, missing from dependencies: {third_party - optional - names}"
    assert {"tokenizers", "jinja2"} <= names


def test_eval_ctx_past_the_models_context_says_so(make_tiny, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 200)
    r = glmcore("eval", "--model", make_tiny("chatglm3"), "--backend", "torch", "--perplexity", text, "--ctx", "100000")
    assert r.returncode == 2 and r.stderr.splitlines()[-1] == ("error: --ctx 100000 is longer than the model's "
                                                               "context of 8192 tokens; use --ctx 8192 or less"), r.stderr


def test_a_text_part_with_a_number_says_the_text_must_be_a_string():
    pytest.importorskip("fastapi")
    from glmcore.server.inputs import ApiError, _text
    with pytest.raises(ApiError) as e:
        _text([{"type": "text", "text": 5}], "messages.0.content")
    assert e.value.param == "messages.0.content.0.text" and "not a string" in e.value.message
    assert "not supported" not in e.value.message


def test_every_package_is_installed():
    """A non-editable install ships only the packages pyproject lists: each folder with an __init__.py is one
    (glmcore.engine and glmcore.parsers were missing, so `pip install .` gave a glmcore that could not import)."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, dirs = set(tool["packages"]), tool["package-dir"]
    for name, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            assert ".".join((name, *parts)) in listed, f"{init.parent} is not in pyproject's packages"
