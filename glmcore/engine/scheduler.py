"""The step loop: one step = schedule -> BatchSession.step -> (per drafted position) grammar masks ->
sample -> update, the events delivered to the requests' Handles. Driven by the thread that consumes a
request (iterating a Handle steps the scheduler when no background thread runs: the CLI, the Pipeline)
or by `start()`'s background thread (the server)."""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from .. import structured
from ..backend import BatchSession, Capabilities
from ..errors import ContextOverflow, GlmcoreError
from ..events import FinishReason
from .request import Handle, Request, RequestState, WindowPolicy, check_request
from .slots import Slot, SlotTable
from .speculative import Speculation
from .step import Event, PlanEntry, constrain, end, row_of, sample, schedule, update


class QueueFull(GlmcoreError):
    """The scheduler's waiting queue is full; retry later."""


class Scheduler:
    """Continuous batching over one BatchSession: each step gathers one decode token of every running
    request (with its drafted tokens under `speculation`) plus prefill chunks of admitted ones under a
    token budget, and samples every request that has logits to sample. A finished request frees its slot
    at once; the slot keeps its cache for a request that extends it (SlotTable.place)."""

    def __init__(self, batch: BatchSession, caps: Capabilities | None = None, n_vocab: int | None = None,
                 token_budget: int = 256, max_queue: int = 1024, speculation: Speculation | None = None):
        if token_budget < 1:
            raise GlmcoreError(f"invalid token budget {token_budget}: use a positive integer")
        caps = caps or Capabilities()
        self.table = SlotTable(batch, caps)
        self.batch, self.slots, self.native = batch, self.table.slots, caps.native_batch
        self.n_vocab, self.token_budget, self.max_queue = n_vocab, token_budget, max_queue
        self.speculation = (speculation or Speculation()).checked(caps)
        self.drafter = self.speculation.drafter()
        self.waiting: deque[RequestState] = deque()
        self.threaded, self.steps, self.drafted, self.accepted = False, 0, 0, 0
        self._lock = threading.Lock()        # the waiting queue (submit/cancel come from other threads)
        self._step_lock = threading.Lock()   # one step at a time
        self._wake = threading.Event()
        self._stop, self._thread = False, None
        self._executor = None                # llguidance's, for a batch of constrained requests' masks

    capacity = property(lambda self: self.batch.capacity)
    queue_len = property(lambda self: len(self.waiting))
    busy_slots = property(lambda self: len(self.table.running()))

    def wake(self) -> None:
        self._wake.set()

    def forget(self) -> None:
        """Drop what every free slot caches, so the next requests prefill their whole prompts (benches)."""
        with self._step_lock:
            self.table.forget()

    def submit(self, request: Request, on_token: Callable[[Handle, int | None], None] | None = None) -> Handle:
        """Queue a request; raises at once what can never run (check_request) and a full queue."""
        check_request(request, self.capacity)
        handle = Handle(RequestState.new(request, self.n_vocab), self, on_token)
        with self._lock:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (the queue's limit); retry later")
            self.waiting.append(handle.state)
        self._wake.set()
        return handle

    def step(self) -> bool:
        """Admit, run one batched step, sample. Returns whether any request is still waiting or running."""
        with self._step_lock:
            self._deliver(self._reap_cancelled())
            self._admit()
            plan = schedule(self.table, self.token_budget, self.drafter, self.speculation.draft_tokens_per_step)
            self._deliver(plan.ended)
            if plan.entries:
                self._run(plan.entries, plan.all_logits)
            return bool(self.waiting) or self.busy_slots > 0

    def run(self) -> None:
        """Step until every submitted request has finished (the synchronous driver)."""
        while self.step():
            pass

    def _reap_cancelled(self) -> list[Event]:
        with self._lock:
            gone = [s for s in self.waiting if s.cancelled]
            for s in gone:
                self.waiting.remove(s)
        return [ev for s in gone + [s for s in self.table.running() if s.cancelled]
                for ev in end(s, FinishReason.CANCELLED)]

    def _admit(self) -> None:
        while True:
            free = self.table.free()
            with self._lock:
                if not free or not self.waiting:
                    return
                state = self.waiting.popleft()
            self.table.place(state, free)

    def _run(self, entries: list[PlanEntry], all_logits: bool) -> None:
        try:
            logits = self.batch.step([(e.index, e.ids) for e in entries], all_logits)
        except Exception as e:     # a backend failure ends the requests of this step, not the server
            err = e if isinstance(e, GlmcoreError) else GlmcoreError(
                f"the backend failed during a step: {type(e).__name__}: {e}")
            for entry in entries:
                self.table.drop(entry.state.slot)
                self._deliver(end(entry.state, FinishReason.ERROR, err))
            return
        self.steps += 1
        for e in entries:
            e.state.slot.tokens.extend(e.ids)
            self.drafted += len(e.draft)
            e.state.timings.drafted += len(e.draft)
        row = {id(e): i for i, e in enumerate(entries)}
        active = [e for e in entries if e.sample]
        while active:                 # one round per drafted position, and one after them
            events = [ev for e in active if e.state.cancelled for ev in end(e.state, FinishReason.CANCELLED)]
            active = [e for e in active if not e.state.cancelled]
            rows, dead = constrain([e.state for e in active], [row_of(e, logits, row[id(e)], all_logits)
                                                              for e in active], self._masker(active))
            for e in active:
                if e.state.finish_reason is not None:
                    e.rounds += 1       # its row was read: the token that made it stays fed
            live = [(e, r) for e, r in zip(active, rows) if e.state.finish_reason is None]
            sampled = sample([e for e, _ in live], [r for _, r in live])
            more, active = update([e for e, _ in live], sampled, time.perf_counter())
            self._deliver(events + dead + more)
        for e in entries:            # rejected drafts leave the cache as if never fed
            if e.kept() < len(e.state.slot.tokens):
                self.table.truncate(e.state.slot, e.kept())
            self.accepted += e.accepted

    def _masker(self, active: Sequence[PlanEntry]):
        if self._executor is None and sum(e.state.matcher is not None for e in active) > 1:
            self._executor = structured.executor()
        return self._executor

    def _deliver(self, events: list[Event]) -> None:
        for ev in events:
            ev.state.handle.deliver(ev.token)

    # ------------------------------------------------------------------ teacher forcing (scoring, conformance)

    def feed(self, slot: Slot, ids: Sequence[int], window: WindowPolicy) -> np.ndarray:
        """Append given ids to an idle slot under `window` (sliding it as generation would) and return the
        last position's logits. For scoring text (perplexity) and conformance."""
        ids = [int(t) for t in ids]
        with self._step_lock:
            if slot.state is not None:
                raise GlmcoreError(f"slot {slot.index} is running a request; feed an idle slot")
            if self.table.make_room(slot, len(ids), window).full:
                raise ContextOverflow(f"{len(slot.tokens) + len(ids)} tokens exceed the context of {self.capacity}; "
                                      "raise --ctx or use --overflow window")
            logits = self.batch.step([(slot.index, ids)])[0]
            slot.tokens.extend(ids)
            return logits

    def shift(self, slot: Slot, n_keep: int, n_discard: int) -> None:
        self.table.shift(slot, n_keep, n_discard)

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

    def _all(self) -> list[RequestState]:
        with self._lock:
            return list(self.waiting) + self.table.running()

    def _fail_all(self, err: GlmcoreError) -> None:
        states = self._all()
        with self._lock:
            self.waiting.clear()
        self._deliver([ev for s in states for ev in end(s, FinishReason.ERROR, err)])

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop the background thread: running requests get grace_s to finish, then are cancelled."""
        deadline = time.monotonic() + grace_s
        while self._thread is not None and (self.waiting or self.busy_slots) and time.monotonic() < deadline:
            time.sleep(0.02)
        for s in self._all():
            s.handle.cancel()
        if self._thread is not None:
            self._stop = True
            self._wake.set()
            # the loop reaps the cancelled requests at its next step before it exits
            self._thread.join(timeout=60)
            self._thread = None
        self.threaded = False
        self.step()
