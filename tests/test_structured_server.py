"""Structured outputs over HTTP: response_format (json_object, json_schema), vLLM's structured_outputs (json,
regex, grammar, choice), strict tools, ignore_eos/min_tokens, and the 400s naming what cannot be honoured --
through the openai client against a real server on the random-weight tiny models."""
import json

import httpx
import jsonschema
import pytest

pytest.importorskip("llguidance")
openai = pytest.importorskip("openai", reason="the server tests need the dev extra (openai, httpx)")
pytest.importorskip("uvicorn", reason='the server needs its extra: pip install "glmcore[server]"')

from glmcore.backend import LoadOptions  # noqa: E402
from glmcore.model import load_model  # noqa: E402
from test_server import client, serving  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "kind": {"enum": ["cat", "dog"]},
    "legs": {"type": "integer", "minimum": 0, "maximum": 8},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 2}},
    "required": ["name", "kind", "legs", "tags"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "strict": True, "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module", params=["glm4", "chatglm3"])
def served(request, make_tiny):
    m = load_model(make_tiny(request.param), "torch", LoadOptions(threads=1), slots=4)
    with serving(m) as url:
        yield m, url
    m.close()


def test_response_format_json_schema_plain_and_streamed(served):
    m, url = served
    c = client(url)
    fmt = {"type": "json_schema", "json_schema": {"name": "animal", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"an animal {seed}"}],
                                      response_format=fmt, seed=seed, temperature=1.0, max_tokens=120)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "stream"}],
                                            response_format=fmt, temperature=0, max_tokens=120, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], temperature=0,
                                  response_format={"type": "json_object"}, max_tokens=200)
    if r.choices[0].finish_reason == "stop":        # an unbounded object may run out of tokens first
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_completions_and_structured_outputs_extension(served):
    m, url = served
    c = client(url)
    r = c.completions.create(model="tiny", prompt="Animal:", max_tokens=120, temperature=0,
                             extra_body={"response_format": {"type": "json_schema",
                                                             "json_schema": {"name": "a", "schema": SCHEMA}}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = c.completions.create(model="tiny", prompt="Date:", max_tokens=40, temperature=1.0, seed=3,
                             extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"}})
    assert r.choices[0].finish_reason == "stop"
    assert __import__("re").fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", r.choices[0].text)
    msgs = [{"role": "user", "content": "yes or no?"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=20,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe later"]}})
    assert r.choices[0].message.content in ("yes", "no", "maybe later")
    lark = 'start: "x=" NUM ";"\nNUM: /[0-9]{1,3}/'
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=20,
                                  extra_body={"structured_outputs": {"grammar": lark}})
    assert __import__("re").fullmatch(r"x=[0-9]{1,3};", r.choices[0].message.content)
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=60, temperature=0,
                                  extra_body={"structured_outputs": {"json": SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_strict_tools_get_arguments_matching_their_schema(served):
    m, url = served
    c = client(url)
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    if m.config.family == "chatglm3":
        with pytest.raises(openai.BadRequestError, match="writes tool calls as Python"):
            c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice="required")
        return
    for choice in ("required", {"type": "function", "function": {"name": "weather"}}):
        for seed in range(3):
            r = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice=choice, seed=seed,
                                          temperature=1.0, max_tokens=60)
            msg = r.choices[0].message
            if choice != "required" or msg.tool_calls:
                assert msg.tool_calls[0].function.name == "weather", msg
                jsonschema.validate(json.loads(msg.tool_calls[0].function.arguments), WEATHER)
            else:       # "clock" is not strict: a random model's arguments to it are rarely JSON
                assert msg.content.startswith("clock"), msg


@pytest.mark.parametrize("extra,param,fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "contentMediaType": "image/png"}}}}}},
     "response_format.json_schema.schema", "contentMediaType"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs 'json_schema'"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs.grammar", "nothing_here"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "not both"),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens", "exceeds"),
])
def test_what_cannot_be_constrained_is_a_400_naming_it(served, extra, param, fragment):
    m, url = served
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], **extra}
    r = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"], err


def test_vllm_ignore_eos_and_min_tokens(served):
    m, url = served
    body = {"model": "tiny", "prompt": "x", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body).json()
    assert r["usage"]["completion_tokens"] == 24 and r["choices"][0]["finish_reason"] == "length"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 30, "min_tokens": 9,
            "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body).json()
    assert r["usage"]["completion_tokens"] >= 9


def test_a_dead_ended_grammar_is_a_clear_error_not_a_hang(served):
    """The grammar allows only a stop token after "a", and min_tokens keeps stop tokens closed."""
    m, url = served
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10, "min_tokens": 5,
            "structured_outputs": {"grammar": 'start: "a" <|user|>'}}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "grammar_dead_end", r.text
    assert "the grammar dead-ended after" in r.json()["error"]["message"]
    del body["min_tokens"]
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    assert r["choices"][0]["message"]["content"] == "a" and r["choices"][0]["finish_reason"] == "stop"
