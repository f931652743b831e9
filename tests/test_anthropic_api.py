"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) against a live server, driven by the official
`anthropic` SDK: plain replies whole and streamed (Anthropic's SSE sequence), stop sequences, tool_use blocks and
tool_result blocks sent back, thinking blocks and the thinking switch/budget, usage with the slot's cached tokens,
count_tokens, and errors in Anthropic's shape (x-api-key included); on the built-in demo model (ChatGLM3), a GLM-4
checkpoint and a GLM-4.5-layout one with GLM-4.7's template."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

anthropic = pytest.importorskip("anthropic", reason="the Messages API tests need the dev extra (anthropic)")
pytest.importorskip("uvicorn", reason='the server needs its extra: pip install "glmcore[server]"')

from test_glm45_tools import STRICT  # noqa: E402
from test_responses_api import prompt_len, servers  # noqa: E402,F401  (the same three servers)
from test_server import CALLS, SCRIPTED, TOOLS as CHAT_TOOLS, scripted, serving  # noqa: E402,F401
from test_server import client as openai_client  # noqa: E402

from glmcore.backend import LoadOptions  # noqa: E402
from glmcore.chat import Message, as_message  # noqa: E402
from glmcore.model import load_model  # noqa: E402

TOOLS = [{"name": "weather", "description": "the weather", "input_schema": STRICT, "strict": True},
         {"name": "now", "input_schema": {"type": "object", "properties": {}}}]


def client(url, key="unused"):
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


def user(text):
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("name", ["demo", "glm4"])
def test_plain_reply_whole_and_streamed(servers, name):
    m, _, url = servers[name]
    c = client(url)
    kw = dict(model=name, system="be brief", messages=user("hello there"), max_tokens=10, extra_body={"temperature": 0})
    r = c.messages.create(**kw)
    assert r.type == "message" and r.role == "assistant" and r.model == name and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.stop_reason in ("end_turn", "max_tokens")
    n_prompt = prompt_len(m, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}])
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == n_prompt and 1 <= r.usage.output_tokens <= 10
    assert c.messages.count_tokens(model=name, system="be brief", messages=user("hello there")).input_tokens == n_prompt
    # system as text blocks, content as blocks: the same prompt
    same = c.messages.count_tokens(model=name, system=[{"type": "text", "text": "be brief"}],
                                   messages=[{"role": "user", "content": [{"type": "text", "text": "hello "},
                                                                          {"type": "text", "text": "there"}]}])
    assert same.input_tokens == n_prompt
    with c.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == r.content[0].text == final.content[0].text and final.stop_reason == r.stop_reason
    assert final.usage.output_tokens == r.usage.output_tokens
    # the raw event sequence
    raw = {**{k: v for k, v in kw.items() if k != "extra_body"}, **kw["extra_body"], "stream": True}
    with httpx.stream("POST", f"{url}/v1/messages", json=raw, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in resp.iter_lines() if ln.startswith("event: ")]
    kinds = [ln[len("event: "):] for ln in lines]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"] and "content_block_delta" in kinds
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequences(servers):
    m, _, url = servers["demo"]
    c = client(url)
    r = c.messages.create(model="demo", messages=user("spring"), max_tokens=24, extra_body={"temperature": 0})
    text = r.content[0].text
    assert len(text) >= 4, text
    stop = text[2:4]
    cut = c.messages.create(model="demo", messages=user("spring"), max_tokens=24, stop_sequences=[stop],
                            extra_body={"temperature": 0})
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]
    with c.messages.stream(model="demo", messages=user("spring"), max_tokens=24, extra_body={"temperature": 0},
                           stop_sequences=["zzzz", stop]) as s:
        final = s.get_final_message()
    assert final.stop_sequence == stop and final.content[0].text == cut.content[0].text


def test_second_turn_reads_the_first_from_the_slot(servers):
    m, _, url = servers["demo"]
    c = client(url)
    r1 = c.messages.create(model="demo", messages=user("autumn moon"), max_tokens=8, extra_body={"temperature": 0})
    history = user("autumn moon") + [{"role": "assistant", "content": r1.content}] + user("more")
    r2 = c.messages.create(model="demo", messages=history, max_tokens=2, extra_body={"temperature": 0})
    assert r2.usage.cache_read_input_tokens >= r1.usage.input_tokens + r1.usage.cache_read_input_tokens
    assert r2.usage.input_tokens + r2.usage.cache_read_input_tokens == c.messages.count_tokens(
        model="demo", messages=history).input_tokens


def test_tool_use_streamed_with_thinking_and_the_result_sent_back(servers):
    """tool_choice any with a strict tool, thinking enabled with a budget, on random weights: a thinking block, then
    a tool_use block whose input validates; streamed as thinking_delta and input_json_delta pieces that add up to
    the same blocks; the tool_result sent back renders the prompt the chat endpoint renders."""
    m, oc, url = servers["glm47"]
    c = client(url)
    kw = dict(model="glm47", messages=user("weather in Paris?"), tools=TOOLS, max_tokens=160,
              tool_choice={"type": "any", "disable_parallel_tool_use": True},
              thinking={"type": "enabled", "budget_tokens": 4}, extra_body={"seed": 3, "temperature": 1.0})
    r = c.messages.create(**kw)
    kinds = [b.type for b in r.content]
    assert kinds[-1] == "tool_use" and kinds.count("tool_use") == 1 and r.stop_reason == "tool_use", r.content
    call = r.content[-1]
    if call.name == "weather":
        jsonschema.validate(call.input, STRICT)
    assert kinds[0] == "thinking" and r.content[0].thinking
    with c.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    assert [b.model_dump(exclude={"id"}) for b in final.content] == [b.model_dump(exclude={"id"}) for b in r.content]
    assert final.content[-1].id.startswith("call_") and final.stop_reason == "tool_use"
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"
              and e.delta.type == "input_json_delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == call.input
    assert any(e.type == "content_block_delta" and e.delta.type == "thinking_delta" for e in events)
    # the result back, with the thinking and the call as the model made them
    history = user("weather in Paris?") + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "text", "text": "sunny, 21 C"}]}]}]
    back = c.messages.create(model="glm47", messages=history, tools=TOOLS, max_tokens=3,
                             thinking={"type": "disabled"})
    # thinking disabled is the template's switch, as reasoning_effort "none" is on the chat endpoint
    chat = oc.chat.completions.create(model="glm47", max_tokens=1, reasoning_effort="none", tools=[
        {"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"],
                                          **({"description": t["description"]} if "description" in t else {}),
                                          **({"strict": t["strict"]} if "strict" in t else {})}} for t in TOOLS],
        messages=[{"role": "user", "content": "weather in Paris?"},
                  {"role": "assistant", "content": None, "reasoning_content": r.content[0].thinking,
                   "tool_calls": [{"id": call.id, "type": "function",
                                   "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}])
    assert back.usage.input_tokens + back.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert c.messages.count_tokens(model="glm47", messages=history, tools=TOOLS,
                                   thinking={"type": "disabled"}).input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_scripted_tool_use_in_each_format_and_the_turn_after_it(scripted, family):
    """A scripted model writing a call in GLM-4's and ChatGLM3's formats: a tool_use block, streamed and whole; the
    tool_result sent back with the assistant turn as returned reuses the slot: only the result turn is prefilled."""
    get, script = scripted
    m, u = get(family)
    script(m, (CALLS[family], "<|observation|>"), ("It is sunny.", "<|user|>"))
    c = client(u)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in CHAT_TOOLS]
    kw = dict(model="tiny", messages=user("weather in Beijing?"), tools=tools, max_tokens=64)
    with c.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    r1 = c.messages.create(**kw)
    for r in (streamed, r1):
        assert [b.type for b in r.content] == ["tool_use"] and r.stop_reason == "tool_use"
        assert r.content[0].name == "get_weather" and r.content[0].input == {"city": "Beijing"}
    SCRIPTED.prefilled.clear()
    result = json.dumps({"weather": "sunny"})
    r2 = c.messages.create(model="tiny", tools=tools, max_tokens=64, messages=kw["messages"] + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r1.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": r1.content[0].id, "content": result}]}])
    assert [b.text for b in r2.content] == ["It is sunny."] and r2.stop_reason == "end_turn"
    obs = m.chat_format.encode_continuation([Message("tool", result)], 1)
    assert r2.usage.cache_read_input_tokens == r1.usage.input_tokens + r1.usage.cache_read_input_tokens + \
        r1.usage.output_tokens
    assert r2.usage.input_tokens == len(obs) == SCRIPTED.prefilled[0]


def test_thinking_budget_and_switch(servers):
    m, _, url = servers["glm47"]
    c = client(url)
    r = c.messages.create(model="glm47", messages=user("hi"), max_tokens=24,
                          thinking={"type": "enabled", "budget_tokens": 3}, extra_body={"seed": 4, "temperature": 1.0})
    assert r.content[0].type == "thinking" and r.content[0].thinking
    for kind, switch in (("disabled", False), ("adaptive", True)):
        n = c.messages.count_tokens(model="glm47", messages=user("hi"), thinking={"type": kind}).input_tokens
        fmt = m.chat_format.configured({"enable_thinking": switch})
        assert n == len(fmt.encode_messages([as_message(x) for x in user("hi")])), kind
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        c.messages.create(model="glm47", messages=user("hi"), max_tokens=8, thinking={"type": "enabled",
                                                                                      "budget_tokens": 8})


@pytest.mark.parametrize("body,status,kind,words", [
    ({"model": "demo", "messages": user("x"), "max_tokens": 4, "frobnicate": 1}, 400, "invalid_request_error",
     "frobnicate"),
    ({"model": "demo", "messages": user("x")}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "nope", "messages": user("x"), "max_tokens": 4}, 404, "not_found_error", "nope"),
    ({"model": "demo", "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4},
     400, "invalid_request_error", "image"),
    ({"model": "demo", "messages": user("x"), "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 2}},
     400, "invalid_request_error", "thinking"),
    ({"model": "demo", "messages": user("x"), "max_tokens": 4, "tool_choice": {"type": "tool"}}, 400,
     "invalid_request_error", "name"),
    ({"model": "demo", "messages": user("x") + [{"role": "assistant", "content": "pre"}], "max_tokens": 4}, 400,
     "invalid_request_error", "prefill"),
    ({"model": "demo", "messages": user("x"), "max_tokens": 4, "stop_sequences": list("abcde")}, 400,
     "invalid_request_error", "stop_sequences"),
    ({"model": "demo", "messages": user("x"), "max_tokens": 4, "output_config": {"effort": "high"}}, 400,
     "invalid_request_error", "output_config.effort"),
    ({"model": "demo", "messages": user("x"), "max_tokens": 4, "tools": [{"type": "web_search_20250305",
                                                                          "name": "web_search"}]}, 400,
     "invalid_request_error", "tools.0"),
])
def test_errors_are_anthropic_error_json(servers, body, status, kind, words):
    url = servers["demo"][2]
    r = httpx.post(f"{url}/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and set(r.json()) == {"type", "error"}
    err = r.json()["error"]
    assert set(err) == {"type", "message"} and err["type"] == kind and words in err["message"], err
    # the OpenAI routes keep OpenAI's shape
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "nope", "messages": user("x")})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_x_api_key_on_every_route(make_tiny):
    m = load_model(make_tiny("chatglm3"), "torch", LoadOptions(threads=1), slots=1)
    try:
        with serving(m, "tiny", api_key="sekrit") as url:
            with pytest.raises(anthropic.AuthenticationError) as e:
                client(url, "wrong").messages.create(model="tiny", messages=user("x"), max_tokens=2)
            assert e.value.body["error"]["type"] == "authentication_error" and e.value.status_code == 401
            r = client(url, "sekrit").messages.create(model="tiny", messages=user("x"), max_tokens=2)
            assert r.usage.output_tokens >= 1
            assert client(url, "sekrit").messages.count_tokens(model="tiny", messages=user("x")).input_tokens > 0
            # x-api-key on the OpenAI routes too; a wrong one there is OpenAI's 401
            ok = httpx.get(f"{url}/v1/models", headers={"x-api-key": "sekrit"})
            assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tiny"
            bad = httpx.post(f"{url}/v1/responses", json={"model": "tiny", "input": "x"}, headers={"x-api-key": "no"})
            assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
            assert openai_client(url, "sekrit").responses.create(model="tiny", input="x", max_output_tokens=2).output
    finally:
        m.close()


def test_a_call_cut_off_by_max_tokens(servers):
    """max_tokens inside a required call: whole, no tool_use (what was written comes back as text) and stop_reason
    max_tokens; streamed, the tool_use block opened when the call's name was complete stays as it was, the same text
    follows, and stop_reason max_tokens says the call never completed (as the chat endpoint streams it). Never a 500
    or a hang."""
    m, _, url = servers["glm47"]
    c = client(url)
    kw = dict(model="glm47", messages=user("weather?"), tools=TOOLS, tool_choice={"type": "any"}, max_tokens=6,
              thinking={"type": "disabled"}, extra_body={"seed": 1, "temperature": 1.0})
    r = c.messages.create(**kw)
    assert r.stop_reason == "max_tokens" and [b.type for b in r.content] == ["text"], r.content
    with c.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert final.stop_reason == "max_tokens"
    assert [b.text for b in final.content if b.type == "text"] == [r.content[0].text]


def test_output_config_format_constrains_the_reply_to_the_schema(servers):
    """output_config.format (the SDK's structured outputs) goes through the chat path's json_schema grammar: even
    the random tiny model writes JSON of the schema."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["city", "n"],
              "additionalProperties": False}
    r = client(servers["glm4"][2]).messages.create(
        model="glm4", max_tokens=120, messages=user("weather?"),     # bounded: the schema's longest reply fits
        output_config={"format": {"type": "json_schema", "schema": schema}}, extra_body={"seed": 3, "temperature": 1.0})
    assert r.stop_reason == "end_turn", r
    jsonschema.validate(json.loads(r.content[-1].text), schema)


def test_prefill_continues_the_last_assistant_text(servers):
    """A last assistant message is a prefill: the prompt is the chat endpoint's with continue_final_message (the
    turn left open at its text), the reply is its continuation only; count_tokens counts the same prompt. The
    native-format demo refuses it in one line."""
    m, oc, url = servers["glm47"]
    c = client(url)
    msgs = user("weather?") + [{"role": "assistant", "content": "Sunny, with"}]
    r = c.messages.create(model="glm47", messages=msgs, max_tokens=5, extra_body={"temperature": 0})
    chat = oc.chat.completions.create(model="glm47", messages=msgs, max_tokens=5, temperature=0,
                                      extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert [b.text for b in r.content if b.type == "text"] == ([chat.choices[0].message.content]
                                                                if chat.choices[0].message.content else [])
    assert c.messages.count_tokens(model="glm47", messages=msgs).input_tokens == chat.usage.prompt_tokens
    opened = oc.chat.completions.create(model="glm47", messages=msgs[:1], max_tokens=1)
    assert chat.usage.prompt_tokens > opened.usage.prompt_tokens     # the text is in the prompt, not a new turn
