"""Property-based fuzzing of the server's request schema against a real loopback server (issue 27).

Hypothesis builds chat and completion bodies from OpenAI's schema -- every field, valid values and edge
values, grammars of the shapes that crashed or stalled the constraint compiler (flat rule/$ref chains, long
choice lists and enums, long repetitions; issue 41) -- and then mutates them: a field replaced by any JSON value (lone surrogates included), a field
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
KEYS = st.text(max_size=6) | SURROGATES               # a lone surrogate in a key, too (issue 41 item 8)
ANY = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64 + 1])
    | st.floats(allow_nan=False) | TEXT,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(KEYS, c, max_size=4), max_leaves=10)
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
              "name": st.text(max_size=8), "reasoning_content": TEXT | st.none()})
# grammars of the shapes that crashed or stalled llguidance (issue 41 items 1, 2, 9): flat rule and $ref chains
# (SIGSEGV past ~2500 links), linked objects, long choice lists and enums (20 s at 100k), long repetitions
CHAIN = st.sampled_from([3, 300, 3000])


def _lark_chain(n):
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


def _ref_chain(n, linked):
    one = (lambda i: {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}) if linked else \
        (lambda i: {"$ref": f"#/$defs/d{i + 1}"})
    return {"$defs": {**{f"d{i}": one(i) for i in range(n)}, f"d{n}": {"type": "string"}}, "$ref": "#/$defs/d0"}


LONG = st.sampled_from([1, 5, 1001, 100_000])
SCHEMAS = (CHAIN.map(lambda n: _ref_chain(n, False)) | st.sampled_from([3, 100, 1000]).map(lambda n: _ref_chain(n, True))
           | LONG.map(lambda n: {"enum": [f"v{i}" for i in range(n)]}) | SCHEMA)
STRUCTURED = st.one_of(
    st.fixed_dictionaries({"grammar": CHAIN.map(_lark_chain)}),
    st.fixed_dictionaries({"json": SCHEMAS}),
    st.fixed_dictionaries({"choice": LONG.map(lambda n: [f"option {i}" for i in range(n)])}),
    st.fixed_dictionaries({"regex": st.sampled_from(["a{3}", "a{10000}", "a{1000000}", "(a{1000}){1000}", "[0-9]+"])}))
RESPONSE_FORMAT = st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
    {"name": st.just("x"), "schema": SCHEMAS})})
STRICT_TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.just("chained"), "strict": st.just(True), "parameters": SCHEMAS})})
SAMPLING = {
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "seed": st.integers(0, 2**64 - 1), "stop": TEXT | st.lists(TEXT, max_size=5), "user": TEXT,
    "top_k": st.integers(0, 100), "repetition_penalty": st.floats(0.01, 100), "n": st.integers(1, 5),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 5000).map(str), st.floats(-100, 100), max_size=3),
}
# at most one of them (two is a plain 400 that never reaches the compiler)
CONSTRAINT = st.one_of(st.just({}), STRUCTURED.map(lambda v: {"structured_outputs": v}),
                       RESPONSE_FORMAT.map(lambda v: {"response_format": v}))


def _with(base, extra):
    return {**base, **extra}

CHAT = st.fixed_dictionaries(
    {"model": st.just("tiny"), "messages": st.lists(MESSAGE, min_size=1, max_size=4), "max_tokens": st.integers(1, 3)},
    optional={**SAMPLING, "tools": st.lists(TOOL | STRICT_TOOL, max_size=3),
              "tool_choice": st.sampled_from(["auto", "none", "required"]) | st.fixed_dictionaries(
                  {"type": st.just("function"), "function": st.fixed_dictionaries({"name": NAMES})}),
              "parallel_tool_calls": st.booleans(), "max_completion_tokens": st.integers(1, 3),
              "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
              "continue_final_message": st.booleans(), "add_generation_prompt": st.booleans()})
COMPLETION = st.fixed_dictionaries(
    {"model": st.just("tiny"), "prompt": TEXT | st.lists(st.integers(-5, 5000), max_size=6) | st.lists(TEXT, max_size=2),
     "max_tokens": st.integers(0, 3)},
    optional={**SAMPLING, "echo": st.booleans(), "best_of": st.just(1), "logprobs": st.integers(0, 5)})
CHAT = st.builds(_with, CHAT, CONSTRAINT)
COMPLETION = st.builds(_with, COMPLETION, st.one_of(st.just({}), STRUCTURED.map(lambda v: {"structured_outputs": v})))


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
            body[draw(st.sampled_from(["frobnicate", "functions", "logit_bias", "n", "suffix"]) | SURROGATES)] = draw(ANY)
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

# ChatGLM3's own prompt format and tool parser; the jinja templates with XML tool calls and thinking: GLM-4.6's
# (glm4-moe), GLM-4.7's (glm4-moe-lite: replies open inside <think>, latent attention)
@pytest.fixture(scope="module", params=["chatglm3", "glm4-moe", "glm4-moe-lite"])
def fuzz_server(make_tiny, request):
    m = load_model(make_tiny(request.param), "torch", LoadOptions(threads=1, capacity=96), slots=2, token_budget=64)
    with serving(m, max_body=4 << 20, read_timeout=5.0) as url:       # room for a 100k-entry choice
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
    t = time.monotonic()
    with httpx.Client(timeout=120) as c:
        r = c.post(f"{url}/v1/{endpoint}", content=data, headers={"content-type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:300], data[:300])
    # no request holds a preparation thread for long (a 100k choice took 20 s of CPU before it was bounded)
    assert time.monotonic() - t < 15, (time.monotonic() - t, data[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
        assert "\n" not in err["message"], err
        assert not any(w in err["message"] for w in ("panic", "backtrace", "<state>", "please report")), err
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


# the Responses API and Anthropic's Messages API: their bodies, translated onto the same chat path
PART = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image"]), "text": TEXT})
ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant", "tool"])},
                          optional={"type": st.just("message"), "content": TEXT | st.lists(PART, max_size=3)}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.text(max_size=8), "name": NAMES,
                           "arguments": ARGUMENTS}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.text(max_size=8),
                           "output": TEXT | st.lists(PART, max_size=2)}),
    st.fixed_dictionaries({"type": st.just("reasoning")}, optional={"content": st.lists(st.fixed_dictionaries(
        {"type": st.just("reasoning_text"), "text": TEXT}), max_size=2), "summary": st.just([])}))
FLAT_TOOL = TOOL.map(lambda t: {"type": "function", **t["function"]})
RESPONSES = st.fixed_dictionaries(
    {"model": st.just("tiny"), "input": TEXT | st.lists(ITEM, min_size=1, max_size=4),
     "max_output_tokens": st.integers(1, 3)},
    optional={"instructions": TEXT, "tools": st.lists(FLAT_TOOL, max_size=2), "stream": st.booleans(),
              "tool_choice": st.sampled_from(["auto", "none", "required"]) | st.fixed_dictionaries(
                  {"type": st.just("function"), "name": NAMES}), "store": st.booleans(),
              "temperature": st.floats(0, 2), "parallel_tool_calls": st.booleans(),
              "previous_response_id": TEXT, "reasoning": st.fixed_dictionaries(
                  {"effort": st.sampled_from(["none", "low", "high"])}),
              "text": st.fixed_dictionaries({"format": st.fixed_dictionaries(
                  {"type": st.sampled_from(["text", "json_object", "json_schema"])},
                  optional={"name": st.just("x"), "schema": SCHEMA})})})
BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.text(max_size=8), "name": NAMES, "input": ANY}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.text(max_size=8)},
                          optional={"content": TEXT | st.lists(st.fixed_dictionaries(
                              {"type": st.just("text"), "text": TEXT}), max_size=2), "is_error": st.booleans()}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": TEXT, "signature": TEXT}),
    st.fixed_dictionaries({"type": st.just("image"), "source": ANY}))
ANTHROPIC = st.fixed_dictionaries(
    {"model": st.just("tiny"), "max_tokens": st.integers(1, 3), "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant"]), "content": TEXT | st.lists(BLOCK, max_size=3)}),
        min_size=1, max_size=4)},
    optional={"system": TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2),
              "tools": st.lists(st.fixed_dictionaries({"name": NAMES, "input_schema": SCHEMA}), max_size=2),
              "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none"])},
                                                   optional={"name": NAMES}),
              "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "adaptive"])},
                                                optional={"budget_tokens": st.integers(0, 4)}),
              "stop_sequences": st.lists(TEXT, max_size=5), "temperature": st.floats(0, 1),
              "top_k": st.integers(0, 100), "stream": st.booleans()})


def _check_api(url, endpoint, body, anthropic_shape: bool):
    """As _check, for the Responses and Messages APIs: each answers errors in its own shape, and streams its own
    events (no [DONE])."""
    data = body[0] if isinstance(body, tuple) else json.dumps(body).encode()
    with httpx.Client(timeout=120) as c:
        r = c.post(f"{url}/v1/{endpoint}", content=data, headers={"content-type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:300], data[:300])
    if r.status_code >= 400:
        if anthropic_shape:
            assert r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}, r.text
            message = r.json()["error"]["message"]
        else:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
            message = r.json()["error"]["message"]
        assert message and "\n" not in message, message
    elif "text/event-stream" in r.headers.get("content-type", ""):
        last = "message_stop" if anthropic_shape else "response.completed"
        assert "server_error" not in r.text and "api_error" not in r.text, r.text[-300:]
        # the end, or a failure told in the stream (a grammar dead end: a 400 of its own)
        assert any(f"event: {e}" in r.text for e in (last, "response.incomplete", "error")), r.text[-300:]


@FUZZ
@given(body=mutated(RESPONSES))
def test_fuzzed_responses_requests_are_never_a_500(fuzz_server, body):
    _check_api(fuzz_server[0], "responses", body, anthropic_shape=False)


@FUZZ
@given(body=mutated(ANTHROPIC))
def test_fuzzed_messages_requests_are_never_a_500(fuzz_server, body):
    _check_api(fuzz_server[0], "messages", body, anthropic_shape=True)
    _check_api(fuzz_server[0], "messages/count_tokens", body, anthropic_shape=True)


def _odd_keys(schema):
    """A schema with a property named by a lone surrogate, or an empty or huge name."""
    return st.sampled_from(["\ud800", "", "k" * 5000, "\udfff\ud800"]).map(
        lambda k: {"type": "object", "properties": {k: schema}, "required": [k]})


# a well-formed request around each constraint, so it reaches the compiler (a random body mostly stops earlier)
CONSTRAINED = st.builds(_with, st.just({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 2}),
                        st.one_of(CONSTRAINT.filter(bool),
                                  st.lists(STRICT_TOOL, min_size=1, max_size=1).map(lambda t: {"tools": t}),
                                  _odd_keys({"type": "string"}).map(lambda v: {"structured_outputs": {"json": v}}),
                                  st.builds(lambda n, k: {"structured_outputs": {"json": {**_ref_chain(n, k)}}},
                                            CHAIN, st.booleans())))


@FUZZ
@given(body=CONSTRAINED)
def test_fuzzed_constraints_are_never_a_500_nor_a_crash(fuzz_server, body):
    _check(fuzz_server[0], "chat/completions", body)


def test_after_the_fuzz_nothing_leaked_and_health_never_stalled(fuzz_server):
    url, m, stalls = fuzz_server
    _check(url, "chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    deadline = time.monotonic() + 30
    while (m.scheduler.busy_slots or m.scheduler.queue_len) and time.monotonic() < deadline:
        time.sleep(0.05)
    health = httpx.get(f"{url}/health").json()
    assert health["busy_slots"] == 0 and health["queue_length"] == 0, health
    assert stalls and max(stalls) < 1.0, f"/health took {max(stalls):.2f} s during the fuzz"
