"""What every reply parser shares: the Markup of special tokens, a lexer that finds a format's tags, the base of
the tool parsers, and parsing of JSON arguments without eval or unbounded nesting."""
from __future__ import annotations

import json
import re
import uuid

import numpy as np

from ..events import TextDelta, ToolCall, ToolCallDelta, ToolCallEvent, ToolCallStart

NAME = re.compile(r"[A-Za-z_][\w.\-]*")   # what a tool name can look like


class Markup(str):
    """The text of a special token the model generated (not text that spells it): fed by a composer that reads
    token ids, so that a reply's "</arg_value>" typed as plain text stays text where the tag is a special token."""


def partial_tail(text: str, tags) -> int:
    """How many characters at the end of `text` may be the start of one of `tags` (held until more text comes)."""
    return max((k for tag in tags for k in range(min(len(tag) - 1, len(text)), 0, -1)
                if tag.startswith(text[-k:])), default=0)


class TagLexer:
    """Splits fed pieces into text and tags. A Markup piece is a tag as it is; in plain text the tags of
    `text_tags` are found (every tag when the reply comes as text; only those that are no special token of the
    tokenizer when it comes as ids), holding back a tail that may be the start of one."""

    def __init__(self, tags):
        self.tags = tuple(tags)
        self.text_tags = self.tags
        self._held = ""

    def feed(self, piece: str) -> list[str]:
        """Text pieces (str) and tags (Markup), in order."""
        if isinstance(piece, Markup):
            out = self.flush()
            return out + ([Markup(piece)] if piece in self.tags else [str(piece)])
        text, out = self._held + piece, []
        while True:
            hits = [(i, t) for t in self.text_tags if (i := text.find(t)) >= 0]
            if not hits:
                break
            i, tag = min(hits)
            if i:
                out.append(text[:i])
            out.append(Markup(tag))
            text = text[i + len(tag):]
        keep = partial_tail(text, self.text_tags)
        self._held = text[len(text) - keep:] if keep else ""
        if len(text) > keep:
            out.append(text[:len(text) - keep])
        return out

    def flush(self) -> list[str]:
        held, self._held = self._held, ""
        return [held] if held else []


class TextOut:
    """Answer text as the original chat() gave it: stripped at both ends (trailing whitespace is held until more
    text follows), a later text part on a new line."""

    def __init__(self):
        self.content = ""
        self._held = ""
        self._started = False

    def part(self) -> None:
        """What follows is a new part of the text (after a tool call, a new segment)."""
        self._started = False
        self._held = ""

    def emit(self, text: str) -> list[TextDelta]:
        if not self._started:
            text = text.lstrip()
            if not text:
                return []
            self._started = True
            if self.content:
                text = "\n" + text
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body):]
        if not body:
            return []
        self.content += body
        return [TextDelta(body)]


class ToolParser:
    """One reply format's tool calls. feed(piece) -> events (TextDelta, ToolCallStart, ToolCallDelta,
    ToolCallEvent), close() -> the last ones; pieces are text, or Markup where a composer read a special token.
    After close(): `calls`, `errors` (a call that could not be parsed went out as text), `raw` (everything fed).

    functions: the request's function dicts (None: any name is a call); calls=False: every reply is text."""

    tags: tuple[str, ...] = ()      # the markup of this format
    json_arguments = True            # arguments are JSON values (strict tools can be constrained)
    ends_thinking: tuple[str, ...] = ()   # tags that close a thought left open (a new segment)

    def __init__(self, functions: list[dict] | None = None, calls: bool = True):
        self.functions = {f["name"]: f for f in functions or []}
        self.names = set() if not calls else set(self.functions) if functions else None
        self.lexer = TagLexer(self.tags)
        self.text = TextOut()
        self.calls: list[ToolCall] = []
        self.errors: list[str] = []
        self.raw = ""
        self._ids: list[str] = []

    @property
    def content(self) -> str:
        return self.text.content

    def callable(self, name: str) -> bool:
        return bool(NAME.fullmatch(name)) and (self.names is None or name in self.names)

    def feed(self, piece: str) -> list:
        self.raw += piece
        events = []
        for part in self.lexer.feed(piece):
            events += self._take(part)
        return events

    def close(self) -> list:
        events = []
        for part in self.lexer.flush():
            events += self._take(part)
        return events + self._end()

    # -- the format's own
    def _take(self, part: str) -> list:
        raise NotImplementedError

    def _end(self) -> list:
        return []

    # -- calls
    def _begin(self, name: str) -> ToolCallStart:
        self._ids.append(f"call_{uuid.uuid4().hex[:24]}")
        return ToolCallStart(len(self._ids) - 1, self._ids[-1], name)

    def _delta(self, text: str) -> list:
        return [ToolCallDelta(len(self._ids) - 1, text)] if text else []

    def _complete(self, name: str, arguments: dict) -> ToolCallEvent:
        call = ToolCall(name, arguments, id=self._ids[-1])
        self.calls.append(call)
        return ToolCallEvent(call, len(self._ids) - 1)

    # -- constrained decoding
    @classmethod
    def grammar(cls, g) -> "CallGrammar | None":
        """The Lark rules a reply in this format must match; g: a GrammarRequest (glmcore.structured)."""
        return None


class CallGrammar:
    """A reply's grammar in a format: ids forced into the prompt, Lark rules (rule `body` the reply after any
    thinking), and named sub-grammars (glmcore.structured.Grammar) they reference as @name."""

    def __init__(self, rules: str, parts: dict | None = None, opening: list[int] | None = None):
        self.rules, self.parts, self.opening = rules, parts or {}, opening or []


# ----------------------------------------------------------------------------- JSON arguments

class ToolCallParseError(ValueError):
    pass


MAX_ARGUMENT_DEPTH = 32        # tool call arguments (and the server's tool schemas): far beyond any real one
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')       # a JSON string, unrolled (no per-character branching)
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))     # UTF-8 continuation bytes are never brackets


def json_depth(text: str) -> int:
    """The deepest nesting of [ and { in JSON text (strings skipped), without parsing it: C-speed regex and
    numpy, so megabytes cost milliseconds and no recursion limit is involved."""
    brackets = _STRING.sub("", text).encode("utf-8", "surrogatepass").translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    steps = np.frombuffer(brackets, np.uint8)
    return int(np.cumsum(np.where((steps == 91) | (steps == 123), 1, -1), dtype=np.int64).max())


def load_json(text: str):
    """A JSON value, its depth bounded before json.loads (whose limit is the interpreter's, which varies);
    ToolCallParseError if it is none."""
    if json_depth(text) > MAX_ARGUMENT_DEPTH:
        raise ToolCallParseError(f"tool call arguments are nested deeper than {MAX_ARGUMENT_DEPTH} levels")
    try:
        return json.loads(text.strip())
    except json.JSONDecodeError as e:
        raise ToolCallParseError(f"tool call arguments are not valid JSON: {e}") from None
    except (RecursionError, MemoryError, ValueError):      # nesting, or an integer past int max str digits
        raise ToolCallParseError("tool call arguments are nested too deeply or hold a too-long number") from None


def as_json(args: dict) -> dict:
    """Arguments exactly as JSON can carry them (what a caller will json.dumps): no bytes, sets,
    complex numbers, NaN, numbers too long to print, or nesting deeper than MAX_ARGUMENT_DEPTH."""
    try:
        text = json.dumps(args, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError, MemoryError) as e:
        raise ToolCallParseError(f"tool call arguments are not JSON values ({type(e).__name__})") from None
    # an explicit bound: how deep json.dumps/loads can go depends on sys.getrecursionlimit(), which other
    # libraries raise -- the same reply must parse the same way in every process
    if json_depth(text) > MAX_ARGUMENT_DEPTH:
        raise ToolCallParseError(f"tool call arguments are nested deeper than {MAX_ARGUMENT_DEPTH} levels")
    return json.loads(text)


def dumps(value) -> str:
    """JSON text of arguments as the server sends them (and as ToolCallDeltas add up to)."""
    return json.dumps(value, ensure_ascii=False)
