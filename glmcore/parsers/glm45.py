"""GLM-4.5 / 4.6 / 4.7 tool calls: XML in the reply, as their chat template writes them and teaches the model:

    <tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>

(GLM-4.7 writes no newlines: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>`.) A value is
the raw string where the tool's parameters schema types that argument "string", else JSON (then a Python
literal, then the raw string: vLLM's glm45/glm47 and mlx-lm's glm47 parsers read values so). Keys and values are
stripped. Several calls may follow each other; text may come before them.

Streaming: the name goes out when it is complete (at the newline or the first tag), then the arguments as JSON
text while the model writes them: a string value character by character, any other value when its
</arg_value> comes. The pieces of a call add up to json.dumps(arguments). A call that is cut off or malformed
goes out as text (the reply's error says why)."""
from __future__ import annotations

import ast
import enum

from ..structured import Grammar, lark_string, regex_terminal, tag_lark
from .base import CallGrammar, Markup, ToolCallParseError, ToolParser, as_json, dumps, load_json

CALL, END, KEY, KEY_END, VALUE, VALUE_END = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                                             "</arg_value>")


def _value(text: str):
    """A non-string value: JSON, else a Python literal, else the text itself (what the model meant)."""
    try:
        return load_json(text)
    except ToolCallParseError:
        pass
    if len(text) < 10000:
        try:
            return ast.literal_eval(text)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
    return text


def _string(schema: dict) -> str:
    """A raw string argument in Lark, as its schema bounds it: an enum, a pattern, a length; else any text."""
    if schema.get("enum"):
        return " | ".join(lark_string(str(v)) for v in schema["enum"])
    if isinstance(schema.get("pattern"), str):
        return regex_terminal(schema["pattern"])
    low, high = schema.get("minLength"), schema.get("maxLength")
    if isinstance(low, int) or isinstance(high, int):
        return f"/(?s:.{{{int(low or 0)},{'' if high is None else int(high)}}})/"
    return "VALUE"


class At(enum.Enum):
    """Where the parser is in a reply."""
    TEXT = "text"          # outside calls
    NAME = "name"          # after <tool_call>: the tool's name
    ARGS = "args"          # between arguments: an <arg_key> or </tool_call> comes next
    KEY = "key"            # inside <arg_key>
    GAP = "gap"            # after </arg_key>: its <arg_value> comes next
    VALUE = "value"        # inside <arg_value>


class XmlCallParser(ToolParser):
    tags = (CALL, END, KEY, KEY_END, VALUE, VALUE_END)

    def __init__(self, functions=None, calls=True):
        super().__init__(functions, calls)
        self._state = At.TEXT
        self._reset_call()

    def _reset_call(self) -> None:
        self._call = ""            # the call's raw text, for the fallback
        self._name = self._key = self._buf = ""
        self._args: dict = {}
        self._string = False       # the value being read is a raw string
        self._vstarted = False     # ...and its first non-space character went out
        self._vheld = ""           # ...trailing whitespace held back

    def string_typed(self, name: str, key: str) -> bool:
        params = (self.functions.get(name) or {}).get("parameters") or {}
        prop = (params.get("properties") or {}).get(key) if isinstance(params, dict) else None
        return isinstance(prop, dict) and prop.get("type") == "string"

    def _take(self, part):
        tag = part if isinstance(part, Markup) else None
        if self._state == At.TEXT:
            if tag == CALL:
                self._state, self._call = At.NAME, str(part)
                return []
            return self.text.emit(part)
        self._call += part
        try:
            return self._in_call(part, tag)
        except ToolCallParseError as e:
            return self._fail(str(e))

    def _in_call(self, part: str, tag: str | None) -> list:
        state = self._state
        if state == At.NAME:
            if tag is None:
                self._buf += part
                if "\n" not in self._buf.lstrip():
                    return []
                name, rest = self._buf.lstrip().split("\n", 1)
                if rest.strip():
                    raise ToolCallParseError(f"text after the tool name {name.strip()!r}")
                return self._named(name)
            events = self._named(self._buf)
            return events + self._in_call(part, tag)
        if state == At.ARGS:
            if tag is None:
                if part.strip():
                    raise ToolCallParseError(f"text {part.strip()[:20]!r} between the arguments of {self._name!r}")
                return []
            if tag == KEY:
                self._state, self._buf = At.KEY, ""
                return []
            if tag == END:
                return self._finish()
            raise ToolCallParseError(f"{tag} where an <arg_key> or </tool_call> belongs")
        if state == At.KEY:
            if tag is None:
                self._buf += part
                return []
            if tag != KEY_END:
                raise ToolCallParseError(f"{tag} inside an argument name")
            self._key, self._state = self._buf.strip(), At.GAP
            if self._key in self._args:
                raise ToolCallParseError(f"argument {self._key!r} given twice")
            return []
        if state == At.GAP:
            if tag is None:
                if part.strip():
                    raise ToolCallParseError(f"text between argument {self._key!r} and its value")
                return []
            if tag != VALUE:
                raise ToolCallParseError(f"{tag} where the value of {self._key!r} belongs")
            self._state, self._buf = At.VALUE, ""
            self._string = self.string_typed(self._name, self._key)
            self._vstarted, self._vheld = False, ""
            head = ("{" if not self._args else ", ") + dumps(self._key) + ": "
            self._args[self._key] = None        # its place in the order
            return self._delta(head + '"') if self._string else self._delta(head)
        # value: up to </arg_value> (a value the model did not close ends at the next <arg_key> or </tool_call>);
        # any other tag in it is its text, as vLLM's `<arg_value>(.*?)</arg_value>` reads it
        if tag in (VALUE_END, KEY, END):
            events = self._value_done()
            self._state = At.ARGS
            return events if tag == VALUE_END else events + self._in_call(part, tag)
        self._buf += part
        return self._string_piece(part) if self._string else []

    def _named(self, name: str) -> list:
        name = name.strip()
        if not self.callable(name):
            raise ToolCallParseError(f"{name[:40]!r} is not a tool of this request" if name else "no tool name")
        self._name, self._state = name, At.ARGS
        return [self._begin(name)]

    def _string_piece(self, text: str) -> list:
        if not self._vstarted:
            text = text.lstrip()
            if not text:
                return []
            self._vstarted = True
        text = self._vheld + text
        body = text.rstrip()
        self._vheld = text[len(body):]
        return self._delta(dumps(body)[1:-1]) if body else []

    def _value_done(self) -> list:
        if self._string:
            self._args[self._key] = self._buf.strip()
            return self._delta('"')
        value = _value(self._buf.strip())
        self._args[self._key] = value
        return self._delta(dumps(value))

    def _finish(self) -> list:
        args = as_json(self._args)
        events = self._delta("}" if self._args else "{}") + [self._complete(self._name, args)]
        self._state = At.TEXT
        self._reset_call()
        self.text.part()
        return events

    def _fail(self, why: str) -> list:
        self.errors.append(f"tool call {self._name or self._buf.strip()[:40]!r}: {why}")
        raw, self._state = self._call, At.TEXT
        self._reset_call()
        return self.text.emit(raw)

    def _end(self):
        if self._state == At.TEXT:
            return []
        return self._fail("the reply ended inside the call (cut off before </tool_call>)")

    def fallback(self) -> str:
        return self.raw.strip()

    # -- constrained decoding
    @classmethod
    def grammar(cls, g):
        """Calls in this format: `tool_choice` required/named (one call or more), strict tools' arguments by
        their schema (string arguments raw, others JSON by their own schema), text beside calls otherwise."""
        tok = g.tok

        def t(tag):
            return tag_lark(tok, tag)
        rules, parts, names = [], {}, []
        functions = {f["name"]: f for f in g.functions}
        for i, name in enumerate(g.must_call or list(functions)):
            schema = g.strict.get(name)
            if schema is None:
                declared = ((functions.get(name) or {}).get("parameters") or {}).get("properties")
                keys = " | ".join(map(lark_string, declared)) if isinstance(declared, dict) and declared else "KEY"
                pair = f'{t(KEY)} ({keys}) {t(KEY_END)} NL? {t(VALUE)} VALUE {t(VALUE_END)} NL?'
                args = f"({pair})*"
            else:
                props = schema.get("properties") or {}
                required = set(schema.get("required") or [])
                items = []
                for j, (key, sub) in enumerate(props.items()):
                    if isinstance(sub, dict) and sub.get("type") == "string":
                        value = f"({_string(sub)})"
                    else:
                        parts[f"a{i}_{j}"] = Grammar.json_schema(sub if isinstance(sub, (dict, bool)) else {})
                        value = f"@a{i}_{j}"
                    item = f'({t(KEY)} {lark_string(key)} {t(KEY_END)} NL? {t(VALUE)} {value} {t(VALUE_END)} NL?)'
                    items.append(item if key in required else item + "?")
                args = " ".join(items) or '""'
            rules.append(f"call{i}: {t(CALL)} {lark_string(name)} NL? {args} {t(END)}")
            names.append(f"call{i}")
        rules.append("call: " + " | ".join(names))
        rules.append('NL: "\\n"\nKEY: /[^\\n]+/\nVALUE: /(?s:.*)/\nTEXT: /(?s:.*)/')
        calls = "NL? call (NL? call)*" if g.parallel else "NL? call"
        if g.must_call:
            body = f"body: {calls}"
        elif g.text is not None:
            parts["text"] = g.text
            body = f"body: @text | {calls}" if functions else "body: @text"
        elif g.strict:
            body = f"body: TEXT ({calls})? NL?"
        else:
            return None
        return CallGrammar("\n".join([body] + rules), parts)
