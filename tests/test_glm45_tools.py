"""GLM-4.5 / 4.6 / 4.7 conversations: XML tool calls parsed and streamed as they are written, constrained decoding
in that format, thinking under control -- on a random-weight GLM-4.5-layout checkpoint with the GLM-4.6 template
and with GLM-4.7's own (no newline after the role tag or the tool name, the reply opening inside <think>).

The cases are those of the GLM tool-call bug reports of vLLM (glm45 parser: arguments buffered until </tool_call>,
#33218 / #44326; zero-argument calls; values holding tag-like text), llama.cpp (#19068: a hang on the XML form),
SGLang #11888 and Ollama #11563 (calls after thinking, several calls)."""
from __future__ import annotations

import json
import shutil

import jsonschema
import pytest

from glmcore.backend import LoadOptions
from glmcore.chat import Message, ToolCall, ToolCallStream, as_message, chat_format_for
from glmcore.errors import GlmcoreError
from glmcore.events import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEvent, ToolCallStart
from glmcore.arch.glm4_moe import GLM47_TEMPLATE
from glmcore.tokenizer import DATA_DIR, load_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
WEATHER = {"city": 'Bei "jing"\n</arg_key> <b>', "days": 3, "opts": {"a": [1, {"b": None, "c": "x"}], "d": 1.5}}


def glm47_template() -> str:
    """GLM-4.7's own chat template (as GLM-4.7-Flash ships it; glmcore/data): no newline after the role tag or the
    tool name, a generation prompt that opens <think> (`</think>` alone with thinking off), earlier turns'
    thinking cleared to `</think>` unless clear_thinking=false."""
    return (DATA_DIR / GLM47_TEMPLATE).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def glm46(make_tiny):
    return make_tiny("glm4-moe")


@pytest.fixture(scope="module")
def glm47(glm46, tmp_path_factory):
    dst = tmp_path_factory.mktemp("glm47") / "m"
    shutil.copytree(glm46, dst)
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["chat_template"] = glm47_template()
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    return dst


# Tags as added tokens that are not special: one token wherever written, their text kept when decoding. GLM-4.5+
# tokenizers ship at least <tool_call> / </tool_call> so (vLLM's glm4_moe tool parser: "not marked as special
# tokens"); here every tag is, the other form the tests hold glmcore to.
ADDED_TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
              "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<|begin_of_box|>", "<|end_of_box|>")


@pytest.fixture(scope="module")
def glm47_added(glm47, tmp_path_factory):
    """glm47 with its tags as added tokens that are not special (ADDED_TAGS)."""
    dst = tmp_path_factory.mktemp("glm47_added") / "m"
    shutil.copytree(glm47, dst)
    tj = json.loads((dst / "tokenizer.json").read_text())
    for a in tj["added_tokens"]:
        a["special"] = a["special"] and a["content"] not in ADDED_TAGS
    (dst / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    for a in cfg.get("added_tokens_decoder", {}).values():
        a["special"] = a["special"] and a["content"] not in ADDED_TAGS
    cfg["additional_special_tokens"] = [t for t in cfg.get("additional_special_tokens", []) if t not in ADDED_TAGS]
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    return dst


def _fmt(path):
    return chat_format_for(load_tokenizer(path, "glm4-moe"))


def _reply_ids(fmt, message: dict, tools=TOOLS) -> list[int]:
    """The ids the template writes for an assistant message after a user turn (its last turn, so its thinking is
    kept): the model's own reply when it was trained on the template."""
    user = [as_message({"role": "user", "content": "weather?"})]
    head = fmt.encode_messages(user, tools)          # ends with <|assistant|> (and <think> where it opens one)
    whole = fmt.encode_messages(user + [as_message(message)], tools, add_generation_prompt=False)
    assert whole[:len(head)] == head, "the template does not extend the prompt with the reply"
    return whole[len(head):]


def _push(fmt, ids, tools=TOOLS, calls=True):
    stream = ToolCallStream(fmt, tools, calls=calls)
    events = [e for i in ids for e in stream.push(i)] + stream.close()
    return events, stream


def _arguments(events, index=0) -> str:
    return "".join(e.arguments for e in events if isinstance(e, ToolCallDelta) and e.index == index)


CALLS = [{"id": "call_1", "function": {"name": "get_weather", "arguments": json.dumps(WEATHER, ensure_ascii=False)}},
         {"id": "call_2", "function": {"name": "now", "arguments": "{}"}}]


@pytest.mark.parametrize("style", ["glm46", "glm47", "glm47_added"])
def test_template_calls_parse_back_and_round_trip(request, style):
    """Two calls (one without arguments, one with a string holding tag-like text, a number and nested JSON) after
    thinking and text, as the template writes them: parsed from the ids into what was sent, streamed with the name
    first and argument pieces adding up to the arguments, and sent back they render to exactly the same ids."""
    fmt = _fmt(request.getfixturevalue(style))
    assert fmt.tool_parser.__name__ == "XmlCallParser" and fmt.thinking
    assert fmt.opens_thinking == style.startswith("glm47")
    sent = {"role": "assistant", "content": "Let me look.", "reasoning_content": "I should check.", "tool_calls": CALLS}
    ids = _reply_ids(fmt, sent)
    events, stream = _push(fmt, ids)
    msg = stream.message
    assert msg.error is None and msg.content == "Let me look." and msg.reasoning == "I should check."
    assert msg.tool_calls == [ToolCall("get_weather", WEATHER), ToolCall("now", {})]
    # streamed as written: thinking, text, then each call's name before its arguments, string values in pieces
    kinds = [type(e) for e in events]
    assert kinds.index(ReasoningDelta) < kinds.index(TextDelta) < kinds.index(ToolCallStart)
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [(s.index, s.name, s.id) for s in starts] == [(i, c.name, c.id) for i, c in enumerate(msg.tool_calls)]
    first_delta = next(i for i, e in enumerate(events) if isinstance(e, ToolCallDelta))
    assert events.index(starts[0]) < first_delta
    city_pieces = [e.arguments for e in events if isinstance(e, ToolCallDelta) and e.index == 0][1:-1]
    assert len(city_pieces) > 3      # character by character as the tokens come, not at </tool_call>
    for i, call in enumerate(msg.tool_calls):
        assert _arguments(events, i) == json.dumps(call.arguments, ensure_ascii=False)
    # round trip: the parsed reply, sent back with its calls and tool results, renders the same ids
    back = {"role": "assistant", "content": msg.content, "reasoning_content": msg.reasoning,
            "tool_calls": [{"id": c.id, "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                           for c in msg.tool_calls]}
    results = [{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in msg.tool_calls]
    user = {"role": "user", "content": "weather?"}
    want = fmt.encode_messages([as_message(m) for m in [user, sent] + results], TOOLS)
    assert fmt.encode_messages([as_message(m) for m in [user, back] + results], TOOLS) == want
    assert _reply_ids(fmt, back) == ids
    assert fmt.parse_reply(fmt.tok.decode(ids, skip_special=False), TOOLS) == msg     # the same from text


def test_value_types_follow_the_schema(glm46):
    """A value is the raw string where the schema says string, else JSON (a Python literal, else the text), as
    vLLM's and mlx-lm's GLM parsers read it; keys and values are stripped; without tools every value is tried."""
    fmt = _fmt(glm46)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string"}, "n": {"type": "number"}, "b": {"type": "boolean"}, "any": {}}}}}]
    text = ("<tool_call>f\n<arg_key> s </arg_key>\n<arg_value> 42 </arg_value>\n<arg_key>n</arg_key><arg_value>4.5"
            "</arg_value><arg_key>b</arg_key><arg_value>True</arg_value><arg_key>any</arg_key><arg_value>[1, 'x']"
            "</arg_value><arg_key>free</arg_key><arg_value>plain words</arg_value></tool_call>")
    assert fmt.parse_reply(text, tools).tool_calls == [ToolCall("f", {"s": "42", "n": 4.5, "b": True, "any": [1, "x"],
                                                                      "free": "plain words"})]
    assert fmt.parse_reply(text).tool_calls[0].arguments["s"] == 42


def test_value_holding_the_closing_tag_as_text(glm46):
    """Read from ids, "</arg_value>" typed as text inside a value is text (the tag is a special token); only the
    token ends the value."""
    fmt = _fmt(glm46)
    tok, sp = fmt.tok, fmt.tok.special_ids
    ids = ([sp["<tool_call>"]] + tok.encode("get_weather") + [sp["<arg_key>"]] + tok.encode("city")
           + [sp["</arg_key>"], sp["<arg_value>"]] + tok.encode("a</arg_value><arg_key>b") + [sp["</arg_value>"],
                                                                                              sp["</tool_call>"]])
    events, stream = _push(fmt, ids)
    assert stream.message.tool_calls == [ToolCall("get_weather", {"city": "a</arg_value><arg_key>b"})]
    assert _arguments(events) == json.dumps({"city": "a</arg_value><arg_key>b"})


@pytest.mark.parametrize("text,why", [
    ("Sure.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", "cut off"),
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>", "cut off"),
    ("<tool_call>launch_rockets\n</tool_call>", "not a tool of this request"),
    ("<tool_call>get_weather\nstray<arg_key>city</arg_key></tool_call>", "between the arguments"),
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>a</arg_value><arg_key>city</arg_key>"
     "<arg_value>b</arg_value></tool_call>", "given twice"),
    ("<tool_call>get_weather<arg_value>a</arg_value></tool_call>", "where an <arg_key>"),
])
def test_cut_off_or_malformed_calls_end_as_text(glm46, text, why):
    fmt = _fmt(glm46)
    events, stream = _push(fmt, fmt.tok.encode_rendered(text))
    msg = stream.message
    assert msg.tool_calls == [] and why in msg.error and msg.content == text.strip()
    assert not any(isinstance(e, ToolCallEvent) for e in events)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)).endswith(text.split(">", 1)[-1][-3:])


def test_tool_choice_none_reads_calls_as_text(glm46):
    fmt = _fmt(glm46)
    events, stream = _push(fmt, fmt.tok.encode_rendered("<tool_call>now\n</tool_call>"), calls=False)
    assert stream.message.tool_calls == [] and "now" in stream.message.content


# ----------------------------------------------------------------------------- constrained decoding, the server

STRICT = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]},
    "code": {"type": "string", "pattern": "^[a-z]{1,5}$"},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}, "when": {"type": "array", "items": {"type": "boolean"},
                                                                       "maxItems": 3}},
    "required": ["city", "days", "code"], "additionalProperties": False}
STRICT_TOOLS = [{"type": "function", "function": {"name": "weather", "strict": True, "parameters": STRICT}},
                {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def served(glm46, glm47, glm47_added):
    pytest.importorskip("openai", reason="the server tests need the dev extra (openai, httpx)")
    pytest.importorskip("uvicorn", reason='the server needs its extra: pip install "glmcore[server]"')
    from contextlib import ExitStack

    from test_server import client, serving

    from glmcore.model import load_model
    with ExitStack() as stack:
        out = {}
        for name, path in (("glm46", glm46), ("glm47", glm47), ("glm47_added", glm47_added)):
            m = load_model(path, "torch", LoadOptions(threads=1), slots=4, token_budget=64)
            stack.callback(m.close)
            out[name] = (m, client(stack.enter_context(serving(m, name))))
        yield out


@pytest.mark.parametrize("style", ["glm46", "glm47", "glm47_added"])
def test_required_strict_call_on_random_weights(served, style):
    """tool_choice "required" with a strict tool: random weights still return a call in the XML format whose
    arguments validate, streamed and not; the streamed pieces add up to the non-streamed call. (One call:
    parallel_tool_calls false constrains the reply to one, which a random model cannot then run past.)"""
    m, c = served[style]
    messages = [{"role": "user", "content": "weather in Paris?"}]
    for seed in range(3):
        kw = dict(model=style, messages=messages, tools=STRICT_TOOLS, tool_choice="required", max_tokens=160,
                  temperature=1.0, seed=seed, parallel_tool_calls=False, extra_body={"max_thinking_tokens": 4})
        r = c.chat.completions.create(**kw)
        msg = r.choices[0].message
        assert msg.tool_calls and r.choices[0].finish_reason == "tool_calls", msg
        for call in msg.tool_calls:
            args = json.loads(call.function.arguments)
            if call.function.name == "weather":
                jsonschema.validate(args, STRICT)
        chunks = list(c.chat.completions.create(**kw, stream=True))
        calls: dict[int, dict] = {}
        for ch in chunks:
            for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
                got = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                assert d.id in (None, got["id"]) and (d.function.name in (None, got["name"]))
                got["arguments"] += d.function.arguments or ""
        # the same call (its id is each response's own; within the stream it stays the one of the first chunk)
        assert [(v["name"], v["arguments"]) for _, v in sorted(calls.items())] == \
            [(t.function.name, t.function.arguments) for t in msg.tool_calls]
        assert all(v["id"].startswith("call_") for v in calls.values())
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        arg_chunks = [ch for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls
                      and ch.choices[0].delta.tool_calls[0].function.arguments]
        assert len(arg_chunks) > len(msg.tool_calls)        # as written, not one piece per call at the end


def test_named_call_and_a_cut_off_call(served):
    m, c = served["glm46"]
    messages = [{"role": "user", "content": "what time is it?"}]
    r = c.chat.completions.create(model="glm46", messages=messages, tools=STRICT_TOOLS, temperature=1.0, seed=1,
                                  tool_choice={"type": "function", "function": {"name": "weather"}}, max_tokens=160,
                                  parallel_tool_calls=False,
                                  extra_body={"max_thinking_tokens": 0})
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["weather"]
    jsonschema.validate(json.loads(r.choices[0].message.tool_calls[0].function.arguments), STRICT)
    # cut off inside the call: the text of the call, finish_reason "length", never a 500 or a hang
    r = c.chat.completions.create(model="glm46", messages=messages, tools=STRICT_TOOLS, tool_choice="required",
                                  max_tokens=6, temperature=1.0, seed=1, extra_body={"max_thinking_tokens": 0})
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content



def test_completions_prompt_rendered_by_the_client(served, glm46):
    """/v1/completions and /tokenize read a prompt the client rendered with the chat template itself as
    transformers' tokenizer(prompt) does (special tokens matched), with [gMASK]<sop> once: added before plain text,
    not again before a prompt that starts with it: the chat endpoint's prompt for the same conversation."""
    import httpx
    import transformers
    theirs = transformers.AutoTokenizer.from_pretrained(glm46)
    model, c = served["glm46"]
    rendered = theirs.apply_chat_template([{"role": "user", "content": "weather?"}], tokenize=False,
                                          add_generation_prompt=True)
    url = str(c.base_url).rstrip("/").removesuffix("/v1")
    for text, want in ((rendered, theirs(rendered, add_special_tokens=False)["input_ids"]),
                       ("plain text", theirs("plain text")["input_ids"])):
        assert httpx.post(f"{url}/tokenize", json={"prompt": text}).json()["tokens"] == want
        r = c.completions.create(model="glm46", prompt=text, max_tokens=1, temperature=0)
        assert r.usage.prompt_tokens == len(want)
    bare = httpx.post(f"{url}/tokenize", json={"prompt": "plain text", "add_special_tokens": False}).json()["tokens"]
    assert bare == theirs("plain text", add_special_tokens=False)["input_ids"]
    raw = c.completions.create(model="glm46", prompt=rendered, max_tokens=8, temperature=0)
    chat = c.chat.completions.create(model="glm46", messages=[{"role": "user", "content": "weather?"}], max_tokens=8,
                                     temperature=0)
    assert raw.usage.prompt_tokens == chat.usage.prompt_tokens
    assert raw.usage.completion_tokens == chat.usage.completion_tokens


@pytest.mark.parametrize("budget", [0, 3, 8])
@pytest.mark.parametrize("style", ["glm47", "glm47_added"])
def test_thinking_budget_closes_the_thought_and_the_answer_follows(served, budget, style):
    """GLM-4.7's replies open inside <think>: a budget of N ends the thought within N tokens with the template's
    own </think> (a special token, or an added one as the published tokenizer has it), and the reply goes on past
    it; usage counts the thought's tokens as reasoning_tokens."""
    m, c = served[style]
    for seed in range(2):
        r = c.chat.completions.create(model=style, messages=[{"role": "user", "content": "hi"}], max_tokens=24,
                                      temperature=1.0, seed=seed, extra_body={"max_thinking_tokens": budget})
        details = r.usage.completion_tokens_details
        assert 1 <= details.reasoning_tokens <= budget + 1     # the thought and its </think>
        assert r.usage.completion_tokens > details.reasoning_tokens  # an answer followed
        assert r.choices[0].message.content is not None
    # llama.cpp's name for it
    r = c.chat.completions.create(model=style, messages=[{"role": "user", "content": "hi"}], max_tokens=16,
                                  temperature=1.0, seed=5, extra_body={"thinking_budget_tokens": 2})
    assert r.usage.completion_tokens_details.reasoning_tokens <= 3


def test_reasoning_effort_and_thinking_switch(served):
    """reasoning_effort maps onto the template's enable_thinking switch (none: what enable_thinking=false renders);
    reasoning_content comes with reasoning_tokens."""
    m, c = served["glm46"]
    messages = [{"role": "user", "content": "hi"}]
    off = m.chat_format.configured({"enable_thinking": False}).encode_messages([as_message(x) for x in messages])
    r = c.chat.completions.create(model="glm46", messages=messages, max_tokens=2, reasoning_effort="none")
    assert r.usage.prompt_tokens == len(off)
    r = c.chat.completions.create(model="glm46", messages=messages, max_tokens=2, reasoning_effort="high")
    assert r.usage.prompt_tokens == len(m.chat_format.encode_messages([as_message(x) for x in messages]))
    m47, c47 = served["glm47"]
    r = c47.chat.completions.create(model="glm47", messages=messages, max_tokens=6, temperature=1.0, seed=3)
    if r.choices[0].message.reasoning_content:
        assert r.usage.completion_tokens_details.reasoning_tokens > 0


def test_thinking_fields_refused_where_the_template_has_no_thinking(make_tiny):
    import openai
    from test_server import client, serving

    from glmcore.model import load_model
    pytest.importorskip("uvicorn")
    m = load_model(make_tiny("glm4-0414"), "torch", LoadOptions(threads=1), slots=1)
    try:
        with serving(m) as url:
            c = client(url)
            messages = [{"role": "user", "content": "hi"}]
            with pytest.raises(openai.BadRequestError, match="max_thinking_tokens.*writes no <think>"):
                c.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                          extra_body={"max_thinking_tokens": 3})
            with pytest.raises(openai.BadRequestError, match="reasoning_effort.*has none"):
                c.chat.completions.create(model="tiny", messages=messages, max_tokens=2, reasoning_effort="low")
    finally:
        m.close()


@pytest.mark.parametrize("style", ["glm47", "glm47_added"])
def test_server_default_thinking_budget(request, style):
    """`glmcore serve --max-thinking-tokens N` (create_app's thinking_budget): a request that names no budget gets it
    (</think> a special token, or an added one as the published tokenizer has it)."""
    from test_server import client, serving

    from glmcore.model import load_model
    pytest.importorskip("uvicorn")
    m = load_model(request.getfixturevalue(style), "torch", LoadOptions(threads=1), slots=1)
    try:
        with serving(m, "glm47", thinking_budget=2) as url:
            for seed in range(2):
                r = client(url).chat.completions.create(model="glm47", messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=16, temperature=1.0, seed=seed)
                assert r.usage.completion_tokens_details.reasoning_tokens <= 3
    finally:
        m.close()


def test_chat_think_on_off(glm46, make_tiny, monkeypatch, capsys):
    """glmcore chat's /think on|off sets the template's enable_thinking from the next reply; a template without
    the switch says so."""
    from glmcore import cli
    seen = []
    monkeypatch.setattr(cli, "_chat_turn", lambda pipe, state, params, n, view=None, template_kwargs=None:
                        seen.append(template_kwargs) or True)
    lines = iter(["hi", "/think off", "hi", "/think on", "hi", "/think maybe", "/quit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert cli.main(["chat", "--model", str(glm46), "--backend", "torch", "--max-new-tokens", "2"]) == 0
    assert seen == [None, {"enable_thinking": False}, {"enable_thinking": True}]
    assert "usage: /think on|off" in capsys.readouterr().err
    lines = iter(["/think off", "/quit"])
    assert cli.main(["chat", "--model", str(make_tiny("glm4-0414")), "--backend", "torch"]) == 0
    assert "has no thinking switch" in capsys.readouterr().err


def test_preserved_thinking_is_the_templates_choice(glm47):
    """Earlier replies' reasoning_content reaches the template: dropped by default as it drops it, kept with
    chat_template_kwargs clear_thinking=false (GLM-4.7's preserved thinking)."""
    fmt = _fmt(glm47)
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "EARLIER"},
             {"role": "user", "content": "c"}]
    msgs = [as_message(m) for m in turns]
    assert "EARLIER" not in fmt.tok.decode(fmt.encode_messages(msgs), skip_special=False)
    kept = fmt.configured({"clear_thinking": False}).encode_messages(msgs)
    assert "<think>EARLIER</think>" in fmt.tok.decode(kept, skip_special=False)


def test_budget_needs_a_think_close_token(make_tiny, tmp_path):
    """GLM-Z1's </think> is text on GLM-4's tokenizer (no token, special or added): a budget cannot force it, so it is
    refused in one line (the server leaves its default budget off there); the thought before a required call stops
    at the text."""
    from glmcore.hf_tokenizer import GLM_Z1_TEMPLATE
    from glmcore.structured import GrammarError, reply_constraint
    dst = tmp_path / "z1"
    shutil.copytree(make_tiny("glm4-0414"), dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["chat_template"] = GLM_Z1_TEMPLATE
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    fmt = chat_format_for(load_tokenizer(dst, "glm4-0414"))
    assert fmt.opens_thinking and "</think>" not in fmt.tok.tag_ids
    with pytest.raises(GrammarError, match="no token of this checkpoint's tokenizer"):
        reply_constraint(fmt, None, thinking_budget=4)
    opening, constraint = reply_constraint(fmt, None, None, TOOLS, must_call=["now"])
    top = json.loads(constraint.grammar)["grammars"][0]["lark_grammar"]
    assert opening == [] and 'thought[stop="</think>"]' in top and "start: thought_part body" in top


@pytest.mark.parametrize("style", ["glm46", "glm47"])
def test_text_fed_a_character_at_a_time_gives_the_same_calls(request, style):
    """Decoded text in the smallest pieces (tags split anywhere) parses to the same message and the same argument
    pieces' concatenation as the ids do."""
    fmt = _fmt(request.getfixturevalue(style))
    sent = {"role": "assistant", "content": "Text first.", "reasoning_content": "hmm", "tool_calls": CALLS}
    ids = _reply_ids(fmt, sent)
    _, by_ids = _push(fmt, ids)
    stream = ToolCallStream(fmt, TOOLS)
    text = fmt.tok.decode(ids, skip_special=False).replace("</arg_key> <b>", "<b>")   # no tag-like text in a value
    events = [e for ch in text for e in stream.feed(ch)] + stream.close()
    msg = stream.message
    assert msg.error is None and msg.content == "Text first." and msg.reasoning == "hmm"
    assert [c.name for c in msg.tool_calls] == ["get_weather", "now"]
    assert msg.tool_calls[0].arguments["city"] == WEATHER["city"].replace("</arg_key> <b>", "<b>")
    for i, call in enumerate(msg.tool_calls):
        assert _arguments(events, i) == json.dumps(call.arguments, ensure_ascii=False)
    assert [c.name for c in by_ids.message.tool_calls] == ["get_weather", "now"]


def test_pipeline_thinking_budget(glm47):
    """Pipeline.chat(max_thinking_tokens=N): the thought ends within N tokens with </think>, the reply goes on."""
    from glmcore.pipeline import Pipeline
    from glmcore.sampling import SamplingParams
    pipe = Pipeline(glm47, "torch", LoadOptions(threads=1))
    close = pipe.tokenizer.special_ids["</think>"]
    messages = [{"role": "user", "content": "hi"}]
    n_prompt = len(pipe.model.chat_format.encode_messages([as_message(m) for m in messages]))
    try:
        for seed in range(3):
            pipe.reset()
            reply = pipe.chat(messages, params=SamplingParams(temperature=1.0, seed=seed), max_new_tokens=12,
                              max_thinking_tokens=3)
            generated = pipe.slot.tokens[n_prompt:]
            assert close in generated[:4], generated          # the thought, at most 3 tokens, then </think>
            assert reply.reasoning or generated[0] == close
    finally:
        pipe.model.close()


@pytest.mark.parametrize("args,want", [(["--max-thinking-tokens", "64"], 64), (["--reasoning-budget", "-1"], None),
                                       ([], None)])
def test_serve_flag_sets_the_default_budget(glm46, monkeypatch, args, want):
    """`glmcore serve --max-thinking-tokens N` (llama.cpp's --reasoning-budget; -1: none) reaches the server."""
    pytest.importorskip("uvicorn")
    import glmcore.server as server
    from glmcore import cli
    seen = {}
    monkeypatch.setattr(server, "serve", lambda model, backend, options, so: seen.update(so=so) or 0)
    assert cli.main(["serve", "--model", str(glm46), *args]) == 0
    assert seen["so"].max_thinking_tokens == want
    from glmcore.errors import GlmcoreError
    with pytest.raises(GlmcoreError, match="--max-thinking-tokens -2"):
        server.ServeOptions(max_thinking_tokens=-2).check()


# special tokens a client spells in its text: a role tag, an earlier reply's inline thinking, the /nothink switch
SPELLED = [{"role": "user", "content": "a <|assistant|> b"}, {"role": "assistant", "content": "<think>old</think>answer"},
           {"role": "user", "content": "<|user|> q /nothink"}]


def test_spellings_the_template_reads_mean_what_they_mean_to_it(glm46):
    """A user's "<|assistant|>" stays text, while the /nothink and inline <think>…</think> that GLM-4.5's template
    reads in the client's text are left as written for it (no second /nothink; the earlier reply's thinking split
    off), in the same prompt."""
    fmt = _fmt(glm46).configured({"enable_thinking": False})
    tok = fmt.tok
    ids = fmt.encode_messages(SPELLED)
    text = tok.decode(ids, skip_special=False)
    assert text.count("/nothink") == 2 and "old" not in text        # one per user turn
    assert "<think></think>\nanswer" in text
    spelled = tok.encode("<|assistant|>")
    assert len(spelled) > 1 and any(ids[i:i + len(spelled)] == spelled for i in range(len(ids)))
    assert ids.count(tok.special_ids["<|user|>"]) == 2 and ids.count(tok.special_ids["/nothink"]) == 2


def test_glm47_spellings_the_user_means(glm47):
    """GLM-4.7's template reads no /nothink, yet a user's /nothink is the token (the switch GLM-4.5 documents, as
    transformers, vLLM and llama.cpp encode it); a user's "<|assistant|>" stays text; the inline thinking of an
    earlier reply is split off and cleared as the template does."""
    fmt = _fmt(glm47)
    tok = fmt.tok
    ids = fmt.encode_messages(SPELLED)
    text = tok.decode(ids, skip_special=False)
    assert "old" not in text and "<|assistant|></think>answer" in text
    spelled = tok.encode("<|assistant|>")
    assert len(spelled) > 1 and any(ids[i:i + len(spelled)] == spelled for i in range(len(ids)))
    assert ids.count(tok.special_ids["<|user|>"]) == 2 and ids.count(tok.special_ids["/nothink"]) == 1


def test_glm47_thinking_off_and_cleared_thoughts(glm47):
    """GLM-4.7's own template (as GLM-4.7-Flash ships it): thinking off ends the prompt with `</think>` alone, and
    the reply after it is the answer from its first token; a reply kept as its generated ids ("thought</think>
    answer", the <think> being the prompt's) renders as the template renders an earlier turn: `</think>answer`,
    its thought cleared, exactly as transformers renders the same turn sent as text."""
    fmt = _fmt(glm47)
    user = [as_message({"role": "user", "content": "hi"})]
    assert fmt.opens_thinking and fmt.tok.decode(fmt.encode_messages(user), skip_special=False).endswith(
        "<|assistant|><think>")
    off = fmt.configured({"enable_thinking": False})
    assert not off.opens_thinking
    assert off.tok.decode(off.encode_messages(user), skip_special=False).endswith("<|assistant|></think>")
    events, stream = _push(off, fmt.tok.encode("Sunny all week."))
    assert not [e for e in events if isinstance(e, ReasoningDelta)]
    assert stream.message.content == "Sunny all week." and not stream.message.reasoning

    generated = fmt.tok.encode("I check.") + [fmt.tok.special_ids["</think>"]] + fmt.tok.encode("Sunny.")
    events, stream = _push(fmt, generated)
    assert stream.message.reasoning == "I check." and stream.message.content == "Sunny."
    turns = user + [Message("assistant", "Sunny.", ids=generated), as_message({"role": "user", "content": "and tomorrow?"})]
    text = fmt.tok.decode(fmt.encode_messages(turns), skip_special=False)
    assert "<|assistant|></think>Sunny.<|user|>and tomorrow?" in text and "I check." not in text
    import transformers
    theirs = transformers.AutoTokenizer.from_pretrained(glm47)
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sunny.", "reasoning_content": "I check."},
             {"role": "user", "content": "and tomorrow?"}]
    assert fmt.encode_messages(turns) == list(theirs.apply_chat_template(plain, add_generation_prompt=True,
                                                                          return_dict=False))



# Text pieces of the random conversations below: whitespace the templates strip or keep, markup-like and
# Jinja-like text, the /nothink switch; and, in some conversations, special tokens spelled out as text.
PIECES = ["hi", " ", "\n", "\n\n", "你好", "😀", "/nothink", "/think", "a b", "<b>", "</b>", "<tool", "call>", "  lead",
          "trail  ", "{{ x }}", "{% if %}", "\t", "null", "0", "\r\n", "think>"]
SPECIALS_AS_TEXT = ["<|user|>", "<|assistant|>", "<|observation|>", "<think>", "</think>", "<tool_call>", "<arg_key>",
           "<|endoftext|>"]


def _conversation(draw, pieces: list[str]) -> list[dict]:
    from hypothesis import strategies as st
    text = st.lists(st.sampled_from(pieces), max_size=4).map("".join)
    msgs = [{"role": "system", "content": draw(text)}] if draw(st.booleans()) else []
    for turn in range(draw(st.integers(1, 3))):
        msgs.append({"role": "user", "content": draw(text)})
        if not draw(st.integers(0, 3)):
            continue
        reply = {"role": "assistant", "content": draw(text)}
        # thinking: absent, given (empty or not), or written inline in the content (with or without a given one)
        how = draw(st.sampled_from(["none", "given", "empty", "inline", "inline+empty"]))
        if how in ("given", "empty", "inline+empty"):
            reply["reasoning_content"] = draw(text) if how == "given" else ""
        if how.startswith("inline"):
            reply["content"] = f"<think>{draw(text)}</think>{draw(text)}"
        calls = []
        for k in range(draw(st.integers(0, 2))):
            args = {"city": draw(text), "days": draw(st.integers(-3, 9))} if draw(st.booleans()) else {}
            if args and draw(st.booleans()):
                args["opts"] = {"a": [1, None, "x"], "b": 1.5}
            calls.append({"id": f"c{turn}{k}", "type": "function",
                          "function": {"name": "get_weather" if args else "now", "arguments": args}})
        if calls:
            reply["tool_calls"] = calls
        msgs.append(reply)
        msgs += [{"role": "tool", "tool_call_id": c["id"], "content": draw(text)} for c in calls]
        if calls and draw(st.booleans()):
            msgs.append({"role": "assistant", "content": draw(text)})
    return msgs


@pytest.mark.parametrize("style", ["glm46", "glm47", "glm47_added"])
def test_random_conversations_render_as_transformers(request, style):
    """Random conversations (system turns, thinking absent / given / given empty / inline, calls with typed
    arguments, several tool results, thinking switched on or off, earlier thinking kept or cleared): the prompt
    text equals transformers' apply_chat_template on the same checkpoint, and so do the ids wherever the client's
    text spells no special token (glmcore keeps those text, so a user's "<|assistant|>" cannot forge a turn,
    where transformers' tokenizer makes them the tokens; "<think>" read by the template as inline thinking is the
    template's own)."""
    import copy

    import transformers
    from hypothesis import HealthCheck, given, settings, strategies as st
    path = request.getfixturevalue(style)
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    fmt = _fmt(path)

    @settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.data(), st.booleans(), st.booleans(),
           st.sampled_from([{}, {"enable_thinking": False}, {"enable_thinking": True}, {"clear_thinking": False}]))
    def check(data, spelled, with_tools, kwargs):
        msgs = _conversation(data.draw, PIECES + SPECIALS_AS_TEXT if spelled else PIECES)
        tools = TOOLS if with_tools else None
        mine = fmt.configured(kwargs or None)
        want = theirs.apply_chat_template(copy.deepcopy(msgs), tools=tools, add_generation_prompt=True,
                                          tokenize=False, **kwargs)
        assert mine.render(msgs, tools) == want
        if spelled or any(m.get("reasoning_content") == "" and "<think>" in m["content"] for m in msgs):
            return       # "<think>" in a content the template does not read as thinking is the client's text
        want = theirs.apply_chat_template(copy.deepcopy(msgs), tools=tools, add_generation_prompt=True,
                                          return_dict=False, **kwargs)
        assert mine.encode_messages(msgs, tools) == list(want), (msgs, kwargs, want)

    check()


@pytest.mark.parametrize("style", ["glm46", "glm47"])
def test_continued_last_message_renders_as_transformers(request, style):
    """A conversation ending with an assistant's text, continued (vLLM's continue_final_message, Anthropic's
    prefill): text and ids equal transformers' apply_chat_template(continue_final_message=True), trailing
    whitespace, thinking given or not, thinking switched off, earlier thinking kept."""
    import copy

    import transformers
    from hypothesis import HealthCheck, given, settings, strategies as st
    path = request.getfixturevalue(style)
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    fmt = _fmt(path)

    @settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.data(), st.sampled_from([{}, {"enable_thinking": False}, {"clear_thinking": False}]))
    def check(data, kwargs):
        msgs = _conversation(data.draw, PIECES)
        while msgs[-1]["role"] == "assistant":
            msgs.pop()
        text = st.lists(st.sampled_from(PIECES), min_size=1, max_size=4).map("".join)
        last = {"role": "assistant", "content": data.draw(text)}
        if data.draw(st.booleans()):
            last["reasoning_content"] = data.draw(text)
        msgs.append(last)
        mine = fmt.configured(kwargs or None).continuing()
        args = dict(continue_final_message=True, add_generation_prompt=False, **kwargs)
        assert mine.render(msgs) == theirs.apply_chat_template(copy.deepcopy(msgs), tokenize=False, **args)
        if any(m.get("reasoning_content") == "" and "<think>" in m["content"] for m in msgs):
            return       # "<think>" in a content the template does not read as thinking is the client's text
        assert mine.encode_messages(msgs) == list(theirs.apply_chat_template(copy.deepcopy(msgs), return_dict=False,
                                                                             **args))

    check()
    user = {"role": "user", "content": "hi"}
    for last in (user, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "now",
                                                                                          "arguments": {}}}]},
                 {"role": "assistant", "content": [{"type": "text", "text": "x"}]}):
        with pytest.raises(GlmcoreError, match="assistant's text"):
            fmt.continuing().encode_messages([user, last])
    # a template that does not write an assistant's text cannot be continued
    dropping = fmt.continuing()
    dropping.template = ("{% for m in messages %}{% if m.role == 'user' %}<|user|>{{ m.content }}{% endif %}"
                         "{% endfor %}")
    with pytest.raises(GlmcoreError, match="drops the last assistant message's text"):
        dropping.encode_messages([user, {"role": "assistant", "content": "Sure"}])


def test_continue_final_message_over_http(served, glm47):
    """/v1/chat/completions and /tokenize with continue_final_message (and add_generation_prompt false): the prompt
    is transformers' for it, the reply continues the text (no new turn, no thinking opened); what does not fit
    together is a 400 naming the field."""
    import httpx
    import transformers
    theirs = transformers.AutoTokenizer.from_pretrained(glm47)
    model, c = served["glm47"]
    url = str(c.base_url).rstrip("/").removesuffix("/v1")
    msgs = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "Sunny, with"}]
    want = list(theirs.apply_chat_template(msgs, continue_final_message=True, add_generation_prompt=False,
                                           return_dict=False))
    body = {"model": "glm47", "messages": msgs, "continue_final_message": True, "add_generation_prompt": False}
    assert httpx.post(f"{url}/tokenize", json=body).json()["tokens"] == want
    r = c.chat.completions.create(model="glm47", messages=msgs, max_tokens=6, temperature=0,
                                  extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r.usage.prompt_tokens == len(want) and r.choices[0].finish_reason in ("stop", "length")
    raw = c.completions.create(model="glm47", prompt=want, max_tokens=6, temperature=0)
    assert r.usage.completion_tokens == raw.usage.completion_tokens
    stream = c.chat.completions.create(model="glm47", messages=msgs, max_tokens=6, temperature=0, stream=True,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    deltas = [ch.choices[0].delta for ch in stream if ch.choices]
    assert "".join(d.content or "" for d in deltas) == (r.choices[0].message.content or "")
    for extra, param in (({"continue_final_message": True}, "add_generation_prompt"),
                         ({"add_generation_prompt": False}, "add_generation_prompt"),
                         ({"continue_final_message": True, "add_generation_prompt": False, "tool_choice": "required",
                           "tools": TOOLS}, "continue_final_message"),
                         ({"continue_final_message": True, "add_generation_prompt": False,
                           "response_format": {"type": "json_object"}}, "continue_final_message")):
        e = httpx.post(f"{url}/v1/chat/completions", json={"model": "glm47", "messages": msgs, **extra})
        assert e.status_code == 400 and e.json()["error"]["param"] == param, e.text
    for path in ("/v1/chat/completions", "/tokenize"):         # the last message is the user's
        e = httpx.post(f"{url}{path}", json={**body, "messages": msgs[:1]})
        assert e.status_code == 400 and e.json()["error"]["param"] == "messages", e.text
