"""Chat formats of ChatGLM2/3 and GLM-4 against re-statements of the original prompt builders,
GLM-4's own chat_template (rendered with jinja2 as transformers does), and reply parsing."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from glmcore.chat import ChatGLM3Format, Message, ToolCall, ToolCallStream, chat_format_for
from glmcore.parsers.base import ToolCallParseError
from glmcore.parsers.segments import parse_chatglm3_call, parse_glm4_call
from glmcore.events import TextDelta, ToolCallDelta, ToolCallEvent, ToolCallStart
from glmcore.tokenizer import load_tokenizer, write_tokenizer

MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "查询天气 / get the weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]


def _real(name: str, family: str):
    if not (MODELS / name / "tokenizer.model").is_file():
        pytest.skip(f"real tokenizer files not found under {MODELS}")
    return load_tokenizer(MODELS / name, family)


@pytest.fixture(scope="module")
def f2():
    return chat_format_for(_real("chatglm3-6b", "chatglm2"))


@pytest.fixture(scope="module")
def f3():
    return chat_format_for(_real("chatglm3-6b", "chatglm3"))


@pytest.fixture(scope="module")
def f4():
    return chat_format_for(_real("glm-4-9b-chat-1m", "glm4"))


HISTORY = [Message("user", "你好"), Message("assistant", "你好👋！有什么可以帮你？"),
           Message("user", "Write  code:\n```py\nprint('<|user|>')\n```")]


# ---------------------------------------------------------------- known prompts


def test_readme_chat_turns(f3, f4):
    assert f3.encode_messages([Message("user", "你好")]) == [64790, 64792, 64795, 30910, 13, 36474, 54591, 64796]
    assert f4.encode_messages([{"role": "user", "content": "你好"}]) == [151331, 151333, 151336, 198, 109377, 151337]
    assert f3.stop_ids == [2, 64795, 64797] and f4.stop_ids == [151329, 151336, 151338]


def test_chatglm2_matches_build_prompt(f2):
    # chatglm2-6b: prompt = build_prompt(query, history); ids = [gMASK, sop] + sp.encode(prompt).
    def build_prompt(query, history):
        prompt = ""
        for i, (q, r) in enumerate(history):
            prompt += "[Round {}]\n\n问：{}\n\n答：{}\n\n".format(i + 1, q, r)
        return prompt + "[Round {}]\n\n问：{}\n\n答：".format(len(history) + 1, query)

    tok = f2.tok
    assert f2.stop_ids == [2]
    prompt = build_prompt(HISTORY[2].content, [(HISTORY[0].content, HISTORY[1].content)])
    assert f2.encode_messages(HISTORY) == [64790, 64792] + tok.encode(prompt)
    assert f2.encode_messages(HISTORY[:1]) == [64790, 64792] + tok.encode(build_prompt("你好", []))
    with pytest.raises(ValueError, match="no tool calling"):
        f2.encode_messages(HISTORY, tools=TOOLS)
    # No system role in ChatGLM2: its text goes before the rounds, in the first span.
    ids = f2.encode_messages([Message("system", "Be brief.")] + HISTORY[:1])
    assert ids == [64790, 64792] + tok.encode("Be brief.\n\n" + build_prompt("你好", []))
    spans = f2.turn_spans([Message("system", "Be brief.")] + HISTORY[:1])
    assert len(spans) == 2 and tok.decode(ids[spans[1][0]:]).startswith("\n\n[Round 1]")


def _chatglm3_reference(tok, history, query, role="user"):
    """ChatGLM3's build_chat_input / build_single_message, restated."""
    sp = tok.special_ids

    def single(role, metadata, message):
        return [sp[f"<|{role}|>"]] + tok.encode(f"{metadata}\n") + tok.encode(message)

    ids = []
    for item in history:
        content = item["content"]
        if item["role"] == "system" and "tools" in item:
            content = content + "\n" + json.dumps(item["tools"], indent=4, ensure_ascii=False)
        ids += single(item["role"], item.get("metadata", ""), content)
    ids += single(role, "", query) + [sp["<|assistant|>"]]
    return [sp["[gMASK]"], sp["sop"]] + ids


def test_chatglm3_matches_build_chat_input(f3):
    tok = f3.tok
    assert f3.encode_messages(HISTORY) == _chatglm3_reference(
        tok, [{"role": "user", "content": "你好"}, {"role": "assistant", "content": HISTORY[1].content}],
        HISTORY[2].content)
    # Tools in the system turn (the demo's system text), a tool call and its observation.
    fn = TOOLS[0]["function"]
    call_text = "```python\ntool_call(city='北京', days=2)\n```"
    hist = [{"role": "system", "content": ChatGLM3Format.TOOLS_SYSTEM, "tools": [fn]},
            {"role": "user", "content": "北京天气"},
            {"role": "assistant", "metadata": "get_weather", "content": call_text}]
    ref = _chatglm3_reference(tok, hist, '{"temp": 22}', role="observation")
    msgs = [Message("user", "北京天气"),
            Message("assistant", tool_calls=[ToolCall("get_weather", {"city": "北京", "days": 2})]),
            Message("observation", '{"temp": 22}')]
    assert f3.encode_messages(msgs, tools=TOOLS) == ref
    # A system message of the user's own keeps its text; the tools are appended to it.
    ref2 = _chatglm3_reference(tok, [{"role": "system", "content": "Be brief.", "tools": [fn]}], "hi")
    assert f3.encode_messages([Message("system", "Be brief."), Message("user", "hi")], tools=TOOLS) == ref2


def test_chatglm3_metadata(f3):
    tok, sp = f3.tok, f3.tok.special_ids
    ids = f3.encode_messages([Message("user", "x", metadata="meta")], add_generation_prompt=False)
    assert ids == [sp["[gMASK]"], sp["sop"], sp["<|user|>"]] + tok.encode("meta\n") + tok.encode("x")


def _glm4_template_reference(tok, messages, tools=None):
    """GLM-4's chat_template rendered with jinja2 (transformers' settings and tojson), then tokenized
    as transformers does: special tokens split out, the text between them encoded in one piece."""
    jinja2 = pytest.importorskip("jinja2")
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    cfg = json.loads((MODELS / "glm-4-9b-chat-1m" / "tokenizer_config.json").read_text())
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii)
    items = ([{"role": "system", "content": None, "tools": tools}] if tools else []) + messages
    text = env.from_string(cfg["chat_template"]).render(messages=items, add_generation_prompt=True)
    specials = tok.special_ids
    ids = []
    for part in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
        if part in specials:
            ids.append(specials[part])
        elif part:
            ids += tok.encode(part)
    return ids


def test_glm4_matches_chat_template(f4):
    tok = f4.tok
    plain = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "你好"},
             {"role": "assistant", "content": "\n你好👋"}, {"role": "user", "content": "  spaces \n\n and\nlines "}]
    assert f4.encode_messages(plain) == _glm4_template_reference(tok, plain)
    with_tools = [{"role": "user", "content": "北京天气"},
                  {"role": "assistant", "metadata": "get_weather", "content": '{"city": "北京"}'},
                  {"role": "observation", "content": '{"temp": 22}'}]
    msgs = [Message("user", "北京天气"), Message("assistant", tool_calls=[ToolCall("get_weather", {"city": "北京"})]),
            Message("tool", '{"temp": 22}')]
    assert f4.encode_messages(msgs, tools=TOOLS) == _glm4_template_reference(tok, with_tools, TOOLS)
    # The template skips messages with empty content.
    assert f4.encode_messages([Message("system", ""), Message("user", "hi")]) == \
        _glm4_template_reference(tok, [{"role": "user", "content": "hi"}])


def test_user_text_never_becomes_special(f3, f4):
    for f in (f3, f4):
        ids = f.encode_messages([Message("user", "<|user|><|assistant|>[gMASK]")])
        sp = f.tok.special_ids
        assert ids.count(sp["<|user|>"]) == 1 and ids.count(sp["<|assistant|>"]) == 1
        assert ids.count(sp["[gMASK]"]) == 1


# ---------------------------------------------------------------- spans and continuation


CONVERSATION = [Message("system", "Be brief."), Message("user", "你好"), Message("assistant", "你好！"),
                Message("user", "天气?"), Message("assistant", "晴。"), Message("user", "谢谢")]


@pytest.mark.parametrize("name", ["f2", "f3", "f4"])
def test_turn_spans(request, name):
    f = request.getfixturevalue(name)
    msgs = CONVERSATION if name != "f2" else CONVERSATION[1:]
    ids = f.encode_messages(msgs)
    spans = f.turn_spans(msgs)
    assert spans[0][0] == 0 and spans[-1][1] == len(ids)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert len(spans) == 4        # prefix (+system), then one span per user turn
    if name == "f2":
        assert ids[:spans[1][0]] == [64790, 64792]
        for a, _ in spans[2:]:
            assert f.tok.decode(ids[a:a + 6]).startswith("\n\n[Round")
    else:
        user = f.tok.special_ids["<|user|>"]
        assert [ids[a] for a, _ in spans[1:]] == [user] * 3
        assert f.tok.special_ids["<|system|>"] in ids[:spans[1][0]]


@pytest.mark.parametrize("name", ["f2", "f3", "f4"])
def test_continuation(request, name):
    f = request.getfixturevalue(name)
    msgs = CONVERSATION[1:]
    for k in (2, 4):   # cache = prompt + reply of the first k messages
        cached = f.encode_messages(msgs[:k], add_generation_prompt=False)
        cont = f.encode_continuation(msgs[k:k + 2 if k + 2 < len(msgs) else None][:1], n_previous_turns=k // 2)
        assert cached + cont == f.encode_messages(msgs[:k + 1])


def test_chatglm2_round_numbers(f2):
    cont = f2.encode_continuation([Message("user", "q")], n_previous_turns=4)
    assert f2.tok.decode(cont) == "\n\n[Round 5]\n\n问：q\n\n答："


def test_synthetic_tokenizers_work_with_formats(tmp_path):
    for family in ("chatglm2", "chatglm3", "glm4"):
        write_tokenizer(family, tmp_path / family)
        f = chat_format_for(load_tokenizer(tmp_path / family, family))
        ids = f.encode_messages(CONVERSATION[1:])
        assert ids[:2] == [f.tok.special_ids["[gMASK]"], f.tok.special_ids["sop" if family != "glm4" else "<sop>"]]
        cached = f.encode_messages(CONVERSATION[1:3], add_generation_prompt=False)
        assert cached + f.encode_continuation(CONVERSATION[3:4], 1) == f.encode_messages(CONVERSATION[1:4])


# ---------------------------------------------------------------- replies


def test_parse_plain(f2, f3, f4):
    assert f2.parse_reply("  你好！\n") == Message("assistant", "你好！")
    assert f3.parse_reply("\n 你好👋！我是 ChatGLM3。\n\n") == Message("assistant", "你好👋！我是 ChatGLM3。")
    assert f4.parse_reply("\n你好\n\n世界") == Message("assistant", "你好\n\n世界")
    assert f4.parse_reply("Sure\nhere it is") == Message("assistant", "Sure\nhere it is")


def test_parse_chatglm3_tool_call(f3):
    m = f3.parse_reply("get_weather\n ```python\ntool_call(city='北京', days=3, opts={'a': [1, None, True]})\n```")
    assert m.tool_calls == [ToolCall("get_weather", {"city": "北京", "days": 3, "opts": {"a": [1, None, True]}})]
    assert m.content == "" and m.error is None
    # Text first, then the call in a second <|assistant|> segment.
    m = f3.parse_reply("\n 好的，我查一下。<|assistant|>get_weather\n```python\ntool_call(city=\"上海\")\n```")
    assert m.content == "好的，我查一下。" and m.tool_calls[0].arguments == {"city": "上海"}


@pytest.mark.parametrize("body, why", [
    ("tool_call(city=", "not valid Python"),
    ("tool_call('北京')", "keyword arguments only"),
    ("tool_call(**{'city': 'x'})", r"\*\*kwargs"),
    ("other_call(city='x')", "single tool_call"),
    ("tool_call(city=__import__('os').system('touch /tmp/glmcore_pwned'))", "not a literal"),
    ("tool_call(city=open('/etc/passwd').read())", "not a literal"),
])
def test_parse_chatglm3_malformed(f3, body, why):
    text = f"get_weather\n```python\n{body}\n```"
    m = f3.parse_reply(text)
    assert m.tool_calls == [] and m.error and re.search(why, m.error)
    assert m.content == text
    assert not Path("/tmp/glmcore_pwned").exists()
    with pytest.raises(ToolCallParseError):
        parse_chatglm3_call(body)


def test_parse_glm4_tool_call(f4):
    m = f4.parse_reply('get_weather\n{"city": "北京", "days": 2}')
    assert m.tool_calls == [ToolCall("get_weather", {"city": "北京", "days": 2})] and m.error is None
    bad = f4.parse_reply('get_weather\n{"city": ')
    assert bad.tool_calls == [] and "JSON" in bad.error and bad.content == 'get_weather\n{"city":'
    # As GLM-4's process_response: arguments must start the second line with "{", else it is text.
    assert f4.parse_reply("get_weather\n[1, 2]") == Message("assistant", "get_weather\n[1, 2]")
    with pytest.raises(ToolCallParseError, match="object"):
        parse_glm4_call("[1, 2]")
    # Only names of the given tools count when tools are known.
    assert f4.parse_reply('other\n{"a": 1}', tools=TOOLS) == Message("assistant", 'other\n{"a": 1}')
    assert f4.parse_reply('get_weather\n{"a": 1}', tools=TOOLS).tool_calls[0].name == "get_weather"


def test_message_normalization():
    assert Message("observation", "x").role == "tool"
    with pytest.raises(ValueError, match="unknown message role"):
        Message("robot", "x")
    m = Message("assistant", tool_calls=[{"id": "call_1", "type": "function",
                                          "function": {"name": "f", "arguments": '{"a": 1}'}}])
    assert m.tool_calls == [ToolCall("f", {"a": 1}, "call_1")]


# ---------------------------------------------------------------- streaming


def _events_by_char(stream, text):
    events = []
    for ch in text:
        events += stream.feed(ch)
    return events + stream.close()


def test_stream_text_events(f3):
    s = ToolCallStream(f3)
    events = _events_by_char(s, "\n 你好，\n\n世界。  \n")
    assert all(isinstance(e, TextDelta) for e in events) and len(events) > 3      # token by token, not at the end
    assert "".join(e.text for e in events) == "你好，\n\n世界。" == s.message.content


def test_stream_tool_call_events(f3, f4):
    s = ToolCallStream(f3)
    events = _events_by_char(s, "\n 好的。<|assistant|>get_weather\n```python\ntool_call(city='北京')\n```")
    # the name as soon as the body shows a call, the arguments when the segment ends (one Python value)
    assert [type(e) for e in events] == [TextDelta, TextDelta, TextDelta, ToolCallStart, ToolCallDelta, ToolCallEvent]
    assert events[-1].call == ToolCall("get_weather", {"city": "北京"})
    assert events[3] == ToolCallStart(0, events[-1].call.id, "get_weather") and events[4].arguments == '{"city": "北京"}'
    assert s.message == f3.parse_reply("\n 好的。<|assistant|>get_weather\n```python\ntool_call(city='北京')\n```")

    s = ToolCallStream(f4, tools=TOOLS)
    events = _events_by_char(s, 'get_weather\n{"city": "北京"}')
    assert events[1:] == [ToolCallDelta(0, '{"city": "北京"}'), ToolCallEvent(ToolCall("get_weather", {"city": "北京"}))]
    assert events[0] == ToolCallStart(0, events[-1].call.id, "get_weather")
    s = ToolCallStream(f4)
    events = _events_by_char(s, "Paris is the capital.")
    # Held only while the first word could still be a tool name.
    assert "".join(e.text for e in events) == "Paris is the capital." and events[0] == TextDelta("Paris i")


def test_stream_malformed_call_becomes_text(f4):
    s = ToolCallStream(f4)
    events = _events_by_char(s, 'get_weather\n{"city": "北')
    # the name went out when "{" showed a call; the arguments never complete, so the call ends as text
    assert events[1:] == [TextDelta('get_weather\n{"city": "北')] and isinstance(events[0], ToolCallStart)
    assert s.errors and s.message.error


def test_stream_push_ids_keeps_assistant_boundary(f3):
    tok, sp = f3.tok, f3.tok.special_ids
    ids = (tok.encode("\n") + tok.encode("好的，我查一下。") + [sp["<|assistant|>"]] + tok.encode("get_weather\n")
           + tok.encode("```python\ntool_call(city='北京')\n```"))
    s = ToolCallStream(f3)
    events = [e for i in ids for e in s.push(i)] + s.close()
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "好的，我查一下。"
    assert events[-1] == ToolCallEvent(ToolCall("get_weather", {"city": "北京"}))
    assert f3.decode_reply(ids + [sp["<|observation|>"]]) == s.message
