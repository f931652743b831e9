"""The 2024 reply formats: plain text (ChatGLM2, GLM-Edge), and ChatGLM3's and GLM-4/0414's segments.

A ChatGLM3/GLM-4 reply is segments separated by `<|assistant|>`, each opening with a metadata line: empty for
text, a tool name for a call -- ChatGLM3 `name\\n```python\\ntool_call(k=v, ...)\\n```` (parsed with ast, literals
only), GLM-4 `name\\n{json arguments}` (its process_response). A call's name goes out when its body shows it is
one; its arguments when the segment ends (they are one Python or JSON value, complete only at its end)."""
from __future__ import annotations

import ast
import re

from ..structured import Grammar, lark_string
from .base import (NAME, CallGrammar, Markup, ToolCallParseError, ToolParser, as_json, dumps, load_json)

ASSISTANT = "<|assistant|>"


class PlainParser(ToolParser):
    """A reply that is text only (no tool calls in this format)."""
    json_arguments = False

    def _take(self, part):
        return self.text.emit(part)

    def fallback(self) -> str:
        return self.content


class SegmentParser(ToolParser):
    tags = ends_thinking = (ASSISTANT,)
    opening = "{"       # what a call body starts with

    def __init__(self, functions=None, calls=True):
        super().__init__(functions, calls)
        self.segments: list[str] = []
        self._new_segment()

    def _new_segment(self) -> None:
        self._state = "head"            # head (the metadata line) | text | call
        self._seg = self._meta = self._name = self._body = ""
        self._started = False           # the call's ToolCallStart went out
        self.text.part()

    def _take(self, part):
        if isinstance(part, Markup):
            return self._end_segment() + self._next()
        self._seg += part
        if self._state == "text":
            return self.text.emit(part)
        if self._state == "call":
            self._body += part
            return self._call_progress()
        self._meta += part
        if "\n" in self._meta:
            meta, rest = self._meta.split("\n", 1)
            name = meta.strip()
            if not name:
                self._state = "text"
                return self.text.emit(rest)
            if self.callable(name):
                self._state, self._name, self._body = "call", name, rest
                return self._call_progress()
            self._state = "text"
            return self.text.emit(self._meta)
        if self._meta.strip() and not NAME.fullmatch(self._meta.strip()):
            self._state = "text"            # a tool name is one word: this is text already
            return self.text.emit(self._meta)
        return []

    def _next(self) -> list:
        self._new_segment()
        return []

    def _call_progress(self) -> list:
        body = self._body.lstrip()
        if not self.plausible(body):
            return self._call_to_text()
        if not self._started and self.confirmed(body):
            self._started = True
            return [self._begin(self._name)]
        return []

    def _call_to_text(self) -> list:
        self._state = "text"
        return self.text.emit(self._name + "\n" + self._body)

    def _end_segment(self) -> list:
        events = []
        if self._state == "head" and self._meta.strip():
            self._state = "text"            # ended inside the metadata line: a one-line text reply
            events += self.text.emit(self._meta)
        elif self._state == "call":
            try:
                args = self.parse(self._body)
            except ToolCallParseError as e:
                self.errors.append(f"tool call {self._name!r}: {e}")
                events += self._call_to_text()
            else:
                if not self._started:
                    events.append(self._begin(self._name))
                events += self._delta(dumps(args)) + [self._complete(self._name, args)]
        self.segments.append(self._seg)
        return events

    def _end(self):
        return self._end_segment()

    def fallback(self) -> str:
        """The reply as text, for a reply holding a call that could not be parsed."""
        return "\n".join(s.strip() for s in self.segments if s.strip())

    # -- the format's call body
    def plausible(self, body: str) -> bool:
        """Whether a call body (leading whitespace stripped) can still become a call of this format."""
        raise NotImplementedError

    def confirmed(self, body: str) -> bool:
        """Whether the body is certainly a call (its name can go out)."""
        raise NotImplementedError

    def parse(self, body: str) -> dict:
        raise NotImplementedError

    @staticmethod
    def call_prefix(tok, name: str) -> list[int]:
        """Ids that open a call of `name` right after the generation prompt's <|assistant|> (tool_choice)."""
        return tok.encode(f"{name}\n")

    @classmethod
    def grammar(cls, g):
        """One forced call: its name line goes into the prompt; several names, strict tools or a text grammar
        beside calls: a Lark grammar over segments (`<|assistant|>` between them)."""
        if len(g.must_call) == 1 and not g.after_thought:      # its name line goes into the prompt
            name = g.must_call[0]
            schema = g.strict.get(name)
            return CallGrammar("body: @args" if schema is not None else "body: BODY\nBODY: /(?s:.*)/",
                               {"args": Grammar.json_schema(schema)} if schema is not None else {},
                               cls.call_prefix(g.tok, name))
        if not g.must_call and not g.strict:
            if g.text is None:
                return None
            if not g.functions:                        # text only: the empty metadata line, then the grammar
                return CallGrammar(f"body: {g.space}@text", {"text": g.text}, cls.call_prefix(g.tok, ""))
        alts, parts = [], {}
        for i, name in enumerate(g.must_call or [f["name"] for f in g.functions]):
            if name in g.strict:
                parts[f"args{i}"] = Grammar.json_schema(g.strict[name])
                alts.append(f"{g.space}{lark_string(name + chr(10))} @args{i}")
            else:
                alts.append(f"{g.space}{lark_string(name + chr(10))} BODY")
        if not g.must_call:
            if g.text is not None:
                parts["text"] = g.text
                alts.append(f'{g.space}"\\n" {g.space}@text')
            else:
                alts.append(f'{g.space}"\\n" BODY')
        # after a thought (GLM-Z1: "...</think><|assistant|>name\n{...}") the first segment may open with the mark
        first = "<|assistant|>? " if g.after_thought else ""
        return CallGrammar(f"body: {first}seg (<|assistant|> seg)*\nseg: " + " | ".join(alts) + "\nBODY: /(?s:.*)/",
                           parts)


class ChatGLM3Parser(SegmentParser):
    json_arguments = False      # Python literals: strict tools cannot be constrained as JSON

    def plausible(self, body):
        return any(body[:len(p)] == p[:len(body)] for p in ("```", "tool_call("))

    def confirmed(self, body):
        return body.startswith("```") or body.startswith("tool_call(")

    def parse(self, body):
        return parse_chatglm3_call(body)


class GLM4Parser(SegmentParser):
    def plausible(self, body):
        # GLM-4 arguments start right after the name line with "{" (its process_response)
        return not body or body.startswith("{")

    def confirmed(self, body):
        return body.startswith("{")

    def parse(self, body):
        return parse_glm4_call(body)


def parse_chatglm3_call(body: str) -> dict:
    """Arguments of ChatGLM3's "```python\\ntool_call(k=v, ...)\\n```" without eval: the call is
    parsed with ast and each keyword value read with ast.literal_eval (literals only)."""
    code = body.strip()
    m = re.fullmatch(r"```[\w+-]*[ \t]*\n?(.*?)\n?[ \t]*```", code, re.S)
    if m:
        code = m.group(1).strip()
    try:
        tree = ast.parse(code, mode="eval")
    except SyntaxError as e:
        raise ToolCallParseError(f"tool call is not valid Python: {e.msg} (line {e.lineno})") from None
    except (RecursionError, MemoryError, ValueError):     # deeply nested input; ValueError: NUL bytes
        raise ToolCallParseError("tool call is nested too deeply to parse") from None
    call = tree.body
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "tool_call"):
        raise ToolCallParseError("expected a single tool_call(...) expression")
    if call.args:
        raise ToolCallParseError("tool_call takes keyword arguments only")
    args = {}
    for kw in call.keywords:
        if kw.arg is None:
            raise ToolCallParseError("tool_call(**kwargs) is not allowed")
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise ToolCallParseError(f"argument {kw.arg!r} is not a literal") from None
    return as_json(args)


def parse_glm4_call(body: str) -> dict:
    args = load_json(body)
    if not isinstance(args, dict):
        raise ToolCallParseError("tool call arguments must be a JSON object")
    return as_json(args)
