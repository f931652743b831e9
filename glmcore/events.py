"""Typed events out of the generation loop and the chat layer (never tuples or strings).

The chat layer turns a reply's tokens into a stream of `ChatEvent`s; a request ends with a
`FinishReason`. FinishReason is a str enum so it serialises as the OpenAI value it names.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Union


class FinishReason(str, enum.Enum):
    STOP = "stop"              # a stop token or stop string
    LENGTH = "length"          # max_tokens, or the context is full
    TOOL_CALLS = "tool_calls"  # the reply ended in tool calls (OpenAI's value)
    CANCELLED = "cancelled"    # the client went away or asked to stop
    ERROR = "error"            # the backend failed on this request

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TextDelta:
    """Answer text that is certain (it will not turn out to be part of a tool call)."""
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """Thinking text (a `<think>...</think>` span of a reasoning model's reply)."""
    text: str


@dataclass
class ToolCall:
    """A function call the model made: its name and JSON arguments (the server gives it an id)."""
    name: str
    arguments: dict
    id: str = field(default="", compare=False)     # who answers it, not what it asks


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call's name is complete: the call is number `index` of the reply, with its `id` for good."""
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    """The next piece of call `index`'s arguments as JSON text, as the model writes them; the pieces of a
    call concatenate to json.dumps(call.arguments, ensure_ascii=False)."""
    index: int
    arguments: str


@dataclass(frozen=True)
class ToolCallEvent:
    """One complete, parsed tool call (after its ToolCallStart and ToolCallDeltas)."""
    call: ToolCall
    index: int = 0


ChatEvent = Union[TextDelta, ReasoningDelta, ToolCallStart, ToolCallDelta, ToolCallEvent]
