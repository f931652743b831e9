"""The generation loop and the core's KV-cache policy, on top of any backend Session.

The Engine mirrors the token ids the cache holds, so the `window` policy can fall back to
re-prefilling the kept tokens on backends that cannot shift their cache in place.
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .backend import Session
from .errors import ContextOverflow, GlmcoreError
from .sampling import Sampler, SamplingParams

OVERFLOW_POLICIES = ("error", "window")


@dataclass
class WindowPolicy:
    """What to do when the cache is full. `window` is StreamingLLM: keep the first n_keep tokens as
    attention sinks and discard n_discard after them (default: half of the rest, as llama.cpp)."""
    policy: str = "error"
    n_keep: int = 4
    n_discard: int | None = None

    def __post_init__(self):
        if self.policy not in OVERFLOW_POLICIES:
            raise GlmcoreError(f"unknown overflow policy {self.policy!r}; choose error or window")
        if self.n_keep < 0 or (self.n_discard is not None and self.n_discard < 1):
            raise GlmcoreError("n_keep must be >= 0 and n_discard >= 1")


@dataclass
class Timings:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    shifts: int = 0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        # the first new token comes from the prefill logits; decode steps made the rest
        return (self.new_tokens - 1) / self.decode_s if self.decode_s and self.new_tokens > 1 else 0.0

    def line(self) -> str:
        return (f"prompt {self.prompt_tokens} tok, generated {self.new_tokens} tok | "
                f"time to first token {self.ttft_s * 1000:.1f} ms | prefill {self.prefill_tps:.1f} tok/s | "
                f"decode {self.decode_tps:.1f} tok/s" + (f" | window shifts {self.shifts}" if self.shifts else ""))


class Engine:
    def __init__(self, session: Session, window: WindowPolicy | None = None, can_shift: bool = False):
        self.session = session
        self.window = window or WindowPolicy()
        self.can_shift = can_shift
        self.tokens: list[int] = []        # exactly what the cache holds, in order
        self.turn_starts: list[int] = []   # chat turn boundaries in self.tokens (whole-turn discard)
        self.pinned: int | None = None     # tokens the window never discards (chat prefix + system)
        self.pending: int | None = None    # last sampled token, not yet fed (see generate)
        self.shifts = 0

    @property
    def capacity(self) -> int:
        return self.session.capacity

    def reset(self) -> None:
        self.session.reset()
        self.tokens, self.turn_starts, self.pinned, self.pending = [], [], None, None

    def feed(self, ids: Sequence[int]) -> np.ndarray:
        """Append ids to the cache, applying the overflow policy; return the last position's logits."""
        ids = list(ids)
        if not ids:
            raise GlmcoreError("nothing to feed: the prompt encodes to zero tokens")
        self._make_room(len(ids))
        logits = self.session.prefill(ids) if len(ids) > 1 or not self.tokens else self.session.decode(ids[0])
        self.tokens.extend(ids)
        return logits

    def mark_turn(self, pin: bool = False) -> None:
        """Record that a chat turn starts here. pin=True also keeps everything before it (the
        [gMASK]sop prefix and the system/tools turn) when the window slides."""
        if pin:
            self.pinned = len(self.tokens)
        elif self.tokens and (not self.turn_starts or self.turn_starts[-1] != len(self.tokens)):
            self.turn_starts.append(len(self.tokens))

    def _make_room(self, n_new: int) -> None:
        cap = self.capacity
        if len(self.tokens) + n_new <= cap:
            return
        if self.window.policy == "error":
            raise ContextOverflow(
                f"{len(self.tokens) + n_new} tokens ({len(self.tokens)} cached + {n_new} new) exceed the context of "
                f"{cap}; shorten the prompt, raise --ctx, or use --overflow window")
        keep = self.window.n_keep if self.pinned is None else self.pinned
        if keep + n_new > cap:
            raise ContextOverflow(f"{n_new} new tokens + {keep} kept do not fit the context of {cap} even after "
                                  "sliding the window; shorten the prompt or raise --ctx")
        need = len(self.tokens) + n_new - cap
        discard = self.window.n_discard or max(1, (len(self.tokens) - keep) // 2)
        discard = min(max(discard, need), len(self.tokens) - keep)
        # In a chat, discard whole old turns: round up to the next turn start that still fits.
        whole = [s - keep for s in self.turn_starts if s - keep >= discard and s - keep <= len(self.tokens) - keep]
        if whole:
            discard = min(whole)
        self.shift(keep, discard)

    def shift(self, n_keep: int, n_discard: int) -> None:
        kept = self.tokens[:n_keep] + self.tokens[n_keep + n_discard:]
        if self.can_shift:
            self.session.shift(n_keep, n_discard)
        else:
            # Fallback: recompute the kept tokens at their new positions.
            self.session.reset()
            if kept:
                self.session.prefill(kept)
        self.tokens = kept
        self.turn_starts = [s if s < n_keep else s - n_discard for s in self.turn_starts
                            if not n_keep <= s < n_keep + n_discard]
        self.shifts += 1

    def generate(self, prompt: Sequence[int], params: SamplingParams, max_new_tokens: int,
                 stop_ids: Sequence[int] = (), n_vocab: int | None = None,
                 timings: Timings | None = None) -> Iterator[int]:
        """Feed the prompt, then yield sampled tokens until a stop id or max_new_tokens. A stop token
        is not fed to the cache (the next chat turn begins with it); any other last token is fed
        when the sequence continues."""
        if max_new_tokens < 1:
            raise GlmcoreError(f"invalid max-new-tokens {max_new_tokens}: use a positive integer")
        t = timings if timings is not None else Timings()
        sampler = Sampler(params, n_vocab)
        stops = set(stop_ids)
        start = time.perf_counter()
        shifts0 = self.shifts
        prompt = self.take_pending() + list(prompt)
        logits = self.feed(prompt)
        t.prefill_s = time.perf_counter() - start
        t.prompt_tokens = len(prompt)
        history = list(self.tokens)
        for i in range(max_new_tokens):
            token = sampler(logits, history)
            if i == 0:
                t.ttft_s = time.perf_counter() - start
                decode_start = time.perf_counter()
            if token in stops:
                break
            t.new_tokens += 1
            yield token
            history.append(token)
            if i + 1 < max_new_tokens:
                logits = self.feed([token])
            else:
                self.pending = token
        t.decode_s = time.perf_counter() - decode_start
        t.shifts = self.shifts - shifts0

    def take_pending(self) -> list[int]:
        """The last generated token when generation stopped on length: it belongs before a continuation."""
        p, self.pending = self.pending, None
        return [] if p is None else [p]
