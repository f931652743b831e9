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
