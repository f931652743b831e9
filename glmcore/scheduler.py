"""Continuous batching: the one generation loop of the project.

Requests (prompt ids, their own sampling parameters and seed, max new tokens, stop ids, overflow policy)
wait in a queue. Each `step` gathers one decode token of every running request plus prefill chunks of
admitted ones under a token budget -- so a long prompt never stalls the others for its whole length --
runs them as one `BatchSession.step`, and samples every request that has logits to sample. A finished
request (stop, length, cancelled) frees its slot at once; the slot keeps its cache, so a request whose
ids extend what a slot holds (the next turn of the same conversation) is placed there and prefills only
the new ids.

The scheduler is driven either by the thread that consumes a request (iterating a Handle steps the
scheduler when no background thread runs: the CLI and the Pipeline) or by `start()`'s background
thread (the server); a Handle is safe to consume from another thread.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from . import structured
from .backend import BatchSession, Capabilities
from .errors import ContextOverflow, GlmcoreError
from .events import FinishReason
from .sampling import Sampler, SamplingParams, sample_batch
from .structured import GrammarError

if TYPE_CHECKING:
    from .structured import Constraint

OVERFLOW_POLICIES = ("error", "window")


class QueueFull(GlmcoreError):
    """The scheduler's waiting queue is full; retry later."""


@dataclass
class WindowPolicy:
    """What to do when a sequence fills its slot. `error`: the request ends with finish reason
    "length" (feeding more by hand raises ContextOverflow). `window` is StreamingLLM: keep the first
    n_keep tokens as attention sinks and discard n_discard after them (default: half of the rest, as
    llama.cpp)."""
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
    prompt_tokens: int = 0       # prompt tokens prefilled (the cached prefix is not counted)
    new_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    shifts: int = 0
    cached_tokens: int = 0       # prompt tokens a slot already held (prefix reuse)

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
                f"decode {self.decode_tps:.1f} tok/s" + (f" | window shifts {self.shifts}" if self.shifts else "")
                + (f" | reused {self.cached_tokens} cached tok" if self.cached_tokens else ""))


@dataclass
class Request:
    prompt: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 256
    stop_ids: Sequence[int] = ()
    window: WindowPolicy = field(default_factory=WindowPolicy)
    turn_starts: Sequence[int] = ()      # chat turn starts in prompt: the window discards whole turns
    n_pinned: int | None = None          # how many prompt tokens the window never discards (prefix + system turn)
    # constrained decoding (glmcore.structured): each token is masked to what the grammar allows next, and
    # the request ends when the grammar is complete
    constraint: "Constraint | None" = None
    min_tokens: int = 0                  # stop ids are masked until this many tokens are generated


class Slot:
    """What one slot of the BatchSession holds: its ids in cache order, and the window bookkeeping."""

    def __init__(self, index: int):
        self.index = index
        self.tokens: list[int] = []
        self.turn_starts: list[int] = []
        self.n_pinned: int | None = None
        self.shifts = 0
        self.handle: Handle | None = None      # the running request, None when free
        self.last_used = 0.0


class Handle:
    """A submitted request. Iterate it for the generated token ids as they come (stop ids are never
    yielded); `finish_reason` is then a FinishReason. Safe to consume from another thread."""

    _ids = itertools.count()

    def __init__(self, scheduler: "Scheduler", request: Request, n_vocab: int | None,
                 on_token: Callable[["Handle", int | None], None] | None):
        self.id = next(self._ids)
        self.scheduler, self.request = scheduler, request
        self.sampler = Sampler(request.params, n_vocab)
        self.matcher = request.constraint.start() if request.constraint is not None else None
        self.on_token = on_token
        self.tokens: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.error: GlmcoreError | None = None
        self.timings = Timings()
        self.slot: Slot | None = None
        self._todo: list[int] = []        # prompt ids not yet fed
        self._pending: int | None = None  # last sampled token, fed with the next step
        self._history: list[int] = []     # prompt + generated, for the repetition penalty
        self._cancel = False
        self._queue: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self.context_full = False         # finish reason "length" because the slot was full
        self._shifts0 = 0
        self._t_submit = self._t_placed = time.perf_counter()
        self._t_first = 0.0

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop generating; the request ends with finish reason "cancelled" at the next step."""
        self._cancel = True
        self.scheduler._wake.set()

    def wait(self, timeout: float | None = None) -> "Handle":
        for _ in self._drain(timeout):
            pass
        return self

    def __iter__(self) -> Iterator[int]:
        return self._drain(None)

    def _drain(self, timeout: float | None) -> Iterator[int]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                if not self.scheduler.threaded:
                    if not self.scheduler.step() and self._queue.empty():
                        raise GlmcoreError(f"internal error: request {self.id} is neither queued nor running; "
                                           "please report")
                    continue
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"request {self.id} did not finish in {timeout} s")
                try:
                    item = self._queue.get(timeout=left if left is not None else 1.0)
                except queue.Empty:
                    continue
            if item is None:
                if self.error is not None:
                    raise self.error
                return
            yield item

    # -- called by the scheduler thread only
    def _emit(self, token: int | None) -> None:
        self._queue.put(token)
        if self.on_token is not None:
            try:
                self.on_token(self, token)
            except Exception:       # a consumer's callback must not stop the scheduler: drop its request
                self._cancel = True


class Scheduler:
    """The loop over one BatchSession. `caps` are the backend's: can_shift (slide a window in place)
    and native_batch (copy a prefix between slots) decide how the KV-cache policy is carried out."""

    def __init__(self, batch: BatchSession, caps: Capabilities | None = None, n_vocab: int | None = None,
                 token_budget: int = 256, max_queue: int = 1024):
        if token_budget < 1:
            raise GlmcoreError(f"invalid token budget {token_budget}: use a positive integer")
        caps = caps or Capabilities()
        self.batch = batch
        self.can_shift, self.native = caps.can_shift, caps.native_batch
        self.n_vocab = n_vocab
        self.token_budget = token_budget
        self.max_queue = max_queue
        self.slots = [Slot(i) for i in range(batch.n_slots)]
        self.waiting: deque[Handle] = deque()
        self.threaded = False
        self.steps = 0
        self._lock = threading.Lock()        # the waiting queue (submit/cancel come from other threads)
        self._step_lock = threading.Lock()   # one step at a time
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._executor = None                # llguidance's, for a batch of constrained requests' masks

    @property
    def capacity(self) -> int:
        return self.batch.capacity

    @property
    def queue_len(self) -> int:
        return len(self.waiting)

    @property
    def busy_slots(self) -> int:
        return sum(s.handle is not None for s in self.slots)

    def forget(self) -> None:
        """Drop what every free slot caches, so the next requests prefill their whole prompts (benches)."""
        with self._step_lock:
            for slot in self.slots:
                if slot.handle is None:
                    self._truncate(slot, 0)

    # ------------------------------------------------------------------ submitting

    def submit(self, request: Request, on_token: Callable[[Handle, int | None], None] | None = None) -> Handle:
        """Queue a request. Raises at once what can never run: an empty prompt, a bad max_new_tokens,
        a prompt longer than the context (error policy), a full queue."""
        n = len(request.prompt)
        if n == 0:
            raise GlmcoreError("nothing to generate from: the prompt encodes to zero tokens")
        if request.max_new_tokens < 1:
            raise GlmcoreError(f"invalid max-new-tokens {request.max_new_tokens}: use a positive integer")
        if not 0 <= request.min_tokens <= request.max_new_tokens:
            raise GlmcoreError(f"invalid min-tokens {request.min_tokens}: use 0..max-new-tokens "
                               f"({request.max_new_tokens})")
        keep = request.n_pinned if request.n_pinned is not None else request.window.n_keep
        if n > self.capacity and (request.window.policy == "error" or keep >= self.capacity):
            raise ContextOverflow(f"the prompt has {n} tokens, which exceed the context of {self.capacity}; shorten "
                                  "the prompt or raise --ctx")
        handle = Handle(self, request, self.n_vocab, on_token)
        with self._lock:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (the queue's limit); retry later")
            self.waiting.append(handle)
        self._wake.set()
        return handle

    # ------------------------------------------------------------------ one step

    def step(self) -> bool:
        """Admit, run one batched step, sample. Returns whether any request is still waiting or running."""
        with self._step_lock:
            self._reap_cancelled()
            self._admit()
            entries, sampled = self._plan()
            if entries:
                self._run(entries, sampled)
            return bool(self.waiting) or self.busy_slots > 0

    def run(self) -> None:
        """Step until every submitted request has finished (the synchronous driver)."""
        while self.step():
            pass

    def _reap_cancelled(self) -> None:
        with self._lock:
            gone = [h for h in self.waiting if h._cancel]
            for h in gone:
                self.waiting.remove(h)
        for h in gone:
            self._finish(h, FinishReason.CANCELLED)
        for s in self.slots:
            if s.handle is not None and s.handle._cancel:
                self._finish(s.handle, FinishReason.CANCELLED)

    def _admit(self) -> None:
        while True:
            free = [s for s in self.slots if s.handle is None]
            with self._lock:
                if not free or not self.waiting:
                    return
                h = self.waiting.popleft()
            self._place(h, free)

    def _place(self, h: Handle, free: list[Slot]) -> None:
        """Put h in the free slot that already holds the longest prefix of its prompt (prefix reuse);
        with a native batch session, copy a longer prefix from any other slot (a shared system prompt)."""
        prompt = list(h.request.prompt)
        head = prompt[:-1]             # the last prompt token is always fed: its logits are sampled
        held = {s.index: common_prefix(s.tokens, head) for s in self.slots}     # once per slot, not per comparison
        slot = max(free, key=lambda s: (held[s.index], -s.last_used))
        n = held[slot.index]
        if self.native:
            donor = max(self.slots, key=lambda s: held[s.index])
            if held[donor.index] > n:
                n = held[donor.index]
                self.batch.copy_prefix(donor.index, slot.index, n)
                slot.tokens = prompt[:n]
        if n < len(slot.tokens):
            self._truncate(slot, n)
        slot.turn_starts = [s for s in h.request.turn_starts if 0 < s]
        slot.n_pinned = h.request.n_pinned
        slot.handle, h.slot = h, slot
        h._todo = prompt[n:]
        h._history = prompt
        h.timings.cached_tokens = n
        h.timings.prompt_tokens = len(prompt) - n
        h._shifts0 = slot.shifts
        h._t_placed = time.perf_counter()

    def _plan(self) -> tuple[list[tuple[int, list[int]]], list[Handle]]:
        """Decode tokens of every running request first, then prefill chunks under the token budget.
        Returns the step's entries and the handles whose entry ends in logits to sample."""
        entries, sampled = [], []
        budget = self.token_budget
        running = [s.handle for s in self.slots if s.handle is not None]
        for h in running:
            if h._pending is not None:
                if not self._make_room(h, 1):
                    continue
                entries.append((h.slot.index, [h._pending]))
                sampled.append(h)
                h._pending = None
                budget -= 1
        # prefill in admission order; at least one chunk moves when nothing decodes
        for h in sorted((h for h in running if h._todo), key=lambda h: h.id):
            if budget <= 0 and entries:
                break
            chunk = h._todo[:max(budget, 1)]
            if not self._make_room(h, len(chunk)):
                continue
            entries.append((h.slot.index, chunk))
            h._todo = h._todo[len(chunk):]
            if not h._todo:
                sampled.append(h)
            budget -= len(chunk)
        return entries, sampled

    def _run(self, entries: list[tuple[int, list[int]]], sampled: list[Handle]) -> None:
        try:
            logits = self.batch.step(entries)
        except Exception as e:     # a backend failure ends the requests of this step, not the server
            err = e if isinstance(e, GlmcoreError) else GlmcoreError(
                f"the backend failed during a step: {type(e).__name__}: {e}")
            for slot, _ in entries:
                s = self.slots[slot]
                self.batch.reset(slot)
                s.tokens = []
                if s.handle is not None:
                    s.handle.error = err
                    self._finish(s.handle, FinishReason.ERROR)
            return
        self.steps += 1
        for slot, ids in entries:
            self.slots[slot].tokens.extend(ids)
        rows = {slot: i for i, (slot, _) in enumerate(entries)}
        now = time.perf_counter()
        picks = [h for h in sampled if h.slot is not None]
        picked = [logits[rows[h.slot.index]] for h in picks]     # views: no copy of [B, vocab] per step
        picks, picked = self._constrain(picks, picked)
        tokens = sample_batch([h.sampler for h in picks], picked, [h._history for h in picks])
        for h, token in zip(picks, tokens):
            if isinstance(token, GlmcoreError):      # this request's logits were broken; the others go on
                h.error = token
                self._finish(h, FinishReason.ERROR)
                continue
            t = h.timings
            if not h._t_first:
                h._t_first = now
                t.ttft_s = now - h._t_submit
                t.prefill_s = now - h._t_placed
            if token in h.request.stop_ids:
                self._finish(h, FinishReason.STOP)
                continue
            if h.matcher is not None and (why := h.matcher.advance(token)) is not None:
                if h.matcher.too_complex:         # a limit of llguidance's, hit by the request's grammar
                    h.error = GrammarError(f"the grammar is too large for the constraint engine after {len(h.tokens)} "
                                           f"tokens ({why}); simplify it: smaller repetition counts, fewer rules")
                else:
                    h.error = GrammarError(f"the sampled token {token} does not continue the grammar ({why}); "
                                           "please report")
                self._finish(h, FinishReason.ERROR)
                continue
            h.tokens.append(token)
            h._history.append(token)
            t.new_tokens += 1
            h._emit(token)
            if h.matcher is not None and h.matcher.stopped:
                self._finish(h, FinishReason.STOP)       # the grammar is complete: nothing may follow
            elif len(h.tokens) >= h.request.max_new_tokens:
                self._finish(h, FinishReason.LENGTH)     # the last token is not fed: a continuation feeds it
            else:
                h._pending = token

    def _constrain(self, picks: list[Handle], rows: list[np.ndarray]) -> tuple[list[Handle], list[np.ndarray]]:
        """Mask the logits rows of constrained requests (their grammar's next-token bitmask; stop ids only
        where the grammar is complete) and of requests under min_tokens (no stop ids yet). A request whose
        grammar allows nothing more ends: "stop" when what it wrote is complete, else an error."""
        con = [i for i, h in enumerate(picks) if h.matcher is not None]
        dead: set[int] = set()
        if con:
            if self._executor is None and len(con) > 1:
                self._executor = structured.executor()
            masked, alive = structured.mask_rows(
                [picks[i].matcher for i in con], [rows[i] for i in con], [picks[i].request.stop_ids for i in con],
                [len(picks[i].tokens) >= picks[i].request.min_tokens for i in con], self._executor)
            for j, i in enumerate(con):
                rows[i] = masked[j]
                if not alive[j]:
                    dead.add(i)
        for i, h in enumerate(picks):
            if h.matcher is None and len(h.tokens) < h.request.min_tokens and h.request.stop_ids:
                rows[i] = rows[i].copy()
                rows[i][[s for s in h.request.stop_ids if 0 <= s < rows[i].shape[0]]] = -np.inf
        for i in sorted(dead):
            h = picks[i]
            if h.matcher.accepting:
                self._finish(h, FinishReason.STOP)
            else:
                h.error = GrammarError(f"the grammar dead-ended after {len(h.tokens)} tokens: no token of the "
                                       "vocabulary continues it; check the grammar")
                self._finish(h, FinishReason.ERROR)
        if dead:
            keep = [i for i in range(len(picks)) if i not in dead]
            picks, rows = [picks[i] for i in keep], [rows[i] for i in keep]
        return picks, rows

    def _make_room(self, h: Handle, n_new: int) -> bool:
        """Apply h's overflow policy before n_new ids go into its slot. False: h has ended ("length")."""
        try:
            room = self._slide(h.slot, n_new, h.request.window)
        except ContextOverflow as e:
            h.error = e
            self._finish(h, FinishReason.ERROR)
            return False
        if room.full:
            h.context_full = True
            self._finish(h, FinishReason.LENGTH)
            return False
        return True

    def _slide(self, slot: Slot, n_new: int, window: WindowPolicy) -> Room:
        """The KV-cache policy for n_new ids into slot, the window slid already where it says so."""
        room = make_room(slot, n_new, self.capacity, window)
        if room.n_discard:
            self.shift(slot, room.n_keep, room.n_discard)
        return room

    def feed(self, slot: Slot, ids: Sequence[int], window: WindowPolicy) -> np.ndarray:
        """Teacher forcing: append given ids to an idle slot under `window` (sliding it as generation
        would) and return the last position's logits. For scoring text (perplexity) and conformance."""
        ids = [int(t) for t in ids]
        with self._step_lock:
            if slot.handle is not None:
                raise GlmcoreError(f"slot {slot.index} is running a request; feed an idle slot")
            if self._slide(slot, len(ids), window).full:
                raise ContextOverflow(f"{len(slot.tokens) + len(ids)} tokens exceed the context of {self.capacity}; "
                                      "raise --ctx or use --overflow window")
            logits = self.batch.step([(slot.index, ids)])[0]
            slot.tokens.extend(ids)
            return logits

    def shift(self, slot: Slot, n_keep: int, n_discard: int) -> None:
        """Slide one slot's window: in place where the backend can, else recompute the kept ids."""
        kept = slot.tokens[:n_keep] + slot.tokens[n_keep + n_discard:]
        if self.can_shift:
            self.batch.shift(slot.index, n_keep, n_discard)
        else:
            self._refill(slot.index, kept)
        slot.tokens = kept
        slot.turn_starts = [s if s < n_keep else s - n_discard for s in slot.turn_starts
                            if not n_keep <= s < n_keep + n_discard]
        slot.shifts += 1

    def _truncate(self, slot: Slot, n: int) -> None:
        """Keep a slot's first n positions: copied in place where the session is native, else recomputed."""
        if self.native and n:
            self.batch.copy_prefix(slot.index, slot.index, n)
        else:
            self._refill(slot.index, slot.tokens[:n])
        slot.tokens = slot.tokens[:n]

    def _refill(self, index: int, ids: list[int]) -> None:
        self.batch.reset(index)
        if ids:
            self.batch.step([(index, ids)])

    def _finish(self, h: Handle, reason: FinishReason) -> None:
        if h.finish_reason is not None:
            return
        h.finish_reason = reason
        now = time.perf_counter()
        if h._t_first:
            h.timings.decode_s = now - h._t_first
        if h.slot is not None:
            h.timings.shifts = h.slot.shifts - h._shifts0
            h.slot.handle = None
            h.slot.last_used = now
        h._pending, h._todo = None, []
        h._emit(None)
        h._done.set()

    # ------------------------------------------------------------------ background driver

    def start(self) -> "Scheduler":
        """Drive the scheduler from a background thread (for servers)."""
        if self._thread is None:
            self.threaded, self._stop = True, False
            self._thread = threading.Thread(target=self._loop, name="glmcore-scheduler", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop:
            try:
                busy = self.step()
            except Exception as e:     # a bug must not leave consumers waiting forever
                self._fail_all(GlmcoreError(f"internal error in the scheduler: {type(e).__name__}: {e}; "
                                            "please report"))
                continue
            if not busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    def _fail_all(self, err: GlmcoreError) -> None:
        with self._lock:
            handles = list(self.waiting) + [s.handle for s in self.slots if s.handle is not None]
            self.waiting.clear()
        for h in handles:
            h.error = err
            self._finish(h, FinishReason.ERROR)

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop the background thread: running requests get grace_s to finish, then are cancelled."""
        deadline = time.monotonic() + grace_s
        while self._thread is not None and (self.waiting or self.busy_slots) and time.monotonic() < deadline:
            time.sleep(0.02)
        with self._lock:
            pending = list(self.waiting) + [s.handle for s in self.slots if s.handle is not None]
        for h in pending:
            h.cancel()
        if self._thread is not None:
            self._stop = True
            self._wake.set()
            # the loop reaps the cancelled requests at its next step before it exits
            self._thread.join(timeout=60)
            self._thread = None
        self.threaded = False
        self.step()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Room:
    """What the KV-cache policy decided for a slot about to take new ids: they fit (n_discard 0), slide
    the window first (drop n_discard ids after the first n_keep), or the sequence ends (`full`)."""
    n_keep: int = 0
    n_discard: int = 0
    full: bool = False


def make_room(slot: Slot, n_new: int, capacity: int, window: WindowPolicy) -> Room:
    """The core's KV-cache policy for one slot about to take n_new ids. Raises ContextOverflow when
    even a slid window cannot hold them."""
    if len(slot.tokens) + n_new <= capacity:
        return Room()
    if window.policy == "error":
        return Room(full=True)
    keep = window.n_keep if slot.n_pinned is None else slot.n_pinned
    if keep + n_new > capacity:
        raise ContextOverflow(f"{n_new} new tokens + {keep} kept do not fit the context of {capacity} even after "
                              "sliding the window; shorten the prompt or raise --ctx")
    need = len(slot.tokens) + n_new - capacity
    discard = window.n_discard or max(1, (len(slot.tokens) - keep) // 2)
    discard = min(max(discard, need), len(slot.tokens) - keep)
    # In a chat, discard whole old turns: round up to the next turn start that still fits.
    whole = [s - keep for s in slot.turn_starts if discard <= s - keep <= len(slot.tokens) - keep]
    if whole:
        discard = min(whole)
    return Room(keep, discard)
