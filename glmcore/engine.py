"""One sequence on a single-sequence Session: the scheduler (glmcore/scheduler.py) with one slot.

The Engine is the simple front of the one generation loop: `feed` appends ids under the core's
KV-cache policy, `generate` runs one request through the scheduler. It mirrors the ids its cache holds
(`tokens`), so the window policy can fall back to re-prefilling the kept ids on backends that cannot
shift in place, and a continuation prefills only what is new.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from .backend import Session, SessionAdapter
from .errors import ContextOverflow, GlmcoreError
from .sampling import SamplingParams
from .scheduler import OVERFLOW_POLICIES, Request, Scheduler, Timings, WindowPolicy, make_room

__all__ = ["Engine", "OVERFLOW_POLICIES", "Timings", "WindowPolicy"]


class Engine:
    def __init__(self, session: Session, window: WindowPolicy | None = None, can_shift: bool = False):
        self.session = session
        self.window = window or WindowPolicy()
        self.scheduler = Scheduler(SessionAdapter([session]), can_shift=can_shift)
        self.slot = self.scheduler.slots[0]
        self.pending: int | None = None      # last generated token, not yet fed (see generate)
        self.finish_reason: str | None = None
        self.context_full = False            # the last generate ended because the context was full

    @property
    def capacity(self) -> int:
        return self.session.capacity

    @property
    def tokens(self) -> list[int]:
        """Exactly what the cache holds, in order."""
        return self.slot.tokens

    @property
    def turn_starts(self) -> list[int]:
        return self.slot.turn_starts

    @turn_starts.setter
    def turn_starts(self, starts: Sequence[int]) -> None:
        self.slot.turn_starts = list(starts)

    @property
    def pinned(self) -> int | None:
        """Tokens the window never discards (chat prefix + system turn)."""
        return self.slot.pinned

    @pinned.setter
    def pinned(self, n: int | None) -> None:
        self.slot.pinned = n

    @property
    def shifts(self) -> int:
        return self.slot.shifts

    def reset(self) -> None:
        self.session.reset()
        self.scheduler.batch.reset(0)
        self.slot.tokens, self.slot.turn_starts, self.slot.pinned, self.pending = [], [], None, None

    def feed(self, ids: Sequence[int]) -> np.ndarray:
        """Append ids to the cache, applying the overflow policy; return the last position's logits."""
        ids = list(ids)
        if not ids:
            raise GlmcoreError("nothing to feed: the prompt encodes to zero tokens")
        room = make_room(self.slot, len(ids), self.capacity, self.window)
        if room is None:
            n = len(self.tokens)
            raise ContextOverflow(f"{n + len(ids)} tokens ({n} cached + {len(ids)} new) exceed the context of "
                                  f"{self.capacity}; shorten the prompt, raise --ctx, or use --overflow window")
        if room:
            self.shift(*room)
        logits = self.scheduler.batch.step([(0, ids)])[0]
        self.tokens.extend(ids)
        return logits

    def mark_turn(self, pin: bool = False) -> None:
        """Record that a chat turn starts here. pin=True also keeps everything before it (the
        [gMASK]sop prefix and the system/tools turn) when the window slides."""
        if pin:
            self.pinned = len(self.tokens)
        elif self.tokens and (not self.turn_starts or self.turn_starts[-1] != len(self.tokens)):
            self.turn_starts.append(len(self.tokens))

    def shift(self, n_keep: int, n_discard: int) -> None:
        self.scheduler.shift(self.slot, n_keep, n_discard)

    def generate(self, prompt: Sequence[int], params: SamplingParams, max_new_tokens: int,
                 stop_ids: Sequence[int] = (), n_vocab: int | None = None,
                 timings: Timings | None = None) -> Iterator[int]:
        """Append the prompt, then yield sampled tokens until a stop id, max_new_tokens, or -- under the
        `error` policy -- a full context (finish_reason "length", context_full set). A stop token is not
        fed to the cache (the next chat turn begins with it); any other last token is fed when the
        sequence continues."""
        self.scheduler.n_vocab = n_vocab
        held = list(self.tokens)
        request = Request(held + self.take_pending() + list(prompt), params, max_new_tokens, stop_ids,
                          self.window, turn_starts=list(self.turn_starts), pinned=self.pinned)
        handle = self.scheduler.submit(request)
        self.finish_reason, self.context_full = None, False
        try:
            yield from handle
        finally:
            if not handle.done:
                handle.cancel()
                handle.wait()
            if timings is not None:
                timings.__dict__.update(handle.timings.__dict__)
            self.finish_reason, self.context_full = handle.finish_reason, handle.context_full
            if handle.finish_reason in ("length", "cancelled") and handle.tokens:
                self.pending = handle.tokens[-1]     # sampled, never fed: a continuation feeds it first

    def take_pending(self) -> list[int]:
        """The last generated token when generation stopped on length: it belongs before a continuation."""
        p, self.pending = self.pending, None
        return [] if p is None else [p]
