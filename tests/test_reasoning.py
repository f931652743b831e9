"""Thinking (GLM-Z1): <think>...</think> split from the answer while streaming -- the splitter, the chat layer's
events and Message.reasoning, the next turn's prompt without earlier thinking, chat_template_kwargs, and over
HTTP reasoning_content (vLLM's reasoning-parser fields) through the openai client. GLM-4-0414's own tool-call
format (a segment "<|assistant|>name\\n{json}") streams like GLM-4's, after thinking too.

The model is scripted (its reply is fixed token by token); the checkpoint is the synthetic glm4-0414 tiny with
GLM-Z1's template (glmcore.hf_tokenizer.GLM_Z1_TEMPLATE: "<|assistant|>\\n<think>" opens every reply)."""
import json
import shutil

import numpy as np
import pytest

from glmcore.backend import Backend, Capabilities, Probe, Session, hookimpl, registry
from glmcore.chat import Message, ToolCall, ToolCallStream, chat_format_for
from glmcore.errors import ChatError
from glmcore.events import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEvent, ToolCallStart
from glmcore.hf_tokenizer import GLM_Z1_TEMPLATE
from glmcore.pipeline import Pipeline
from glmcore.parsers.reasoning import ThinkSplitter, split_reasoning
from glmcore.sampling import SamplingParams
from glmcore.tokenizer import load_tokenizer

GREEDY = SamplingParams(temperature=0)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
# GLM-Z1's template with a switch as GLM-4.5's has one: enable_thinking=false writes an empty thought instead
SWITCH_TEMPLATE = GLM_Z1_TEMPLATE.replace(
    "<|assistant|>\n<think>{% endif %}",
    "<|assistant|>\n{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>"
    "{% endif %}{% endif %}")


def _with_template(src, dst, template):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    return dst


@pytest.fixture(scope="module")
def z1(make_tiny, tmp_path_factory):
    return _with_template(make_tiny("glm4-0414"), tmp_path_factory.mktemp("z1") / "m", GLM_Z1_TEMPLATE)


# ----------------------------------------------------------------------------- the splitter

@pytest.mark.parametrize("text,opened,want", [
    ("<think>a plan</think>\n\nthe answer", False, ("a plan", "\n\nthe answer")),
    ("\n  <think>x</think>y", False, ("x", "y")),
    ("no thinking at all", False, ("", "no thinking at all")),
    ("<thi", False, ("", "<thi")),                             # a lone part of a tag stays text
    ("a < b and <think> later", False, ("", "a < b and <think> later")),   # only an opening <think> counts
    ("\nreasoning</think>answer", True, ("\nreasoning", "answer")),        # the prompt wrote <think>
    ("<think>reasoning</think>answer", True, ("reasoning", "answer")),     # ... and the model repeated it
    ("cut by max_tokens", True, ("cut by max_tokens", "")),                # never closed: all thinking
])
def test_split_at_every_boundary(text, opened, want):
    assert split_reasoning(text, opened) == want
    rng = np.random.default_rng(0)
    for trial in range(30):             # any split into pieces gives the same parts, in order
        cuts = sorted(set(rng.integers(0, len(text) + 1, size=int(rng.integers(1, 6))).tolist()))
        s = ThinkSplitter(opened)
        parts = []
        for a, b in zip([0] + cuts, cuts + [len(text)]):
            parts += s.feed(text[a:b])
        parts += s.close()
        got = ("".join(t for k, t in parts if k == "reasoning"), "".join(t for k, t in parts if k == "answer"))
        assert got == want, (trial, cuts)


def test_no_tag_text_is_held_longer_than_a_tag():
    s = ThinkSplitter(opened=True)
    assert s.feed("thinking hard </th") == [("reasoning", "thinking hard ")]
    assert s.feed("ink>ok") == [("answer", "ok")] and not s.thinking


# ----------------------------------------------------------------------------- the chat layer

def _events(fmt, text, tools=None):
    stream = ToolCallStream(fmt, tools)
    events = []
    ids = fmt.tok.encode_rendered(text) if hasattr(fmt.tok, "encode_rendered") else fmt.tok.encode(text)
    for i in ids:                       # "<|assistant|>" as the special token the model emits
        events += stream.push(i)
    return events + stream.close(), stream.message


def test_z1_reply_streams_reasoning_then_answer(z1):
    fmt = chat_format_for(load_tokenizer(z1, "glm4-0414"))
    assert fmt.thinking and fmt.opens_thinking and fmt.render([{"role": "user", "content": "q"}]).endswith(
        "<|assistant|>\n<think>")
    events, msg = _events(fmt, "\nOne and one.\nThat is two.\n</think>\n\nIt is 2.")
    kinds = [type(e) for e in events]
    assert kinds == sorted(kinds, key=lambda k: k is TextDelta)          # all thinking comes first
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == "One and one.\nThat is two."
    assert msg == Message("assistant", "It is 2.", reasoning="One and one.\nThat is two.")


@pytest.mark.parametrize("call", ['get_weather\n{"city": "北京"}', 'get_weather \n{"city": "北京"}'])
def test_glm4_0414_tool_calls_stream_after_thinking(make_tiny, z1, call):
    # GLM-4-0414 writes a call as "<|assistant|>name\n{json}" (its template renders metadata "name \n")
    plain = chat_format_for(load_tokenizer(make_tiny("glm4-0414"), "glm4-0414"))
    assert not plain.thinking
    events, msg = _events(plain, call, TOOLS)
    events = [e for e in events if isinstance(e, ToolCallEvent)]      # after its ToolCallStart and ToolCallDelta
    assert events == [ToolCallEvent(ToolCall("get_weather", {"city": "北京"}))] and msg.content == ""
    fmt = chat_format_for(load_tokenizer(z1, "glm4-0414"))
    events, msg = _events(fmt, "I should look it up.</think><|assistant|>" + call, TOOLS)
    assert "".join(e.text for e in events[:-3]) == "I should look it up."
    assert all(isinstance(e, ReasoningDelta) for e in events[:-3])
    assert [type(e) for e in events[-3:]] == [ToolCallStart, ToolCallDelta, ToolCallEvent]
    assert events[-1] == ToolCallEvent(ToolCall("get_weather", {"city": "北京"}))
    assert msg.reasoning == "I should look it up." and msg.tool_calls[0].arguments == {"city": "北京"}
    # an unparsable call is text with .error, never evaluated; the thinking stays apart
    events, msg = _events(fmt, "hmm</think><|assistant|>get_weather\n{'city': __import__('os')}", TOOLS)
    assert msg.error and not msg.tool_calls and msg.reasoning == "hmm" and "__import__" in msg.content


def test_native_formats_do_not_split(make_tiny):
    fmt = chat_format_for(load_tokenizer(make_tiny("glm4"), "glm4"))
    events, msg = _events(fmt, "\n<think>literal</think> text")
    assert not any(isinstance(e, ReasoningDelta) for e in events) and msg.content == "<think>literal</think> text"


def test_chat_template_kwargs(z1, make_tiny, tmp_path):
    fmt = chat_format_for(load_tokenizer(z1, "glm4-0414"))
    with pytest.raises(ChatError, match="always thinks"):
        fmt.configured({"enable_thinking": False})
    with pytest.raises(ChatError, match="cannot set add_generation_prompt"):
        fmt.configured({"add_generation_prompt": False})
    assert fmt.configured({"enable_thinking": True}).opens_thinking
    native = chat_format_for(load_tokenizer(make_tiny("glm4"), "glm4"))
    assert native.configured({"enable_thinking": False}) is native     # GLM-4-9B-chat never thinks
    with pytest.raises(ChatError, match="native format"):
        native.configured({"foo": 1})
    switch = chat_format_for(load_tokenizer(_with_template(z1, tmp_path / "s", SWITCH_TEMPLATE), "glm4-0414"))
    off = switch.configured({"enable_thinking": False})
    assert switch.opens_thinking and not off.opens_thinking and switch.variables == {}
    assert off.render([{"role": "user", "content": "q"}]).endswith("<think></think>")
    events, msg = _events(off, "\nplain answer")
    assert msg == Message("assistant", "plain answer") and not any(isinstance(e, ReasoningDelta) for e in events)


# ----------------------------------------------------------------------------- the Pipeline, scripted

class ScriptedSession(Session):
    """Logits one-hot on the backend's scripted reply: its first id after a prefill, the k-th after k decodes
    (so a prompt prefilled in several calls, or a stop token fed later, never shifts the reply)."""

    def __init__(self, backend, vocab):
        self.backend, self.vocab, self.capacity, self.held, self.k = backend, vocab, 4096, [], 0

    @property
    def kv_len(self):
        return len(self.held)

    def _logits(self):
        logits = np.zeros(self.vocab, np.float32)
        script = self.backend.script
        logits[script[self.k] if self.k < len(script) else 0] = 50.0
        return logits

    def prefill(self, ids, all_logits=False):
        self.held += list(ids)
        self.k = 0
        self.backend.prompts.append(list(self.held))
        return self._logits()

    def decode(self, token):
        self.held.append(token)
        self.k += 1
        return self._logits()

    def reset(self):
        self.held = []

    def fork(self):
        return ScriptedSession(self.backend, self.vocab)


class ThinkingBackend(Backend):
    name = "scripted-thinking"

    def __init__(self):
        self.script, self.prompts = [], []

    def probe(self):
        return Probe(True, device="none (test double)")

    def capabilities(self):
        return Capabilities(speed_rank=-100)

    def supports(self, config):
        return None          # a scripted double: it runs any checkpoint's ids

    def load(self, config, weights, options):
        return ScriptedSession(self, config.vocab_size)


BACKEND = ThinkingBackend()


@hookimpl
def glmcore_backends():
    return [BACKEND]


@pytest.fixture(scope="module", autouse=True)
def _register():
    import sys
    registry().register(sys.modules[__name__], "scripted-thinking-test")


def _script(tok, text, stop="<|user|>"):
    BACKEND.script[:] = tok.encode_rendered(text) + [tok.special_ids[stop]]


def test_pipeline_streams_thinking_and_drops_it_next_turn(z1):
    pipe = Pipeline(z1, backend="scripted-thinking")
    tok, fmt = pipe.tokenizer, pipe.model.chat_format
    _script(tok, "\nThe user greets me.\n</think>\n\nHello!")
    history = [{"role": "user", "content": "hi"}]
    events = list(pipe.chat(history, stream=True, params=GREEDY))
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == "The user greets me."
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Hello!"
    reply = pipe.cached[-1]
    assert reply.reasoning == "The user greets me." and reply.content == "Hello!"

    _script(tok, "\nAgain.\n</think>\n\nStill here.")
    history += [reply, {"role": "user", "content": "still there?"}]
    assert pipe.chat(history, params=GREEDY).content == "Still here."
    # Z1's template rewrites earlier replies (their thinking dropped): the whole prompt was built again, and is
    # exactly the template's rendering of the conversation, without the first turn's thinking
    prompt = tok.decode(BACKEND.prompts[-1], skip_special=False)
    assert BACKEND.prompts[-1] == fmt.encode_messages(history)
    assert "greets" not in prompt and "<|assistant|>\nHello!<|user|>\nstill there?<|assistant|>\n<think>" in prompt
    with pytest.raises(ChatError, match="always thinks"):
        pipe.chat(history, params=GREEDY, template_kwargs={"enable_thinking": False})


def test_pipeline_enable_thinking_off_where_the_template_has_the_switch(z1, tmp_path):
    pipe = Pipeline(_with_template(z1, tmp_path / "s", SWITCH_TEMPLATE), backend="scripted-thinking")
    _script(pipe.tokenizer, "\nJust the answer.")
    reply = pipe.chat([{"role": "user", "content": "hi"}], params=GREEDY, template_kwargs={"enable_thinking": False})
    assert reply == Message("assistant", "Just the answer.")
    assert pipe.tokenizer.decode(BACKEND.prompts[-1], skip_special=False).endswith("<think></think>")


# ----------------------------------------------------------------------------- over HTTP

openai = pytest.importorskip("openai", reason="the server tests need the dev extra (openai, httpx)")


@pytest.fixture(scope="module")
def z1_server(z1):
    pytest.importorskip("uvicorn", reason='the server needs its extra: pip install "glmcore[server]"')
    from glmcore.model import load_model
    from test_server import client, serving
    m = load_model(z1, "scripted-thinking", slots=1)
    try:
        with serving(m, "z1") as url:
            yield m, client(url), url
    finally:
        m.close()


def test_serve_streams_reasoning_content(z1_server):
    m, c, _ = z1_server
    _script(m.tokenizer, "\nTwo apples and one more.\n</think>\n\nThree.")
    chunks = list(c.chat.completions.create(model="z1", messages=[{"role": "user", "content": "2+1 apples?"}],
                                           stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    thought = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    answer = "".join(d.content or "" for d in deltas)
    assert thought == "Two apples and one more." and answer == "Three."
    first_answer = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not getattr(d, "reasoning_content", None) for d in deltas[first_answer:])
    assert chunks[-1].choices[0].finish_reason == "stop"

    _script(m.tokenizer, "\nShort.\n</think>\n\nOK.")
    r = c.chat.completions.create(model="z1", messages=[{"role": "user", "content": "x"}])
    assert r.choices[0].message.content == "OK." and r.choices[0].message.reasoning_content == "Short."
    # the reply sent back with its reasoning_content is accepted; Z1's template drops that thinking
    _script(m.tokenizer, "\nT.\n</think>\n\nFine.")
    r = c.chat.completions.create(model="z1", messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "OK.", "reasoning_content": "Short."},
        {"role": "user", "content": "y"}])
    assert r.choices[0].message.content == "Fine."
    assert "Short." not in m.tokenizer.decode(BACKEND.prompts[-1], skip_special=False)


def test_serve_tool_call_after_thinking_and_enable_thinking(z1_server):
    m, c, _ = z1_server
    _script(m.tokenizer, "Need the weather.</think><|assistant|>get_weather\n{\"city\": \"北京\"}", "<|observation|>")
    chunks = list(c.chat.completions.create(model="z1", messages=[{"role": "user", "content": "北京天气"}],
                                           tools=TOOLS, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Need the weather."
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert calls[0].function.name == "get_weather"
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"city": "北京"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    with pytest.raises(openai.BadRequestError, match="always thinks"):
        c.chat.completions.create(model="z1", messages=[{"role": "user", "content": "x"}],
                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})


# ----------------------------------------------------------------------------- glmcore run / chat

@pytest.mark.parametrize("show,tty,want", [
    (False, False, "Hello!\n"),                                             # hidden; a pipe gets the answer only
    (True, False, "<think>\nThe user greets me.\n</think>\n\nHello!\n"),   # a script can strip the tags
    (True, True, "\x1b[2mThe user greets me.\x1b[0m\n\nHello!\n"),        # dimmed
    (False, True, "\x1b[2mthinking...\x1b[0m\x1b[11D\x1b[KHello!\n"),     # a mark while it thinks, then erased
])
def test_cli_shows_or_hides_thinking(z1, capsys, show, tty, want):
    from glmcore import cli
    pipe = Pipeline(z1, backend="scripted-thinking")
    _script(pipe.tokenizer, "\nThe user greets me.\n</think>\n\nHello!")
    cli._stream_reply(pipe, [{"role": "user", "content": "hi"}], None, GREEDY, 32, view=cli.ThinkingView(show, tty))
    assert capsys.readouterr().out == want
    args = cli.build_parser().parse_args(["run", "--model", str(z1), "--prompt", "x", "--no-thinking"])
    with pytest.raises(ChatError, match="always thinks"):
        cli._stream_reply(pipe, [{"role": "user", "content": "x"}], None, GREEDY, 8,
                          template_kwargs=cli.template_kwargs(args))
