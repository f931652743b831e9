import numpy as np
import pytest

from glmcore.backend import LoadOptions, registry
from glmcore.config import ModelConfig
from glmcore.engine import Engine, Timings, WindowPolicy
from glmcore.errors import ContextOverflow, GlmcoreError
from glmcore.sampling import SamplingParams
from glmcore.weights import load_weights

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def model(make_tiny):
    d = make_tiny("chatglm3")
    cfg = ModelConfig.from_dir(d)
    return cfg, load_weights(d, cfg)


def session(model, capacity):
    cfg, w = model
    return registry().get("torch").load(cfg, w, LoadOptions(capacity=capacity))


def test_error_policy_names_the_fix(model):
    eng = Engine(session(model, 16))
    with pytest.raises(ContextOverflow, match="exceed the context of 16; shorten the prompt, raise --ctx"):
        eng.feed(list(range(10, 27)))
    eng.feed(list(range(10, 20)))
    with pytest.raises(ContextOverflow, match="the prompt has 17 tokens, which exceed the context of 16"):
        list(eng.generate(list(range(7)), GREEDY, 20))


def test_generation_reaching_the_context_end_finishes_with_length(model):
    """Under the error policy a full context ends the reply (finish reason "length"), it is no failure."""
    eng = Engine(session(model, 16))
    out = list(eng.generate(list(range(10, 20)), GREEDY, 20))
    assert len(out) == 16 - 10 + 1 and eng.finish_reason == "length" and eng.context_full
    assert len(eng.tokens) == 16 and eng.pending == out[-1]


def test_window_fallback_equals_reprefill_of_kept_tokens(model):
    eng = Engine(session(model, 32), WindowPolicy("window", n_keep=4))
    t = Timings()
    out = list(eng.generate(list(range(10, 40)), GREEDY, 40, timings=t))
    assert len(out) == 40 and t.shifts >= 2 and len(eng.tokens) <= 32
    assert eng.tokens[:4] == list(range(10, 14))            # attention sinks kept
    # the cache must hold exactly the tokens the engine says it holds, at contiguous positions
    probe = session(model, 32)
    probe.prefill(eng.tokens[:-1])
    eng.tokens.pop()
    eng.session.reset()
    eng.session.prefill(eng.tokens)
    np.testing.assert_allclose(eng.feed([7]), probe.decode(7), atol=1e-4)


def test_window_discard_sizes(model):
    eng = Engine(session(model, 20), WindowPolicy("window", n_keep=2, n_discard=5))
    eng.feed(list(range(10, 30)))
    eng.feed([99])
    assert eng.tokens == list(range(10, 12)) + list(range(17, 30)) + [99]


def test_window_too_small_for_prompt(model):
    eng = Engine(session(model, 16), WindowPolicy("window", n_keep=4))
    eng.feed([1, 2, 3])
    with pytest.raises(ContextOverflow, match="do not fit the context of 16 even after"):
        eng.feed(list(range(14)))


@pytest.mark.parametrize("n_discard,dropped_turns", [(1, 1), (None, 2)])
def test_whole_turns_are_discarded(model, n_discard, dropped_turns):
    eng = Engine(session(model, 24), WindowPolicy("window", n_keep=4, n_discard=n_discard))
    eng.feed(list(range(10, 16)))          # prefix + system: pinned
    eng.mark_turn(pin=True)
    for turn in ([20, 21, 22, 23, 24], [30, 31, 32, 33, 34, 35], [40, 41, 42, 43, 44]):
        eng.mark_turn()
        eng.feed(turn)
    eng.mark_turn()
    eng.feed([50, 51, 52, 53, 54])    # 27 > 24: drop whole turns after the pinned 6, never part of one
    turns = [[30, 31, 32, 33, 34, 35], [40, 41, 42, 43, 44]][dropped_turns - 1:]
    assert eng.tokens == list(range(10, 16)) + sum(turns, []) + [50, 51, 52, 53, 54]
    assert eng.turn_starts == ([6, 12, 17] if dropped_turns == 1 else [6, 11])


class ShiftingSession:
    """Wraps a reference session, implementing shift by recomputation, to check the engine calls it."""

    def __init__(self, inner):
        self.inner, self.calls, self.tokens = inner, [], []
        self.capacity = inner.capacity

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
    s = ShiftingSession(session(model, 16))
    eng = Engine(s, WindowPolicy("window", n_keep=4), can_shift=True)
    eng.feed(list(range(10, 26)))
    eng.feed([1])
    assert s.calls == [(4, 6)] and s.tokens == eng.tokens


def test_generate_stops_and_pending_token(model):
    eng = Engine(session(model, 64))
    t = Timings()
    out = list(eng.generate([5, 6, 7], GREEDY, 5, timings=t))
    assert len(out) == 5 and t.new_tokens == 5 and t.prompt_tokens == 3 and t.ttft_s > 0
    assert len(eng.tokens) == 3 + 4 and eng.pending == out[-1]     # last token sampled, not yet fed
    list(eng.generate([8], GREEDY, 1))
    assert eng.tokens[7:9] == [out[-1], 8]
    stop = out[0]
    eng.reset()
    assert list(eng.generate([5, 6, 7], GREEDY, 5, stop_ids=[stop])) == []
    assert eng.tokens == [5, 6, 7] and eng.pending is None


def test_bad_generation_args(model):
    eng = Engine(session(model, 8))
    with pytest.raises(GlmcoreError, match="max-new-tokens"):
        list(eng.generate([1], GREEDY, 0))
    with pytest.raises(GlmcoreError, match="zero tokens"):
        eng.feed([])
    with pytest.raises(GlmcoreError, match="overflow policy"):
        WindowPolicy("rotate")
