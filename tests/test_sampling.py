import numpy as np
import pytest

from glmcore.errors import SamplingError
from glmcore.sampling import Sampler, SamplingParams

LOGITS = np.array([1.0, 3.0, 2.0, 0.5, -1.0, 2.9], dtype=np.float32)


def draws(params, n=400, history=()):
    s = Sampler(params)
    return [s(LOGITS, history) for _ in range(n)]


def test_greedy():
    assert set(draws(SamplingParams(temperature=0), 10)) == {1}
    assert set(draws(SamplingParams(temperature=1.0, top_k=1), 10)) == {1}


def test_top_k_limits_support():
    assert set(draws(SamplingParams(temperature=5.0, top_p=1.0, top_k=2, seed=0))) == {1, 5}


def test_top_p_limits_support():
    # probs at T=1 (sorted): id 1 holds 0.40, +id 5 0.76, +id 2 0.91
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.3, seed=0))) == {1}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.6, seed=0))) == {1, 5}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.8, seed=0))) == {1, 5, 2}


def test_temperature_matches_softmax_frequencies():
    got = np.bincount(draws(SamplingParams(temperature=2.0, top_p=1.0, seed=1), 4000), minlength=6) / 4000
    p = np.exp(LOGITS / 2.0)
    np.testing.assert_allclose(got, p / p.sum(), atol=0.03)


def test_repetition_penalty_follows_transformers():
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=10.0))
    assert s(LOGITS, history=[1]) == 5          # 3.0 / 10 drops below 2.9
    neg = np.array([-1.0, -1.2], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0, repetition_penalty=2.0))(neg, history=[0]) == 1   # -1*2 < -1.2


def test_seed_reproducible():
    p = SamplingParams(temperature=1.0, top_p=1.0, seed=42)
    assert draws(p, 50) == draws(p, 50)
    assert draws(p, 50) != draws(SamplingParams(temperature=1.0, top_p=1.0, seed=43), 50)


def test_padding_rows_never_sampled():
    logits = np.array([0.0, 0.0, 100.0], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0), n_vocab=2)(logits) in (0, 1)


@pytest.mark.parametrize("kw,match", [
    ({"temperature": -1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top-p"), ({"top_p": 1.5}, "top-p"), ({"top_k": -3}, "top-k"),
    ({"repetition_penalty": 0}, "repetition penalty"), ({"seed": -1}, "seed"),
])
def test_invalid_values_refused(kw, match):
    with pytest.raises(SamplingError, match=match):
        SamplingParams(**kw)


def plain_sample(logits, params, rng, n_vocab=None):
    """The textbook sampler: full sort, softmax, top-p prefix, rng.choice (the pre-batching implementation)."""
    x = np.array(logits[:n_vocab] if n_vocab else logits, dtype=np.float64)
    if params.greedy:
        return int(np.argmax(x)), None
    x /= params.temperature
    if 0 < params.top_k < x.size:
        x[x < np.partition(x, -params.top_k)[-params.top_k]] = -np.inf
    order = np.argsort(-x, kind="stable")
    probs = np.exp(x[order] - x[order[0]])
    probs /= probs.sum()
    if params.top_p < 1.0:
        cut = int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1
        probs, order = probs[:cut] / probs[:cut].sum(), order[:cut]
    return int(order[rng.choice(len(probs), p=probs)]), dict(zip(order.tolist(), probs.tolist()))


@pytest.mark.parametrize("vocab", [7, 100, 1000])
@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.3, top_p=0.95), dict(temperature=1.5, top_p=0.5),
                                dict(temperature=1.0, top_p=1.0), dict(temperature=0.8, top_p=0.9, top_k=20),
                                dict(temperature=0.0)])
def test_fast_sampler_equals_the_plain_one(vocab, kw):
    """Same kept set with the same probabilities, and the same token for the same seed, on many logit shapes
    (flat, peaked, ties)."""
    gen = np.random.default_rng(vocab)
    for trial in range(40):
        scale = [0.1, 1.0, 5.0, 20.0][trial % 4]
        logits = (gen.standard_normal(vocab) * scale).astype(np.float32)
        if trial % 5 == 0:
            logits[gen.integers(0, vocab, 3)] = logits.max()        # ties at the top
        params = SamplingParams(seed=trial, **kw)
        fast, ref_rng = Sampler(params), np.random.default_rng(trial)
        for _ in range(3):
            want, kept = plain_sample(logits, params, ref_rng)
            assert fast(logits) == want
        ids, probs = fast.distribution(logits)
        if kept is None:
            assert probs is None and ids.tolist() == [want]
        else:
            assert ids.tolist() == list(kept)
            np.testing.assert_allclose(probs, list(kept.values()), rtol=1e-9, atol=1e-12)


def test_sample_batch_uses_each_requests_own_parameters_and_rng():
    from glmcore.sampling import sample_batch
    rows = np.stack([LOGITS, LOGITS[::-1].copy(), LOGITS])
    samplers = [Sampler(SamplingParams(temperature=0)), Sampler(SamplingParams(temperature=0)),
                Sampler(SamplingParams(temperature=1.0, top_p=1.0, seed=5))]
    alone = Sampler(SamplingParams(temperature=1.0, top_p=1.0, seed=5))
    for _ in range(20):
        got = sample_batch(samplers, rows, [(), (), ()])
        assert got[:2] == [1, 4] and got[2] == alone(LOGITS)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_logits_are_a_clear_error(bad):
    logits = LOGITS.copy()
    logits[3] = bad
    for params in (SamplingParams(temperature=0), SamplingParams(seed=0)):
        with pytest.raises(SamplingError, match="non-finite logits"):
            Sampler(params)(logits)
