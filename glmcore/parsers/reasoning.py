"""Thinking in a reasoning model's reply (GLM-Z1): `<think>...</think>` split from the answer while it streams.

A reply is thinking when it opens with `<think>` (leading whitespace aside), or from its first token when the
prompt already ends with `<think>` (GLM-Z1's template writes "<|assistant|>\\n<think>": its replies hold only
"...</think>answer"). Thinking ends at `</think>`; a reply that never closes it is all thinking (it was cut by
max_tokens), as vLLM's reasoning parsers read it. Text that only may be the start of a tag is held back until
the next piece decides it, so no tag leaks into either part and nothing waits longer than a tag's length.
"""
from __future__ import annotations

from .base import Markup, partial_tail

OPEN, CLOSE = "<think>", "</think>"


class ThinkSplitter:
    """feed(text) -> [(kind, text)] with kind "reasoning" or "answer", in order; close() flushes what is held."""

    def __init__(self, opened: bool = False):
        # start: nothing but whitespace seen | think: inside <think> | answer: everything else passes through
        self.state = "think" if opened else "start"
        self._held = ""
        self._fresh = opened        # right after an <think> the prompt wrote: a repeated <think> is dropped

    @property
    def thinking(self) -> bool:
        return self.state == "think"

    def feed(self, text: str) -> list[tuple[str, str]]:
        if self.state == "answer":
            return [("answer", text)] if text else []
        self._held += text
        out: list[tuple[str, str]] = []
        if self.state == "start":
            body = self._held.lstrip()
            if body.startswith(OPEN):
                self.state, self._held, self._fresh = "think", body[len(OPEN):], False
            elif OPEN.startswith(body):
                return []               # only whitespace, or a part of "<think>" so far
            else:
                self.state, held, self._held = "answer", self._held[:len(self._held) - len(text)], ""
                # a special token's Markup goes on as its own piece (its type tells the tool parser it is one)
                return [("answer", p) for p in (held, text) if p] if isinstance(text, Markup) else [("answer", held + text)]
        if self._fresh:
            body = self._held.lstrip()
            if OPEN.startswith(body) and len(body) < len(OPEN):
                return []
            self._fresh = False
            if body.startswith(OPEN):   # the model wrote the <think> the prompt already holds
                self._held = body[len(OPEN):]
        if CLOSE in self._held:
            thought, rest = self._held.split(CLOSE, 1)
            self.state, self._held = "answer", ""
            if thought:
                out.append(("reasoning", thought))
            if rest:
                out.append(("answer", rest))
            return out
        keep = partial_tail(self._held, (CLOSE,))
        ready, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        return out + ([("reasoning", ready)] if ready else [])

    def close(self) -> list[tuple[str, str]]:
        """The reply ended: held text is thinking inside <think>, else answer (a lone "<thi" is text)."""
        held, self._held = self._held, ""
        kind = "reasoning" if self.state == "think" else "answer"
        self.state = "answer"
        return [(kind, held)] if held else []


def split_reasoning(text: str, opened: bool = False) -> tuple[str, str]:
    """(reasoning, answer) of a whole reply."""
    s = ThinkSplitter(opened)
    parts = s.feed(text) + s.close()
    return ("".join(t for k, t in parts if k == "reasoning"), "".join(t for k, t in parts if k == "answer"))
