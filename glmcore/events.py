"""Typed events out of the generation loop and the chat layer (never tuples or strings).

The chat layer turns a reply's tokens into a stream of `ChatEvent`s; a request ends with a
`FinishReason`. FinishReason is a str enum so it serialises as the OpenAI value it names.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
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
    id: str = ""


@dataclass(frozen=True)
class ToolCallEvent:
    """One complete, parsed tool call."""
    call: ToolCall


ChatEvent = Union[TextDelta, ReasoningDelta, ToolCallEvent]
