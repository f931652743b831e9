"""Property-based fuzzing of the server's request schema against a real loopback server (issue 27).

Hypothesis builds chat and completion bodies from OpenAI's schema -- every field, valid values and edge
values -- and then mutates them: a field replaced by any JSON value (lone surrogates included), a field
dropped, an unknown field added, nesting, or raw bytes. Each body goes to a real `glmcore serve` stack
(uvicorn with glmcore's read timeouts, the scheduler, a tiny model). Every reply must be a 2xx or a 4xx
with OpenAI's error JSON -- never a 500 --, /health (polled throughout by another thread) must never take
over a second, and afterwards every slot is free and the queue is empty.

Size: GLMCORE_FUZZ_EXAMPLES examples per endpoint (default 40, a few seconds each way).
"""
from __future__ import annotations

import json
import os
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

httpx = pytest.importorskip("httpx", reason="the server tests need the dev extra (httpx)")
pytest.importorskip("uvicorn", reason='the server needs its extra: pip install "glmcore[server]"')

from glmcore.backend import LoadOptions  # noqa: E402
from glmcore.model import load_model  # noqa: E402
from test_server import serving  # noqa: E402

EXAMPLES = int(os.environ.get("GLMCORE_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))

# ------------------------------------------------------------------ the schema, then mutations

SURROGATES = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3)
TEXT = st.text(max_size=40) | SURROGATES | st.sampled_from(["", " ", "\x00", "<|user|>", "[gMASK]", "词" * 50])
ANY = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64 + 1])
    | st.floats(allow_nan=False) | TEXT,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=10)
NAMES = st.sampled_from(["get_weather", "get_time", "f", "", "1bad", "x" * 300])
SCHEMA = st.recursive(st.fixed_dictionaries({"type": st.sampled_from(["string", "number", "object"])}),
                      lambda c: st.fixed_dictionaries({"type": st.just("object"),
                                                       "properties": st.dictionaries(st.text(max_size=4), c,
                                                                                     max_size=3)}), max_leaves=40)
TOOL = st.fixed_dictionaries({"type": st.just("function"),
                              "function": st.fixed_dictionaries({"name": NAMES},
                                                                optional={"description": TEXT, "parameters": SCHEMA})})
ARGUMENTS = (st.builds(json.dumps, ANY) | ANY | st.sampled_from(['{"a": ' + "[" * 100 + "]" * 100 + "}", "{", "[]"]))
CALL = st.fixed_dictionaries({"id": st.text(max_size=8), "type": st.just("function"),
                              "function": st.fixed_dictionaries({"name": NAMES, "arguments": ARGUMENTS})})
CONTENT = TEXT | st.none() | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                             "text": TEXT}), max_size=3)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])},
    optional={"content": CONTENT, "tool_calls": st.lists(CALL, max_size=2), "tool_call_id": st.text(max_size=8),
              "name": st.text(max_size=8)})
SAMPLING = {
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "seed": st.integers(0, 2**64 - 1), "stop": TEXT | st.lists(TEXT, max_size=5), "user": TEXT,
    "top_k": st.integers(0, 100), "repetition_penalty": st.floats(0.01, 100), "n": st.just(1),
    "presence_penalty": st.just(0), "frequency_penalty": st.just(0), "logprobs": st.just(False),
}
CHAT = st.fixed_dictionaries(
    {"model": st.just("tiny"), "messages": st.lists(MESSAGE, min_size=1, max_size=4), "max_tokens": st.integers(1, 3)},
    optional={**SAMPLING, "tools": st.lists(TOOL, max_size=3),
              "tool_choice": st.sampled_from(["auto", "none", "required"]) | st.fixed_dictionaries(
                  {"type": st.just("function"), "function": st.fixed_dictionaries({"name": NAMES})}),
              "parallel_tool_calls": st.booleans(), "max_completion_tokens": st.integers(1, 3)})
COMPLETION = st.fixed_dictionaries(
    {"model": st.just("tiny"), "prompt": TEXT | st.lists(st.integers(-5, 5000), max_size=6) | st.lists(TEXT, max_size=2),
     "max_tokens": st.integers(1, 3)},
    optional={**SAMPLING, "echo": st.just(False), "best_of": st.just(1)})


def _paths(v, path=()):
    yield path
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, x in items:
        yield from _paths(x, path + (k,))


@st.composite
def mutated(draw, schema):
    """A body of the schema, then 0-3 mutations at random places; sometimes raw bytes instead."""
    if draw(st.integers(0, 19)) == 0:
        return draw(st.binary(max_size=64) | st.sampled_from([b"", b"{", b"[]", b"null", b'{"model": "tiny"'])),
    body = draw(schema)
    for _ in range(draw(st.integers(0, 3))):
        paths = [p for p in _paths(body) if p]
        kind = draw(st.sampled_from(["replace", "delete", "add", "wrap"]))
        if kind == "add" or not paths:
            body[draw(st.sampled_from(["frobnicate", "functions", "logit_bias", "n", "suffix"]))] = draw(ANY)
            continue
        path = draw(st.sampled_from(paths))
        parent = body
        for k in path[:-1]:
            parent = parent[k]
        if kind == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif kind == "wrap":
            parent[path[-1]] = [parent[path[-1]]] if draw(st.booleans()) else {"x": parent[path[-1]]}
        else:
            parent[path[-1]] = draw(ANY)
    # never a long generation: mutations may drop max_tokens, the context bounds what is left
    return body


# ------------------------------------------------------------------ the server under fuzz

@pytest.fixture(scope="module")
def fuzz_server(make_tiny):
    m = load_model(make_tiny("chatglm3"), "torch", LoadOptions(threads=1, capacity=96), slots=2, token_budget=64)
    with serving(m, max_body=256 << 10, read_timeout=5.0) as url:
        stalls, stop = [], threading.Event()

        def watch():                  # /health, polled the whole time: the event loop never waits on a request
            with httpx.Client(timeout=30) as c:
                while not stop.is_set():
                    t = time.monotonic()
                    c.get(f"{url}/health")
                    stalls.append(time.monotonic() - t)
                    stop.wait(0.05)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        yield url, m, stalls
        stop.set()
        watcher.join(timeout=30)
    m.close()


def _check(url, endpoint, body):
    data = body[0] if isinstance(body, tuple) else json.dumps(body).encode()     # ASCII: \ud800 stays escaped
    with httpx.Client(timeout=120) as c:
        r = c.post(f"{url}/v1/{endpoint}", content=data, headers={"content-type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:300], data[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
        assert "\n" not in err["message"], err
    elif "text/event-stream" in r.headers.get("content-type", ""):
        assert r.text.rstrip().endswith("data: [DONE]") and "server_error" not in r.text, r.text[-300:]


@FUZZ
@given(body=mutated(CHAT))
def test_fuzzed_chat_requests_are_never_a_500(fuzz_server, body):
    _check(fuzz_server[0], "chat/completions", body)


@FUZZ
@given(body=mutated(COMPLETION))
def test_fuzzed_completion_requests_are_never_a_500(fuzz_server, body):
    _check(fuzz_server[0], "completions", body)


def test_after_the_fuzz_nothing_leaked_and_health_never_stalled(fuzz_server):
    url, m, stalls = fuzz_server
    _check(url, "chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    deadline = time.monotonic() + 30
    while (m.scheduler.busy_slots or m.scheduler.queue_len) and time.monotonic() < deadline:
        time.sleep(0.05)
    health = httpx.get(f"{url}/health").json()
    assert health["busy_slots"] == 0 and health["queue_length"] == 0, health
    assert stalls and max(stalls) < 1.0, f"/health took {max(stalls):.2f} s during the fuzz"
