"""The core's KV-cache policy, carried out by the scheduler on the torch reference: the `error` policy,
the StreamingLLM window (in place where the backend shifts, re-prefilled elsewhere), whole chat turns."""
import numpy as np
import pytest

from glmcore.backend import Capabilities, LoadOptions, SessionAdapter, registry
from glmcore.config import ModelConfig
from glmcore.errors import ContextOverflow, GlmcoreError
from glmcore.events import FinishReason
from glmcore.sampling import SamplingParams
from glmcore.scheduler import Request, Room, Scheduler, Slot, WindowPolicy, make_room
from glmcore.weights import load_weights

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def model(make_tiny):
    d = make_tiny("chatglm3")
    cfg = ModelConfig.from_dir(d)
    return cfg, load_weights(d, cfg)


def scheduler(model, capacity) -> Scheduler:
    cfg, w = model
    torch = registry().get("torch")
    return Scheduler(torch.load_batch(cfg, w, LoadOptions(capacity=capacity, threads=1), 1), torch.capabilities(),
                     n_vocab=cfg.vocab_size)


def slot_holding(tokens, turn_starts=(), n_pinned=None) -> Slot:
    slot = Slot(0)
    slot.tokens, slot.turn_starts, slot.n_pinned = list(tokens), list(turn_starts), n_pinned
    return slot


def test_error_policy_refuses_a_prompt_past_the_context(model):
    with pytest.raises(ContextOverflow, match="the prompt has 17 tokens, which exceed the context of 16"):
        scheduler(model, 16).submit(Request(list(range(10, 27)), GREEDY, 4))


def test_generation_reaching_the_context_end_finishes_with_length(model):
    """Under the error policy a full context ends the reply (finish reason "length"), it is no failure."""
    sched = scheduler(model, 16)
    h = sched.submit(Request(list(range(10, 20)), GREEDY, 20))
    out = list(h)
    assert len(out) == 16 - 10 + 1 and h.finish_reason == FinishReason.LENGTH and h.context_full
    assert len(sched.slots[0].tokens) == 16 == sched.batch.kv_len(0)      # the last token is sampled, not fed


def test_window_fallback_equals_reprefill_of_kept_tokens(model):
    sched = scheduler(model, 32)
    h = sched.submit(Request(list(range(10, 40)), GREEDY, 40, window=WindowPolicy("window", n_keep=4)))
    assert len(list(h)) == 40 and h.timings.shifts >= 2
    held = sched.slots[0].tokens
    assert len(held) <= 32 and held[:4] == list(range(10, 14)) and sched.batch.kv_len(0) == len(held)
    # the cache holds exactly the ids the slot says, at contiguous positions
    probe = scheduler(model, 32).batch
    probe.step([(0, held)])
    np.testing.assert_allclose(sched.batch.step([(0, [7])])[0], probe.step([(0, [7])])[0], atol=1e-4)


def test_window_discard_sizes():
    assert make_room(slot_holding(range(10, 30)), 1, 20, WindowPolicy("window", n_keep=2, n_discard=5)) == Room(2, 5)
    assert make_room(slot_holding(range(10, 30)), 1, 20, WindowPolicy("window", n_keep=2)) == Room(2, 9)  # half
    assert make_room(slot_holding(range(10, 20)), 1, 20, WindowPolicy("window")) == Room()            # it fits
    assert make_room(slot_holding(range(10, 30)), 1, 20, WindowPolicy("error")) == Room(full=True)


def test_window_too_small_for_the_new_ids():
    with pytest.raises(ContextOverflow, match="do not fit the context of 16 even after"):
        make_room(slot_holding([1, 2, 3]), 14, 16, WindowPolicy("window", n_keep=4))


@pytest.mark.parametrize("n_discard,dropped_turns", [(1, 1), (None, 2)])
def test_whole_turns_are_discarded(n_discard, dropped_turns):
    # prefix + system (pinned: 6), then turns starting at 6, 11, 17; 22 held, 5 more into 24
    slot = slot_holding(list(range(10, 16)) + [20, 21, 22, 23, 24] + [30, 31, 32, 33, 34, 35] + [40, 41, 42, 43, 44],
                        turn_starts=[6, 11, 17], n_pinned=6)
    room = make_room(slot, 5, 24, WindowPolicy("window", n_keep=4, n_discard=n_discard))
    assert room == Room(6, 5 if dropped_turns == 1 else 11)     # never part of a turn


class ShiftingSession:
    """A reference session whose shift recomputes, recording the calls: the scheduler must use it."""

    def __init__(self, inner):
        self.inner, self.calls, self.tokens = inner, [], []
        self.capacity = inner.capacity

    @property
    def kv_len(self):
        return self.inner.kv_len

    def prefill(self, ids, all_logits=False):
        self.tokens += list(ids)
        return self.inner.prefill(ids, all_logits)

    def decode(self, t):
        self.tokens.append(t)
        return self.inner.decode(t)

    def shift(self, n_keep, n_discard):
        self.calls.append((n_keep, n_discard))
        self.tokens = self.tokens[:n_keep] + self.tokens[n_keep + n_discard:]
        self.inner.reset()
        self.inner.prefill(self.tokens)

    def reset(self):
        self.tokens = []
        self.inner.reset()


def test_backend_shift_is_used_when_declared(model):
    cfg, w = model
    s = ShiftingSession(registry().get("torch").load(cfg, w, LoadOptions(capacity=16)))
    sched = Scheduler(SessionAdapter([s]), Capabilities(can_shift=True), n_vocab=cfg.vocab_size)
    list(sched.submit(Request(list(range(10, 26)), GREEDY, 2, window=WindowPolicy("window", n_keep=4))))
    assert s.calls == [(4, 6)] and s.tokens == sched.slots[0].tokens


def test_stop_ids_and_the_unfed_last_token(model):
    sched = scheduler(model, 64)
    h = sched.submit(Request([5, 6, 7], GREEDY, 5))
    out = list(h)
    t = h.timings
    assert len(out) == 5 and t.new_tokens == 5 and t.prompt_tokens == 3 and t.ttft_s > 0
    assert sched.slots[0].tokens == [5, 6, 7] + out[:4]          # the last token is sampled, not yet fed
    h = sched.submit(Request([5, 6, 7] + out + [8], GREEDY, 1))   # a continuation prefills only what is new
    list(h)
    assert h.timings.cached_tokens == 7 and h.timings.prompt_tokens == 2
    h = sched.submit(Request([5, 6, 7], GREEDY, 5, stop_ids=[out[0]]))
    assert list(h) == [] and h.finish_reason == FinishReason.STOP and sched.slots[0].tokens == [5, 6, 7]


def test_bad_generation_args(model):
    sched = scheduler(model, 8)
    with pytest.raises(GlmcoreError, match="max-new-tokens"):
        sched.submit(Request([1], GREEDY, 0))
    with pytest.raises(GlmcoreError, match="zero tokens"):
        sched.submit(Request([], GREEDY, 1))
    with pytest.raises(GlmcoreError, match="overflow policy"):
        WindowPolicy("rotate")


def test_feed_slides_the_window_and_refuses_what_cannot_go(model):
    sched = scheduler(model, 16)
    slot = sched.slots[0]
    sched.feed(slot, list(range(10, 26)), WindowPolicy("window", n_keep=4))
    sched.feed(slot, [7], WindowPolicy("window", n_keep=4))           # full: slides, then feeds
    assert slot.shifts == 1 and len(slot.tokens) == sched.batch.kv_len(0) <= 16 and slot.tokens[:4] == [10, 11, 12, 13]
    with pytest.raises(ContextOverflow, match="exceed the context of 16; raise --ctx or use --overflow window"):
        sched.feed(slot, list(range(16)), WindowPolicy())             # the error policy never slides
    h = sched.submit(Request([1, 2, 3], GREEDY, 50))
    sched.step()                                                      # placed in the only slot, running
    with pytest.raises(GlmcoreError, match="slot 0 is running a request; feed an idle slot"):
        sched.feed(h.slot, [5], WindowPolicy())
    h.cancel()
    h.wait()
