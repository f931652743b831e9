"""Grammars bounded by what llguidance's compiler can take (issue 41, items 1, 2, 8 and 9): flat rule and $ref
chains that overflowed its stack (SIGSEGV), long choice lists that held a thread for 20 s, repetitions too large
for its lexer, a lone surrogate in a key -- each a one-line 400 naming the field and the limit, at once, with
the server answering /health throughout; and the compile itself on a large-stack worker, so what the bounds
cannot see does not take the process down."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

pytest.importorskip("llguidance")

from glmcore.structured import (MAX_CHAIN, MAX_CHOICES, MAX_GRAMMAR_BYTES, MAX_REPEAT, Grammar,  # noqa: E402
                                GrammarError, repeat_total)


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def object_chain(n: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


@pytest.mark.parametrize("make,match", [
    (lambda: Grammar.lark(lark_chain(3000)), f"chains 3002 rules.*limit is {MAX_CHAIN}"),
    (lambda: Grammar.lark('start: "x" T0\n' + "".join(f"T{i}: T{i + 1}\n" for i in range(400)) + 'T400: "a"'),
     "chains 402 rules"),
    (lambda: Grammar.json_schema(ref_chain(3000)), f"nests 3002 subschemas.*limit is {MAX_CHAIN}"),
    (lambda: Grammar.json_schema(object_chain(1000)), "nests 2002 subschemas"),
    (lambda: Grammar.lark("start: %json " + json.dumps(ref_chain(1000))), "nests 1002 subschemas"),
    (lambda: Grammar.choice([f"option {i}" for i in range(100_000)]), f"100000 strings; the limit is {MAX_CHOICES}"),
    (lambda: Grammar.json_schema({"enum": list(range(5000))}), f"enum of 5000 values; the limit is {MAX_CHOICES}"),
    (lambda: Grammar.lark("start: " + " | ".join(f'"a{i}"' for i in range(30000))),
     f"has \\d+ bytes; the limit is {MAX_GRAMMAR_BYTES}"),
    (lambda: Grammar.regex("a{1000000}"), f"repeats 1000000 times.*limit is {MAX_REPEAT}"),
    (lambda: Grammar.regex("(a{1000}){1000}"), "repeats 1000000 times"),
    (lambda: Grammar.regex("a{10000}" * 3), "repeats 30000 times"),
    (lambda: Grammar.lark('start: A\nA: "a"{100000}'), "repeats 100000 times"),
    (lambda: Grammar.lark('start: "a" ~ 50000'), "repeats 50000 times"),
    (lambda: Grammar.lark("start: /a{100000}/"), "repeats 100000 times"),
    (lambda: Grammar.json_schema({"type": "string", "pattern": "^a{100000}$"}), "repeats 100000 times"),
    (lambda: Grammar.json_schema({"type": "array", "minItems": 100000}), "repeats 100000 times"),
])
def test_grammars_past_the_compilers_limits_are_refused_before_compiling(make, match):
    t = time.monotonic()
    with pytest.raises(GrammarError, match=match) as e:
        make()
    assert "\n" not in str(e.value) and time.monotonic() - t < 2


def test_grammars_within_the_bounds_still_compile_and_recursion_is_not_a_chain(make_tiny):
    from glmcore.structured import compile_grammar
    from glmcore.tokenizer import load_tokenizer
    tok = load_tokenizer(make_tiny("glm4"), "glm4")
    for g in (Grammar.lark(lark_chain(200)), Grammar.json_schema(ref_chain(200)), Grammar.json_schema(object_chain(100)),
              Grammar.choice([f"option {i}" for i in range(MAX_CHOICES)]), Grammar.regex("a{10000}"),
              Grammar.lark('start: item+\nitem: "(" item* ")" | "x"'),            # recursion: no chain
              Grammar.json_schema({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
                                   "$ref": "#/$defs/n"})):
        compile_grammar(tok, g).start()
    assert repeat_total("a{3}b{4}") == 7 and repeat_total("(a{10}){10}") == 100 and repeat_total("[{]{5}") == 5


def test_the_compiler_runs_on_a_large_stack_so_a_chain_past_the_bounds_cannot_crash_the_process(make_tiny):
    """A 3000-rule chain (SIGSEGV on an 8 MB stack) with the bounds bypassed: the worker's stack holds it."""
    code = f"""
from glmcore.structured import Grammar, compile_grammar
from glmcore.tokenizer import load_tokenizer
import test_grammar_bounds as t
g = object.__new__(Grammar)
object.__setattr__(g, "kind", "lark")
object.__setattr__(g, "spec", t.lark_chain(3000))
compile_grammar(load_tokenizer({str(make_tiny("glm4"))!r}, "glm4"), g).start()
print("compiled")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=str(__import__("pathlib").Path(__file__).parent))
    assert r.returncode == 0 and "compiled" in r.stdout, (r.returncode, r.stderr[-500:])


@pytest.mark.parametrize("flag,content", [
    ("--grammar", lark_chain(3000)),
    ("--json-schema", json.dumps(ref_chain(3000))),
    ("--json-schema", json.dumps(object_chain(1000))),
])
def test_cli_grammar_files_with_flat_chains_are_one_line_errors(tmp_path, flag, content):
    p = tmp_path / "g"
    p.write_text(content)
    r = subprocess.run([sys.executable, "-m", "glmcore.cli", "run", "--prompt", "x", flag, str(p)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-400:])
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1 and "the limit is" in r.stderr, r.stderr


# ------------------------------------------------------------------------------------------ over HTTP

httpx = pytest.importorskip("httpx", reason="the server tests need the dev extra (httpx)")
pytest.importorskip("uvicorn", reason='the server needs its extra: pip install "glmcore[server]"')


@pytest.fixture(scope="module")
def served(make_tiny):
    import threading

    from glmcore.backend import LoadOptions
    from glmcore.model import load_model
    from test_server import serving
    m = load_model(make_tiny("glm4"), "torch", LoadOptions(threads=1), slots=2)
    with serving(m) as url:
        stalls, stop = [], threading.Event()

        def watch():
            with httpx.Client(timeout=30) as c:
                while not stop.is_set():
                    t = time.monotonic()
                    assert c.get(f"{url}/health").status_code == 200
                    stalls.append(time.monotonic() - t)
                    stop.wait(0.05)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        yield url, stalls
        stop.set()
        watcher.join(timeout=30)
    m.close()


def _body(**kw):
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **kw}


def _tool(params):
    return [{"type": "function", "function": {"name": "f", "strict": True, "parameters": params}}]


@pytest.mark.parametrize("body,param,match", [
    (_body(structured_outputs={"grammar": lark_chain(3000)}), "structured_outputs.grammar", "chains 3002 rules"),
    (_body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain(3000)}}),
     "response_format.json_schema.schema", "nests 3002 subschemas"),
    (_body(structured_outputs={"json": object_chain(1000)}), "structured_outputs.json", "nests 2002 subschemas"),
    (_body(tools=_tool(object_chain(1000))), "tools", "tool 'f'.*nests 2002 subschemas"),
    (_body(tools=_tool(object_chain(1000)), tool_choice={"type": "function", "function": {"name": "f"}}),
     "tool_choice", "nests 2002 subschemas"),
    (_body(structured_outputs={"choice": [f"option {i}" for i in range(100_000)]}), "structured_outputs.choice",
     "100000 strings; the limit is 1000"),
    (_body(structured_outputs={"regex": "a{1000000}"}), "structured_outputs.regex", "the limit is 10000"),
    (_body(stream=True, structured_outputs={"regex": "a{1000000}"}), "structured_outputs.regex", "the limit is 10000"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 2, "structured_outputs": {"grammar": lark_chain(3000)}},
     "structured_outputs.grammar", "chains 3002 rules"),
])
def test_grammar_bombs_are_a_prompt_400_naming_the_field_and_the_server_stays_up(served, body, param, match):
    import re
    url, stalls = served
    endpoint = "completions" if "prompt" in body else "chat/completions"
    t = time.monotonic()
    r = httpx.post(f"{url}/v1/{endpoint}", json=body, timeout=60)
    assert r.status_code == 400, r.text[:300]
    assert time.monotonic() - t < 5
    err = r.json()["error"]
    assert err["param"] == param and re.search(match, err["message"]), err
    assert "\n" not in err["message"] and "panic" not in err["message"] and "backtrace" not in err["message"]
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    assert max(stalls) < 1.0


def test_a_grammar_that_hits_a_matcher_limit_mid_reply_names_its_field_not_messages(served):
    """Rule repetitions the bounds do not multiply through (q{100} of r{100} of "a"{100}): llguidance's limit is
    hit while matching; the 400 names the grammar's field, says what to do, and carries no parser state."""
    url, _ = served
    grammar = 'start: q{100}\nq: r{100}\nr: "a"{100}'
    for stream in (False, True):
        r = httpx.post(f"{url}/v1/chat/completions", json=_body(stream=stream, max_tokens=20, structured_outputs={
            "grammar": grammar}), timeout=60)
        text = r.text
        if r.status_code == 200 and not stream:
            pytest.skip("llguidance took this grammar whole")
        assert "structured_outputs.grammar" in text and "'messages'" not in text, text[-400:]
        assert "please report" not in text and "<state>" not in text, text[-400:]


@pytest.mark.parametrize("raw", [
    b'{"\\ud800": 1}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x", "\\udc00": 1}]}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "structured_outputs": {"json": '
    b'{"type": "object", "properties": {"\\ud83d": {"type": "string"}}}}}',
])
def test_a_lone_surrogate_in_a_key_is_a_400(served, raw):
    url, _ = served
    r = httpx.post(f"{url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text[:300]
    assert "surrogate" in r.json()["error"]["message"]
