"""OpenAI's Responses API (/v1/responses) against a live server, driven by the official `openai` SDK: plain replies
whole and streamed (typed events, sequence numbers), previous_response_id continuations on the server's store, tool
calls and their results, reasoning items; on the built-in demo model (ChatGLM3), a GLM-4 checkpoint, and a
GLM-4.5-layout one with GLM-4.7's template (XML tool calls, a reply that opens inside <think>)."""
from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import pytest

openai = pytest.importorskip("openai", reason="the server tests need the dev extra (openai, httpx)")
pytest.importorskip("uvicorn", reason='the server needs its extra: pip install "glmcore[server]"')

from test_glm45_tools import STRICT, glm47_template  # noqa: E402
from test_server import CALLS, SCRIPTED, TOOLS as CHAT_TOOLS, client, scripted, serving  # noqa: E402,F401

from glmcore.backend import LoadOptions  # noqa: E402
from glmcore.chat import Message, as_message  # noqa: E402
from glmcore.demo import demo_model_dir  # noqa: E402
from glmcore.model import load_model  # noqa: E402

TOOLS = [{"type": "function", "name": "weather", "strict": True, "parameters": STRICT},
         {"type": "function", "name": "now", "parameters": {"type": "object", "properties": {}}}]


@pytest.fixture(scope="module")
def servers(make_tiny, tmp_path_factory):
    glm47 = tmp_path_factory.mktemp("glm47") / "m"
    shutil.copytree(make_tiny("glm4-moe"), glm47)
    (glm47 / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((glm47 / "tokenizer_config.json").read_text())
    cfg["chat_template"] = glm47_template()
    (glm47 / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    from contextlib import ExitStack
    with ExitStack() as stack:
        out = {}
        for name, path in (("demo", demo_model_dir(notice=lambda _: None)), ("glm4", make_tiny("glm4")),
                           ("glm47", glm47)):
            m = load_model(path, "torch", LoadOptions(threads=1), slots=2, token_budget=64)
            stack.callback(m.close)
            url = stack.enter_context(serving(m, name))
            out[name] = (m, client(url), url)
        yield out


def prompt_len(m, messages, tools=None) -> int:
    return len(m.chat_format.encode_messages([as_message(x) for x in messages], tools))


def events_of(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events


@pytest.mark.parametrize("name", ["demo", "glm4"])
def test_plain_reply_whole_and_streamed(servers, name):
    m, c, _ = servers[name]
    kw = dict(model=name, instructions="be brief", input="hello there", max_output_tokens=10, temperature=0)
    r = c.responses.create(**kw)
    assert r.object == "response" and r.model == name and r.status in ("completed", "incomplete")
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant" and r.output_text
    assert r.usage.input_tokens == prompt_len(m, [{"role": "system", "content": "be brief"},
                                                  {"role": "user", "content": "hello there"}])
    assert 1 <= r.usage.output_tokens <= 10 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert (r.status == "incomplete") == (r.incomplete_details is not None)
    events = events_of(c.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {events[-1].response.output[0].id} and events[-1].response.status == r.status
    # the SDK's own stream helper accumulates the same reply
    with c.responses.stream(**kw) as s:
        assert "".join(e.delta for e in s if e.type == "response.output_text.delta") == r.output_text


def test_previous_response_id_continues_on_the_server(servers):
    m, c, url = servers["demo"]
    r1 = c.responses.create(model="demo", input="spring rain", max_output_tokens=8, temperature=0)
    assert c.responses.retrieve(r1.id).output_text == r1.output_text
    r2 = c.responses.create(model="demo", previous_response_id=r1.id, input="and autumn?", max_output_tokens=4,
                            temperature=0)
    history = [{"role": "user", "content": "spring rain"}, {"role": "assistant", "content": r1.output_text},
               {"role": "user", "content": "and autumn?"}]
    assert r2.usage.input_tokens == prompt_len(m, history) and r2.previous_response_id == r1.id
    # the reply's own ids were kept: the slot's conversation is a prefix of the new prompt
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens
    # the same conversation sent whole, r1's output items as they came: the same prompt
    whole = c.responses.create(model="demo", input=[{"role": "user", "content": "spring rain"},
                                                    *[o.model_dump(exclude_none=True) for o in r1.output],
                                                    {"role": "user", "content": [{"type": "input_text",
                                                                                  "text": "and autumn?"}]}],
                               max_output_tokens=4, temperature=0)
    assert whole.usage.input_tokens == r2.usage.input_tokens and whole.output_text == r2.output_text
    # the stored conversation grows: a third turn on r2 sees all of it
    r3 = c.responses.create(model="demo", previous_response_id=r2.id, input="x", max_output_tokens=2)
    history += [{"role": "assistant", "content": r2.output_text}, {"role": "user", "content": "x"}]
    assert r3.usage.input_tokens == prompt_len(m, history)
    c.responses.delete(r3.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r3.id)
    # store false: nothing kept, so nothing to continue
    r4 = c.responses.create(model="demo", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        c.responses.retrieve(r4.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id|no stored response"):
        c.responses.create(model="demo", previous_response_id=r4.id, input="more", max_output_tokens=2)


def test_tool_call_streamed_and_its_result_sent_back(servers):
    """A required strict call on random weights (the grammar makes it): a function_call item whose arguments
    validate, streamed as argument deltas that add up to it, after a reasoning item; its output sent back as a
    function_call_output renders exactly the prompt the chat endpoint renders for the same conversation."""
    m, c, _ = servers["glm47"]
    kw = dict(model="glm47", input="weather in Paris?", tools=TOOLS, tool_choice="required", max_output_tokens=160,
              temperature=1.0, parallel_tool_calls=False, extra_body={"seed": 1, "max_thinking_tokens": 4})
    r = c.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and r.status == "completed", r.output
    call = calls[0]
    if call.name == "weather":
        jsonschema.validate(json.loads(call.arguments), STRICT)
    assert r.output[0].type == "reasoning" and r.output[0].content[0].type == "reasoning_text"
    events = events_of(c.responses.create(**kw, stream=True))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) > 1 and "".join(deltas) == done[0].arguments == call.arguments
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == [o.type for o in r.output]
    assert any(e.type == "response.reasoning_text.delta" for e in events)
    final = events[-1].response.output
    assert [o.type for o in final] == [o.type for o in r.output] and final[-1].arguments == call.arguments
    # the result goes back with the call (and the thought) as the model made them
    back = c.responses.create(model="glm47", input=[{"role": "user", "content": "weather in Paris?"},
                                                    *[o.model_dump(exclude_none=True) for o in r.output],
                                                    {"type": "function_call_output", "call_id": call.call_id,
                                                     "output": "sunny, 21 C"}],
                              tools=TOOLS, max_output_tokens=3, extra_body={"max_thinking_tokens": 0})
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
    chat = c.chat.completions.create(model="glm47", tools=chat_tools, max_tokens=1, messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": r.output[0].content[0].text,
         "tool_calls": [{"id": call.call_id, "type": "function",
                         "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}],
        extra_body={"max_thinking_tokens": 0})
    assert back.usage.input_tokens == chat.usage.prompt_tokens
    # continued by id instead: the same prompt
    by_id = c.responses.create(model="glm47", previous_response_id=r.id, tools=TOOLS, max_output_tokens=3,
                               input=[{"type": "function_call_output", "call_id": call.call_id,
                                       "output": "sunny, 21 C"}], extra_body={"max_thinking_tokens": 0})
    assert by_id.usage.input_tokens == back.usage.input_tokens


def test_text_format_json_schema(servers):
    schema = {"type": "object", "properties": {"line": {"type": "string", "maxLength": 8}}, "required": ["line"],
              "additionalProperties": False}
    m, c, _ = servers["demo"]
    r = c.responses.create(model="demo", input="a poem as JSON", max_output_tokens=40, temperature=1.0,
                           text={"format": {"type": "json_schema", "name": "poem", "schema": schema, "strict": True}},
                           extra_body={"seed": 0})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_blocks_open_grow_and_close_in_order():
    """The one place events become blocks: a block opens with its first piece, a call's arguments end as the parsed
    call's JSON, and every block opened is closed."""
    from glmcore.events import ReasoningDelta, TextDelta, ToolCall, ToolCallDelta, ToolCallEvent, ToolCallStart
    from glmcore.server.blocks import Blocks, Kind, Op
    b = Blocks()
    events = [ReasoningDelta("hm"), ReasoningDelta("m"), TextDelta("a"), TextDelta("b"),
              ToolCallStart(0, "call_1", "f"), ToolCallDelta(0, '{"x": '), ToolCallDelta(0, "1}"),
              ToolCallEvent(ToolCall("f", {"x": 1}, "call_1"), 0), ToolCallStart(1, "call_2", "g"), TextDelta("tail")]
    steps = [s for e in events for s in b.push(e)] + b.close()
    assert [(s.op, s.block.index) for s in steps] == [
        (Op.OPEN, 0), (Op.DELTA, 0), (Op.DELTA, 0), (Op.CLOSE, 0), (Op.OPEN, 1), (Op.DELTA, 1), (Op.DELTA, 1),
        (Op.CLOSE, 1), (Op.OPEN, 2), (Op.DELTA, 2), (Op.DELTA, 2), (Op.CLOSE, 2), (Op.OPEN, 3), (Op.CLOSE, 3),
        (Op.OPEN, 4), (Op.DELTA, 4), (Op.CLOSE, 4)]
    assert [(x.kind, x.text) for x in b.blocks] == [(Kind.REASONING, "hmm"), (Kind.TEXT, "ab"),
                                                    (Kind.CALL, '{"x": 1}'), (Kind.CALL, ""), (Kind.TEXT, "tail")]
    assert (b.blocks[2].call_id, b.blocks[2].name) == ("call_1", "f")


def test_store_is_bounded():
    from glmcore.server.responses import ResponseStore
    store = ResponseStore(kept=3, chars=10_000)
    for i in range(5):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": "x"}])
    assert list(store.map) == ["r2", "r3", "r4"]
    store.get("r2")                                   # used: now the newest
    store.put({"id": "big"}, [{"role": "user", "content": "y" * 9_900}])
    assert list(store.map) == ["r2", "big"] and store.size <= 10_000
    with pytest.raises(Exception, match="no stored response"):
        store.get("r3")


@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_scripted_call_in_each_format_and_the_turn_after_it(scripted, family):
    """A scripted model writing a call in GLM-4's and ChatGLM3's own formats: a function_call item, streamed and
    whole; its output sent on previous_response_id, the call comes back as the ids the model made, so only the
    tool turn is prefilled."""
    get, script = scripted
    m, u = get(family)
    script(m, (CALLS[family], "<|observation|>"), ("It is sunny.", "<|user|>"))
    c = client(u)
    tools = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
    kw = dict(model="tiny", input="weather in Beijing?", tools=tools, temperature=0)
    events = events_of(c.responses.create(**kw, stream=True))
    final = events[-1].response
    assert [o.type for o in final.output] == ["function_call"] and final.output[0].name == "get_weather"
    assert json.loads(final.output[0].arguments) == {"city": "Beijing"} and final.status == "completed"
    r1 = c.responses.create(**kw)
    call = r1.output[0]
    assert call.type == "function_call" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    SCRIPTED.prefilled.clear()
    result = json.dumps({"weather": "sunny"})
    r2 = c.responses.create(model="tiny", previous_response_id=r1.id, tools=tools, temperature=0,
                            input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}])
    assert r2.output_text == "It is sunny." and r2.status == "completed"
    obs = m.chat_format.encode_continuation([Message("tool", result)], 1)
    assert r2.usage.input_tokens_details.cached_tokens == r1.usage.input_tokens + r1.usage.output_tokens
    assert SCRIPTED.prefilled[0] == len(obs)


def test_reasoning_effort_and_thinking_budget(servers):
    m, c, _ = servers["glm47"]
    r = c.responses.create(model="glm47", input="hi", max_output_tokens=24, temperature=1.0,
                           extra_body={"seed": 2, "max_thinking_tokens": 3})
    assert r.output[0].type == "reasoning" and 1 <= r.usage.output_tokens_details.reasoning_tokens <= 4
    off = c.responses.create(model="glm47", input="hi", max_output_tokens=2,
                             reasoning={"effort": "none"}, include=["reasoning.encrypted_content"])
    fmt = m.chat_format.configured({"enable_thinking": False})
    assert off.usage.input_tokens == len(fmt.encode_messages([as_message({"role": "user", "content": "hi"})]))


def _deep(n: int) -> dict:
    d = {"type": "object"}
    for _ in range(n):
        d = {"type": "object", "properties": {"a": d}}
    return d


@pytest.mark.parametrize("body,status,param,code", [
    ({"model": "demo", "input": "x", "frobnicate": 1}, 400, "frobnicate", "unsupported_parameter"),
    ({"model": "nope", "input": "x"}, 404, "model", "model_not_found"),
    ({"input": "x"}, 400, "model", "missing_required_parameter"),
    ({"model": "demo", "input": []}, 400, "input", "invalid_value"),
    ({"model": "demo", "input": [{"type": "function_call_output", "output": "x"}]}, 400, "input.0.call_id",
     "invalid_value"),
    ({"model": "demo", "input": [{"type": "input_image", "image_url": "x"}]}, 400, "input.0.type",
     "unsupported_value"),
    ({"model": "demo", "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, 400,
     "input.0.content.0", "unsupported_value"),
    ({"model": "demo", "input": "x", "tools": [{"type": "web_search"}]}, 400, "tools.0.type", "invalid_value"),
    ({"model": "demo", "input": "x", "include": ["file_search_call.results"]}, 400, "include.0", "invalid_value"),
    ({"model": "demo", "input": "x", "tools": [{"type": "function", "name": "f", "parameters": _deep(20)}]}, 400,
     "tools.0.parameters", "invalid_value"),
    ({"model": "demo", "input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id",
     "response_not_found"),
])
def test_errors_are_openai_error_json(servers, body, status, param, code):
    url = servers["demo"][2]
    r = httpx.post(f"{url}/v1/responses", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code and err["message"], err
