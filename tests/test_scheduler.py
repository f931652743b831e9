"""The continuous-batching scheduler, on a batch session whose logits are a pure function of what each
slot holds (so any mix-up of slots, positions or cached prefixes changes the output), and on the torch
reference through the core's adapter."""
import threading
import time
import zlib

import numpy as np
import pytest

from glmcore.backend import BatchSession, Capabilities, LoadOptions, registry
from glmcore.config import ModelConfig
from glmcore.errors import ContextOverflow, GlmcoreError
from glmcore.sampling import SamplingParams
from glmcore.scheduler import QueueFull, Request, Scheduler, WindowPolicy
from glmcore.weights import load_weights

VOCAB = 50
GREEDY = SamplingParams(temperature=0)


def held_logits(held: list[int]) -> np.ndarray:
    seed = zlib.crc32(np.asarray(held, dtype=np.int32).tobytes())
    return np.random.default_rng(seed).standard_normal(VOCAB).astype(np.float32) * 3


class PureBatch(BatchSession):
    """Logits of a position = f(every id the slot holds up to it). Records each step's entries."""

    def __init__(self, n_slots=4, capacity=64, native=True, fail_on=None):
        self.n_slots, self.capacity, self.native = n_slots, capacity, native
        self.held = [[] for _ in range(n_slots)]
        self.calls, self.copies, self.fail_on = [], [], fail_on

    def kv_len(self, slot):
        return len(self.held[slot])

    def forward(self, entries, all_logits=False):
        self.calls.append([(s, list(ids)) for s, ids in entries])
        assert len({s for s, _ in entries}) == len(entries), "one entry per slot"
        out = []
        for slot, ids in entries:
            if self.fail_on is not None and self.fail_on in ids:
                raise RuntimeError("device lost")
            rows = []
            for t in ids:
                self.held[slot].append(t)
                assert len(self.held[slot]) <= self.capacity
                rows.append(held_logits(self.held[slot]))
            out.append(np.stack(rows) if all_logits else rows[-1])
        return out if all_logits else np.stack(out)

    def reset(self, slot):
        self.held[slot] = []

    def shift(self, slot, n_keep, n_discard):
        h = self.held[slot]
        self.held[slot] = h[:n_keep] + h[n_keep + n_discard:]

    def copy_prefix(self, src, dst, n):
        self.copies.append((src, dst, n))
        self.held[dst] = list(self.held[src][:n])


def make(batch, can_shift=False, **kw) -> Scheduler:
    """A scheduler over a test batch, with the capabilities a backend of that batch would declare."""
    return Scheduler(batch, Capabilities(can_shift=can_shift, native_batch=batch.native), **kw)


def alone(prompt, params=GREEDY, max_new=8, **kw):
    s = make(PureBatch(n_slots=1), **kw)
    return list(s.submit(Request(prompt, params, max_new)))


def prompts(n, length=5):
    g = np.random.default_rng(1)
    return [g.integers(0, VOCAB, length + i).tolist() for i in range(n)]


def test_requests_together_equal_each_alone_and_slots_are_reused():
    batch = PureBatch(n_slots=3)
    sched = make(batch, token_budget=7)
    ps = prompts(8)
    params = [GREEDY if i % 2 else SamplingParams(seed=i) for i in range(8)]
    handles = [sched.submit(Request(p, q, 6 + i % 3)) for i, (p, q) in enumerate(zip(ps, params))]
    sched.run()
    for h, p, q in zip(handles, ps, params):
        assert h.finish_reason == "length" and h.tokens == alone(p, q, h.request.max_new_tokens)
    assert max(len(c) for c in batch.calls) == 3            # three slots in flight at once
    assert sched.busy_slots == 0 and sched.queue_len == 0


def test_long_prompt_is_chunked_under_the_budget_and_never_stalls_decoding():
    batch = PureBatch(n_slots=2)
    sched = make(batch, token_budget=8)
    short = sched.submit(Request([1, 2, 3], GREEDY, 20))
    sched.step()                                             # short is prefilled and decoding
    long_prompt = list(range(40))
    long = sched.submit(Request(long_prompt, GREEDY, 4))
    steps_before = len(batch.calls)
    while not long.tokens:
        sched.step()
    steps = batch.calls[steps_before:]
    assert len(steps) >= 40 // 7                            # the prompt went in chunks
    for call in steps:
        assert sum(len(ids) for _, ids in call) <= 8       # the budget holds
        assert any(s == short.slot.index and len(ids) == 1 for s, ids in call) or short.done
    sched.run()
    assert long.tokens == alone(long_prompt, max_new=4) and short.tokens == alone([1, 2, 3], max_new=20)


def test_stop_ids_end_a_request_and_are_never_yielded():
    first = alone([4, 5, 6], max_new=8)
    sched = make(PureBatch())
    h = sched.submit(Request([4, 5, 6], GREEDY, 8, stop_ids=[first[3]]))
    assert list(h) == first[:3] and h.finish_reason == "stop"


def test_prefix_reuse_prefills_only_the_new_ids_and_matches_a_fresh_run():
    batch = PureBatch(n_slots=2)
    sched = make(batch)
    turn1 = [7, 8, 9, 10]
    h1 = sched.submit(Request(turn1, GREEDY, 5))
    sched.run()
    turn2 = turn1 + h1.tokens + [11, 12]
    h2 = sched.submit(Request(turn2, GREEDY, 5))
    sched.run()
    assert h2.slot is h1.slot and h2.timings.cached_tokens == len(turn1) + len(h1.tokens) - 1
    assert h2.timings.prompt_tokens == 3          # the unfed last reply token + the 2 new ids
    assert h2.tokens == alone(turn2, max_new=5)
    # a diverging conversation keeps the common part (truncation through copy_prefix(src == dst))
    h3 = sched.submit(Request(turn1 + [40, 41], GREEDY, 3))
    sched.run()
    assert (h1.slot.index, h1.slot.index, len(turn1)) in batch.copies and h3.timings.cached_tokens == 4
    assert h3.tokens == alone(turn1 + [40, 41], max_new=3)


def test_a_shared_prefix_is_copied_from_another_slot_on_native_batches():
    batch = PureBatch(n_slots=2)
    sched = make(batch)
    system = list(range(20, 36))
    a = sched.submit(Request(system + [1], GREEDY, 30))
    sched.step()
    b = sched.submit(Request(system + [2, 3], GREEDY, 4))
    sched.run()
    assert (a.slot.index, b.slot.index, 16) in batch.copies and b.timings.cached_tokens == 16
    assert b.tokens == alone(system + [2, 3], max_new=4) and a.tokens == alone(system + [1], max_new=30)


def test_cancel_frees_the_slot_for_the_next_request():
    sched = make(PureBatch(n_slots=1))
    a = sched.submit(Request([1, 2], GREEDY, 50))
    b = sched.submit(Request([3, 4], GREEDY, 3))
    c = sched.submit(Request([5, 6], GREEDY, 3))
    sched.step()
    sched.step()
    c.cancel()
    a.cancel()
    sched.run()
    assert a.finish_reason == "cancelled" and 1 <= len(a.tokens) < 50
    assert c.finish_reason == "cancelled" and c.tokens == []
    assert b.finish_reason == "length" and b.tokens == alone([3, 4], max_new=3)


def test_full_slot_ends_only_its_request_under_the_error_policy():
    batch = PureBatch(n_slots=2, capacity=12)
    sched = make(batch)
    full = sched.submit(Request(list(range(10)), GREEDY, 20))
    other = sched.submit(Request([1, 2], GREEDY, 8))
    sched.run()
    assert full.finish_reason == "length" and full.context_full and len(full.tokens) == 3
    assert other.finish_reason == "length" and not other.context_full and other.tokens == alone([1, 2])
    with pytest.raises(ContextOverflow, match="the prompt has 13 tokens, which exceed the context of 12"):
        sched.submit(Request(list(range(13)), GREEDY, 2))


def test_window_policy_slides_one_slot_in_place_or_by_recompute():
    for can_shift in (True, False):
        batch = PureBatch(n_slots=2, capacity=16)
        sched = make(batch, can_shift=can_shift)
        win = sched.submit(Request(list(range(12)), GREEDY, 20, window=WindowPolicy("window", n_keep=4)))
        other = sched.submit(Request([1, 2], GREEDY, 8))
        sched.run()
        assert win.finish_reason == "length" and len(win.tokens) == 20 and win.timings.shifts >= 2
        assert batch.held[win.slot.index][:4] == [0, 1, 2, 3] and win.slot.tokens == batch.held[win.slot.index]
        assert other.tokens == alone([1, 2])


def test_bad_requests_are_refused_at_submit_and_the_queue_is_bounded():
    sched = make(PureBatch(n_slots=1), max_queue=2)
    with pytest.raises(GlmcoreError, match="zero tokens"):
        sched.submit(Request([], GREEDY, 4))
    with pytest.raises(GlmcoreError, match="max-new-tokens"):
        sched.submit(Request([1], GREEDY, 0))
    sched.submit(Request([1], GREEDY, 2))
    sched.submit(Request([2], GREEDY, 2))
    with pytest.raises(QueueFull, match="retry later"):
        sched.submit(Request([3], GREEDY, 2))
    with pytest.raises(GlmcoreError, match="token budget"):
        make(PureBatch(), token_budget=0)


def test_a_backend_failure_ends_the_requests_of_its_step_with_an_error():
    sched = make(PureBatch(n_slots=2, fail_on=99))
    bad = sched.submit(Request([5, 99], GREEDY, 4))
    with pytest.raises(GlmcoreError, match="device lost"):
        list(bad)
    assert bad.finish_reason == "error"
    good = sched.submit(Request([5, 6], GREEDY, 4))
    assert list(good) == alone([5, 6], max_new=4)


def test_nan_logits_end_one_request_and_not_the_others():
    class NanBatch(PureBatch):
        def forward(self, entries, all_logits=False):
            out = super().forward(entries, all_logits)
            for i, (s, ids) in enumerate(entries):
                if ids[-1] == 13:
                    out[i][:] = np.nan
            return out
    sched = make(NanBatch())
    bad = sched.submit(Request([1, 13], SamplingParams(seed=0), 4))
    good = sched.submit(Request([1, 2], GREEDY, 4))
    sched.run()
    assert bad.finish_reason == "error" and "non-finite" in str(bad.error)
    assert good.tokens == alone([1, 2], max_new=4)


def test_background_thread_serves_consumers_on_other_threads():
    class SlowBatch(PureBatch):
        def forward(self, entries, all_logits=False):
            time.sleep(0.02)
            return super().forward(entries, all_logits)

    sched = make(SlowBatch(n_slots=3, capacity=256)).start()
    try:
        ps = prompts(6)
        results = {}

        def consume(i):
            results[i] = list(sched.submit(Request(ps[i], GREEDY, 7)))

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert all(results[i] == alone(ps[i], max_new=7) for i in range(6))
        streamed = []
        h = sched.submit(Request([1, 2, 3], GREEDY, 200), on_token=lambda h, t: streamed.append(t))
        next(iter(h))
        h.cancel()                  # the background thread is at most a few steps ahead of this thread
        h.wait(timeout=10)
        assert h.finish_reason == "cancelled" and streamed[-1] is None and streamed[:-1] == h.tokens
    finally:
        sched.stop()
    assert sched._thread is None


@pytest.fixture(scope="module")
def tiny(make_tiny):
    d = make_tiny("chatglm3")
    cfg = ModelConfig.from_dir(d)
    return cfg, load_weights(d, cfg)


def test_eight_greedy_requests_on_the_reference_equal_each_run_alone(tiny):
    """Through the adapter over torch Sessions (any backend without a native batch gets this)."""
    cfg, w = tiny
    torch_backend = registry().get("torch")
    batch = torch_backend.load_batch(cfg, w, LoadOptions(capacity=64, threads=1), 4)
    sched = Scheduler(batch, torch_backend.capabilities(), n_vocab=cfg.vocab_size, token_budget=16)
    ps = [[1, 2] + list(range(100 + i, 110 + 3 * i)) for i in range(8)]
    handles = [sched.submit(Request(p, GREEDY, 6)) for p in ps]
    sched.run()
    single = Scheduler(torch_backend.load_batch(cfg, w, LoadOptions(capacity=64, threads=1), 1),
                       torch_backend.capabilities(), n_vocab=cfg.vocab_size)
    for h, p in zip(handles, ps):
        assert h.tokens == list(single.submit(Request(p, GREEDY, 6)))


def test_a_failing_callback_drops_only_its_request_and_a_scheduler_bug_fails_requests_cleanly():
    sched = make(PureBatch(n_slots=2)).start()
    try:
        def boom(h, t):
            raise RuntimeError("consumer went away")
        bad = sched.submit(Request([1, 2], GREEDY, 40), on_token=boom)
        good = sched.submit(Request([3, 4], GREEDY, 5))
        assert list(good) == alone([3, 4], max_new=5)
        bad.wait(timeout=10)
        assert bad.finish_reason == "cancelled"
        sched._admit = lambda: 1 / 0          # a bug inside a step
        h = sched.submit(Request([5], GREEDY, 3))
        with pytest.raises(GlmcoreError, match="internal error in the scheduler: ZeroDivisionError"):
            h.wait(timeout=10)
        del sched._admit
    finally:
        sched.stop()
