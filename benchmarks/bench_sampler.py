"""Time per sampled token of the core's sampler at a real vocabulary size, beside the plain full-sort sampler.

    python benchmarks/bench_sampler.py [--vocab 151552] [--size tiny]

Logits are drawn like the synthetic models' (Gaussian, std 6: a few dozen tokens hold the top-p mass);
`--spread` lowers the std to widen the nucleus (a flat distribution makes any exact top-p sampler sort
most of the vocabulary). The default parameters are the GLM models' own (temperature 0.8, top-p 0.8).
Not a timed test: it prints.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from glmcore.sampling import Sampler, SamplingParams, sample_batch


def plain(logits: np.ndarray, params: SamplingParams, rng) -> int:
    x = np.array(logits, dtype=np.float64) / params.temperature
    order = np.argsort(-x, kind="stable")
    probs = np.exp(x[order] - x[order[0]])
    probs /= probs.sum()
    cut = int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1
    return int(order[rng.choice(cut, p=probs[:cut] / probs[:cut].sum())])


def per_token_ms(fn, rows: np.ndarray, rounds: int) -> float:
    fn(rows[0])
    start = time.perf_counter()
    for i in range(rounds):
        fn(rows[i % len(rows)])
    return (time.perf_counter() - start) / rounds * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151552)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--spread", type=float, default=6.0, help="std of the logits")
    ap.add_argument("--size", choices=["tiny", "full"], default="full", help="tiny: CI smoke size")
    ap.add_argument("--threads", type=int, help="ignored (numpy sampling is single-threaded)")
    a = ap.parse_args(argv)
    vocab, rounds = (1024, 20) if a.size == "tiny" else (a.vocab, a.rounds)
    g = np.random.default_rng(0)
    rows = (g.standard_normal((8, vocab)) * a.spread).astype(np.float32)
    params = SamplingParams(seed=0)
    fast = Sampler(params)
    rng = np.random.default_rng(0)
    t_fast = per_token_ms(fast, rows, rounds)
    t_plain = per_token_ms(lambda r: plain(r, params, rng), rows, max(3, rounds // 20))
    greedy = Sampler(SamplingParams(temperature=0))
    t_greedy = per_token_ms(greedy, rows, rounds)
    batch = [Sampler(SamplingParams(seed=i)) for i in range(a.batch)]
    big = rows[np.arange(a.batch) % len(rows)]
    start = time.perf_counter()
    for _ in range(max(1, rounds // a.batch)):
        sample_batch(batch, big, [()] * a.batch)
    t_batch = (time.perf_counter() - start) / max(1, rounds // a.batch) / a.batch * 1e3
    kept = np.mean([len(fast.distribution(r)[0]) for r in rows])
    print(f"vocab {vocab}, logit std {a.spread}, temperature {params.temperature}, top-p {params.top_p}: "
          f"{kept:.0f} tokens in the nucleus on average")
    print(f"| sampler | ms/token |\n|---|---:|\n| fast (core) | {t_fast:.3f} |\n| fast, batch of {a.batch} | "
          f"{t_batch:.3f} |\n| greedy | {t_greedy:.3f} |\n| plain full sort | {t_plain:.3f} |")
    print(f"speed-up vs plain: {t_plain / t_fast:.1f}x")


if __name__ == "__main__":
    main()
