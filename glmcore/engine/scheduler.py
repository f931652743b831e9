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
from ..errors import GlmcoreError
from ..events import FinishReason
from .driver import BackgroundDriver
from .prompt_cache import PromptCache
from .request import Handle, Request, RequestState, Slot, WindowPolicy, check_request
from .slots import SlotTable
from .speculative import Speculation
from .step import (Event, PlanEntry, StepPlan, constrain, end, logprobs, prefetch_masks, row_of, sample, schedule,
                   score_prompt, settle_drafts, update)


class QueueFull(GlmcoreError):
    """The scheduler's waiting queue is full; retry later."""


class Scheduler(BackgroundDriver):
    """Continuous batching over one BatchSession: each step gathers one decode token of every running
    request (with its drafted tokens under `speculation`) plus prefill chunks of admitted ones under a
    token budget, and samples every request that has logits to sample. A finished request frees its slot
    at once; the slot keeps its cache for a request that extends it (SlotTable.place)."""

    def __init__(self, batch: BatchSession, caps: Capabilities | None = None, n_vocab: int | None = None,
                 token_budget: int = 256, max_queue: int = 1024, speculation: Speculation | None = None,
                 prompt_cache: PromptCache | None = None):
        if token_budget < 1:
            raise GlmcoreError(f"invalid token budget {token_budget}: use a positive integer")
        caps = caps or Capabilities()
        self.table = SlotTable(batch, caps, prompt_cache)
        self.batch, self.slots, self.native = batch, self.table.slots, caps.native_batch
        self.n_vocab, self.token_budget, self.max_queue = n_vocab, token_budget, max_queue
        self.speculation = (speculation or Speculation()).checked(caps)
        self.drafter = self.speculation.drafter(batch)
        self.waiting: deque[RequestState] = deque()
        self.threaded, self.steps, self.drafted, self.accepted = False, 0, 0, 0
        self._lock = threading.Lock()        # the waiting queue (submit/cancel come from other threads)
        self._step_lock = threading.Lock()   # one step at a time
        self._wake = threading.Event()       # new work, a cancel: the background thread steps again
        self._stop, self._thread = False, None
        self._executor = None                # llguidance's, for a batch of constrained requests' masks

    capacity = property(lambda self: self.batch.capacity)
    queue_len = property(lambda self: len(self.waiting))
    busy_slots = property(lambda self: len(self.table.running()))

    def wake(self) -> None:
        self._wake.set()

    def forget(self) -> None:
        """Drop what every free slot and the prompt cache hold, so the next requests prefill their whole prompts (benches)."""
        with self._step_lock:
            self.table.forget()

    def submit(self, request: Request, on_token: Callable[[Handle, int | None], None] | None = None,
               leader: Handle | None = None) -> Handle:
        """Queue a request; raises at once what can never run (check_request) and a full queue. With a
        leader (a request with the same prompt: n > 1 choices), it waits for the leader's prefill and
        copies the prompt's cache from its slot instead of prefilling it again (native batch sessions)."""
        check_request(request, self.capacity)
        state = RequestState.new(request, self.n_vocab)
        if leader is not None and self.native:
            state.leader = leader.state
        handle = Handle(state, self, on_token)
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
                self._run(plan)
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
                state = next((s for s in self.waiting if s.ready), None) if free else None
                if state is None:
                    return
                self.waiting.remove(state)
            self.table.place(state, free)

    def _run(self, plan: StepPlan) -> None:
        active = [e for e in plan.entries if e.sample]
        prefetched = prefetch_masks(active, self._masker(active))     # computed while the model runs the step
        try:
            logits = self.batch.step(plan.batch_entries(), plan.all_logits)
        except Exception as e:     # a backend failure ends the requests of this step, not the server
            err = e if isinstance(e, GlmcoreError) else GlmcoreError(
                f"the backend failed during a step: {type(e).__name__}: {e}")
            for entry in plan.entries:
                self.table.drop(entry.state.slot)
                self._deliver(end(entry.state, FinishReason.ERROR, err))
            return
        finally:                   # the mask thread is done with the matchers before anything advances them
            if prefetched is not None:
                prefetched.wait()
        self.steps += 1
        for e in plan.entries:
            e.state.slot.extend(e.ids)
            if e.scores_prompt:
                score_prompt(e, logits[e.row])
        first = prefetched
        while active:                 # one round per drafted position, and one after them
            active, first = self._round(active, logits, plan.all_logits, first), None
        drafted, accepted = settle_drafts(plan.entries, self.table)
        self.drafted, self.accepted = self.drafted + drafted, self.accepted + accepted

    def _round(self, active: list[PlanEntry], logits, all_logits: list[bool] | bool,
               prefetched: structured.PrefetchedMasks | None = None) -> list[PlanEntry]:
        """Mask (with the masks prefetched for this round, if any), sample and apply one position of every active
        entry; deliver the events."""
        events = []
        if any(e.rounds for e in active):
            # a consumer that cancelled on a token of this step (a stop string) gets no more of them
            events = [ev for e in active if e.state.cancelled for ev in end(e.state, FinishReason.CANCELLED)]
            active = [e for e in active if e.state.finish_reason is None]
        rows, dead = constrain([e.state for e in active], [row_of(e, logits, all_logits) for e in active],
                               self._masker(active), prefetched)
        if dead:
            for e in active:
                if e.state.finish_reason is not None:
                    e.rounds += 1       # its row was read: the token that made it stays fed
            rows = [r for e, r in zip(active, rows) if e.state.finish_reason is None]
            active = [e for e in active if e.state.finish_reason is None]
        tokens = sample(active, rows)
        more, going_on = update(active, tokens, time.perf_counter(), logprobs(active, rows, tokens))
        self._deliver(events + dead + more)
        return going_on

    def _masker(self, active: Sequence[PlanEntry]):
        if self._executor is None and sum(e.state.matcher is not None for e in active) > 1:
            self._executor = structured.executor()
        return self._executor

    def _deliver(self, events: list[Event]) -> None:
        for ev in events:
            ev.state.handle.deliver(ev.token)

    def feed(self, slot: Slot, ids: Sequence[int], window: WindowPolicy) -> np.ndarray:
        """Teacher forcing on an idle slot (SlotTable.feed): scoring text, conformance."""
        with self._step_lock:
            return self.table.feed(slot, ids, window)
