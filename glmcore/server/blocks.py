"""A reply as a sequence of blocks -- its thought, its text, each tool call -- each opened, grown and closed in
order: the shape both the Responses API (output items) and Anthropic's Messages API (content blocks) give a reply,
streamed and whole. One place turns the chat layer's events into it; each API only names the blocks its way."""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from ..events import ChatEvent, ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEvent, ToolCallStart


class Kind(enum.Enum):
    REASONING = "reasoning"
    TEXT = "text"
    CALL = "call"


@dataclass
class Block:
    kind: Kind
    index: int              # its place among the reply's blocks
    text: str = ""          # the thought, the text, or the call's arguments as JSON text so far
    call_id: str = ""       # a call's id and function name
    name: str = ""
    id: str = ""            # the API's own id for it (a Responses item id), set when it opens


class Op(enum.Enum):
    OPEN = "open"
    DELTA = "delta"
    CLOSE = "close"


@dataclass(frozen=True)
class Step:
    op: Op
    block: Block
    delta: str = ""


class Blocks:
    """Turns a reply's events into Steps: a block opens when its first piece arrives, and closes when a block of
    another kind (or another call) starts, when its call is complete, or at close()."""

    def __init__(self):
        self.blocks: list[Block] = []
        self.current: Block | None = None

    def _open(self, kind: Kind, **kw) -> list[Step]:
        steps = self._close()
        self.current = Block(kind, len(self.blocks), **kw)
        self.blocks.append(self.current)
        return steps + [Step(Op.OPEN, self.current)]

    def _close(self) -> list[Step]:
        block, self.current = self.current, None
        return [Step(Op.CLOSE, block)] if block is not None else []

    def push(self, event: ChatEvent) -> list[Step]:
        if isinstance(event, (TextDelta, ReasoningDelta)):
            kind = Kind.TEXT if isinstance(event, TextDelta) else Kind.REASONING
            steps = [] if self.current is not None and self.current.kind == kind else self._open(kind)
            self.current.text += event.text
            return steps + [Step(Op.DELTA, self.current, event.text)]
        if isinstance(event, ToolCallStart):
            return self._open(Kind.CALL, call_id=event.id, name=event.name)
        if isinstance(event, ToolCallDelta) and self.current is not None and self.current.kind == Kind.CALL:
            self.current.text += event.arguments
            return [Step(Op.DELTA, self.current, event.arguments)]
        if isinstance(event, ToolCallEvent) and self.current is not None and self.current.kind == Kind.CALL:
            self.current.text = arguments_json(event.call.arguments)    # what the deltas added up to
            return self._close()
        return []

    def close(self) -> list[Step]:
        return self._close()


def arguments_json(arguments: dict) -> str:
    return json.dumps(arguments, ensure_ascii=False)


def reply_blocks(reply) -> list[Block]:
    """A finished reply's blocks (an exchange.Reply: its thought, its text, its calls), for a response sent whole."""
    out = []
    if reply.reasoning:
        out.append(Block(Kind.REASONING, len(out), reply.reasoning))
    if reply.content:
        out.append(Block(Kind.TEXT, len(out), reply.content))
    for call in reply.calls:
        out.append(Block(Kind.CALL, len(out), arguments_json(call.arguments), call.id, call.name))
    return out
