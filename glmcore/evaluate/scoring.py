"""Teacher-forced scoring on a batch session: the log-probabilities a model gives to known tokens.

Both perplexity and the lm-evaluation-harness adapter score this way. Continuations that share a
context are scored with prefix reuse: the context is prefilled once in slot 0 and `copy_prefix`ed
into the other slots, one continuation each, all fed in one `step(..., all_logits=True)`.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..backend import BatchSession
from ..errors import GlmcoreError
from ..sampling import log_softmax
from ..scheduler import common_prefix


def run_slots(batch: BatchSession, jobs: Sequence[tuple[int, Sequence[int], int]], chunk: int = 256) -> list[np.ndarray]:
    """Feed each job's ids into its slot (after what the slot holds), `chunk` ids per slot and step.
    A job is (slot, ids, n_unscored): returns, per job, the float32 logits of the positions
    n_unscored..len(ids)-1. The unscored ids go first, without all_logits, so a backend computes the
    output layer only where it is needed."""
    pos = [0] * len(jobs)
    outs: list[list[np.ndarray]] = [[] for _ in jobs]
    for scored in (False, True):
        while True:
            entries, which = [], []
            for j, (slot, ids, n) in enumerate(jobs):
                end = len(ids) if scored else n
                if pos[j] < end:
                    piece = list(ids[pos[j]:min(end, pos[j] + chunk)])
                    entries.append((slot, piece))
                    which.append(j)
                    pos[j] += len(piece)
            if not entries:
                break
            if scored:
                for j, rows in zip(which, batch.step(entries, all_logits=True)):
                    outs[j].append(np.asarray(rows, dtype=np.float32))
            else:
                batch.step(entries)
    return [np.concatenate(o) if o else np.zeros((0, 0), np.float32) for o in outs]


class Scorer:
    """Log-likelihoods of continuations given contexts (token ids), on a batch session of >= 1 slots."""

    def __init__(self, batch: BatchSession, chunk: int = 256):
        self.batch, self.chunk = batch, chunk
        self.held: list[int] = []          # what slot 0 holds: the last shared context

    def release(self) -> None:
        """Empty every slot (before something else, e.g. the scheduler, uses the session)."""
        for s in range(self.batch.n_slots):
            self.batch.reset(s)
        self.held = []

    def fit(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """Cut the context from the left so that context + continuation fit a slot (as lm-eval's HF model does)."""
        cap = self.batch.capacity
        if not continuation:
            raise GlmcoreError("a continuation encodes to zero tokens; nothing to score")
        if len(continuation) > cap:
            raise GlmcoreError(f"a continuation of {len(continuation)} tokens does not fit the context of {cap}; "
                               "raise ctx")
        whole = (context + continuation)[-(cap + 1):]
        return whole[:len(whole) - len(continuation)], continuation

    def loglikelihood(self, pairs: Sequence[tuple[list[int], list[int]]], progress=None) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding gives the continuation) per pair.
        Contexts must be non-empty (the adapter puts the model's [gMASK]sop prefix first)."""
        self.release()       # the slots may hold anything (the scheduler's last requests)
        fitted = [self.fit(list(c), list(x)) for c, x in pairs]
        order = sorted(range(len(fitted)), key=lambda i: (fitted[i][0], fitted[i][1]))
        results: list[tuple[float, bool] | None] = [None] * len(fitted)
        width = max(1, self.batch.n_slots - 1) if self.batch.n_slots > 1 else 1
        i = 0
        while i < len(order):
            ctx = fitted[order[i]][0]
            group = [order[i]]
            while i + len(group) < len(order) and fitted[order[i + len(group)]][0] == ctx:
                group.append(order[i + len(group)])
            i += len(group)
            if not ctx:
                raise GlmcoreError("an empty context cannot be scored; put the model's prefix first")
            shared = ctx[:-1]
            for k in range(0, len(group), width):
                part = group[k:k + width]
                jobs = self._place(shared, part, fitted)
                for idx, logits in zip(part, run_slots(self.batch, jobs, self.chunk)):
                    cont = fitted[idx][1]
                    lp = log_softmax(logits)
                    results[idx] = (float(lp[np.arange(len(cont)), cont].sum(dtype=np.float64)),
                                    bool((logits.argmax(axis=-1) == np.asarray(cont)).all()))
            if progress is not None:
                progress(i, len(order))
        return results   # type: ignore[return-value]

    def _place(self, shared: list[int], part: list[int], fitted) -> list[tuple[int, list[int], int]]:
        """Put the shared context into the slots of `part`; returns the jobs that score the continuations."""
        feeds = [[fitted[idx][0][-1]] + fitted[idx][1][:-1] for idx in part]
        if self.batch.n_slots == 1:
            self.batch.reset(0)
            self.held = []
            return [(0, shared + feeds[0], len(shared))]
        # slot 0 keeps the shared context; it extends or truncates what it held (few-shot prompts share a prefix)
        n = common_prefix(self.held, shared)
        if n < len(self.held):
            if n:
                self.batch.copy_prefix(0, 0, n)
            else:
                self.batch.reset(0)
        rest = shared[n:]
        if rest:
            run_slots(self.batch, [(0, rest, len(rest))], self.chunk)
        self.held = list(shared)
        jobs = []
        for k, feed in enumerate(feeds, 1):
            if shared:
                self.batch.copy_prefix(0, k, len(shared))
            else:
                self.batch.reset(k)
            jobs.append((k, feed, 0))
        return jobs
