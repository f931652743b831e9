"""Tool-call parsing and `glmcore chat` under hostile replies and ordinary events (issue 14)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from glmcore.chat import chat_format_for
from glmcore.events import ToolCallEvent
from glmcore.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def formats(make_tiny):
    return {f: chat_format_for(load_tokenizer(make_tiny(f), f)) for f in ("chatglm3", "glm4")}


HOSTILE = [
    ("chatglm3", "tool_call(x=" + "-" * 40 + "1)"),               # RecursionError in ast.unparse before
    ("chatglm3", "tool_call(x=" + "-" * 100000 + "1)"),           # RecursionError in ast.parse
    ("chatglm3", "tool_call(x=" + "[" * 1000 + "]" * 1000 + ")"),
    ("chatglm3", "tool_call(x=" + "9" * 5000 + ")"),
    ("chatglm3", "tool_call(x=b'raw')"),                            # bytes: json.dumps failed later
    ("chatglm3", "tool_call(x={1, 2})"),
    ("chatglm3", "tool_call(x=1j)"),
    ("chatglm3", "tool_call(x=float('nan'))"),
    ("chatglm3", "tool_call(x=1e999)"),
    ("chatglm3", "tool_call(x='\0')"),
    ("glm4", '{"a": ' + "[" * 1000 + "]" * 1000 + "}"),             # RecursionError before
    ("glm4", '{"a": ' + "[" * 100000 + "]" * 100000 + "}"),
    ("glm4", '{"a": ' + "9" * 4400 + "}"),                           # ValueError (int max str digits) before
    ("glm4", '{"a": NaN}'),
]


@pytest.mark.parametrize("family,body", HOSTILE, ids=range(len(HOSTILE)))
def test_an_unparsable_call_is_content_with_error(formats, family, body):
    fmt = formats[family]
    text = "get_weather\n" + (f"```python\n{body}\n```" if family == "chatglm3" else body)
    m = fmt.parse_reply(text)
    assert m.error and not m.tool_calls and m.content
    json.dumps(m.content)


def test_literal_arguments_become_json_values(formats):
    m = formats["chatglm3"].parse_reply("f\n```python\ntool_call(x=(1, 2), y={'k': None}, z=-1.5)\n```")
    assert m.tool_calls[0].arguments == {"x": [1, 2], "y": {"k": None}, "z": -1.5} and not m.error


# ------------------------------------------------------------------ glmcore chat

def _chat(model, script, *extra, cache=None):
    env = {**os.environ, **({"GLMCORE_CACHE": str(cache)} if cache else {})}
    return subprocess.run([sys.executable, "-m", "glmcore.cli", "chat", "--backend", "torch", "--model", str(model),
                           "--max-new-tokens", "4", "--threads", "1", *extra], input=script, capture_output=True,
                          text=True, timeout=300, env=env)


TOOLS = {
    "single object": ({"type": "function", "function": {"name": "get_weather", "parameters": {}}}, None),
    "list of strings": (["get_weather"], "tool type 'str' is not supported"),
    "number": (3, "tools must be a list"),
    "non-function": ([{"type": "retrieval"}], "tool type 'retrieval' is not supported"),
    "no name": ([{"type": "function", "function": {"parameters": {}}}], "no valid function name"),
    "name not a string": ([{"name": 5}], "no valid function name"),
}


def test_tools_are_validated_and_the_session_goes_on(make_tiny, tmp_path):
    script = ""
    for i, (tools, _) in enumerate(TOOLS.values()):
        (tmp_path / f"{i}.json").write_text(json.dumps(tools))
        script += f"/tools {tmp_path / f'{i}.json'}\n"
    script += f"/tools {tmp_path / 'missing.json'}\nhello\n/quit\n"
    p = _chat(make_tiny("chatglm3"), script)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "1 tools loaded: get_weather" in p.stderr
    for _, match in TOOLS.values():
        if match:
            assert f"error: {match}" in p.stderr or match in p.stderr, (match, p.stderr)
    assert "cannot read tools from" in p.stderr and p.stdout.count("assistant> ") == 1


def test_chatglm2_refuses_tools_and_goes_on(make_tiny, tmp_path):
    (tmp_path / "t.json").write_text(json.dumps([{"name": "f"}]))
    p = _chat(make_tiny("chatglm2"), f"/tools {tmp_path / 't.json'}\nhello\n/quit\n")
    assert p.returncode == 0 and "error: ChatGLM2 has no tool calling" in p.stderr and "Traceback" not in p.stderr
    assert p.stdout.count("assistant> ") == 1


def test_ctrl_c_ends_the_reply_not_the_session(make_tiny):
    proc = subprocess.Popen([sys.executable, "-m", "glmcore.cli", "chat", "--backend", "torch", "--model",
                             str(make_tiny("chatglm3")), "--max-new-tokens", "100000", "--overflow", "window",
                             "--ctx", "64", "--threads", "1"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            # an ignored SIGINT is inherited (and Python then keeps it ignored): whatever earlier
                            # in this test process left it so, the chat must get Ctrl-C as a terminal gives it
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        proc.stdin.write(b"hello\n")
        proc.stdin.flush()
        seen = b""
        deadline = time.monotonic() + 120
        while seen.count(b"assistant> ") < 1 or len(seen.split(b"assistant> ", 1)[1]) < 20:
            assert time.monotonic() < deadline, seen
            seen += os.read(proc.stdout.fileno(), 4096)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(b"/quit\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()
    assert b"(reply interrupted)" in err and b"Traceback" not in err, err.decode()


class _FakePipe:
    """Replies with one tool call; records resets."""

    context_full = False

    context_full = False

    def __init__(self):
        from glmcore.chat import Message, ToolCall
        self.resets, self.cached, self.calls = 0, [], 0
        self.reply = Message("assistant", tool_calls=[ToolCall("get_weather", {"city": "x"})])

    def chat(self, messages, **kw):
        self.calls += 1
        self.cached = list(messages) + [self.reply]
        yield ToolCallEvent(self.reply.tool_calls[0])

    def reset(self):
        self.resets += 1

    class timings:
        @staticmethod
        def line():
            return "t"


@pytest.mark.parametrize("answer,goes_on", [("/quit", False), ("/reset", True)])
def test_commands_at_the_tool_result_prompt_are_not_sent_to_the_model(monkeypatch, answer, goes_on):
    from glmcore import cli
    pipe = _FakePipe()
    state = cli.ChatState(None, [{"name": "get_weather"}], [{"role": "user", "content": "hi"}])
    monkeypatch.setattr("builtins.input", lambda prompt="": answer)
    assert cli._chat_turn(pipe, state, None, 4) is goes_on
    assert pipe.calls == 1 and not any(m.get("role") == "tool" for m in state.history if isinstance(m, dict))


@pytest.mark.parametrize("family,body", HOSTILE, ids=range(len(HOSTILE)))
def test_an_unparsable_call_is_refused_whatever_the_recursion_limit(formats, family, body):
    # torch and others raise sys.setrecursionlimit at import: a 1000-deep call once parsed after such an
    # import (a full-suite-only failure); the depth bound must not depend on the interpreter's limit
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)
    try:
        test_an_unparsable_call_is_content_with_error(formats, family, body)
    finally:
        sys.setrecursionlimit(old)


def test_arguments_within_the_depth_bound_still_parse(formats):
    nested = '{"a": ' + "[" * 30 + "]" * 30 + "}"
    m = formats["glm4"].parse_reply("get_weather\n" + nested)
    assert m.tool_calls and not m.error
