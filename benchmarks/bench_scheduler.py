"""What the scheduler costs one sequence: decode through the core's generation loop (the continuous-
batching scheduler, one request) beside a bare loop of BatchSession.step + sampling on the same session.

    python benchmarks/bench_scheduler.py --backend cpu_int4 --size 1b [--model DIR] [--gen 64] [--rounds 3]

The two alternate round by round on one loaded batch session of one slot (greedy, stop ids ignored), so a
slow phase of a shared machine hits both alike; medians are printed with their ratio.
"""
from __future__ import annotations

import argparse
import statistics
import time

from glmcore.backend import BatchSession, LoadOptions
from glmcore.config import ModelConfig
from glmcore.model import resolve_backend
from glmcore.sampling import Sampler, SamplingParams
from glmcore.scheduler import Request, Scheduler
from glmcore.weights import load_weights
from glmcore_conformance.bench import model_dir_for

GREEDY = SamplingParams(temperature=0)


def bare_loop(batch: BatchSession, prompt: list[int], gen: int, n_vocab: int) -> float:
    """Decode tok/s of the loop without the scheduler: prefill, then one step + sample per token."""
    batch.reset(0)
    sampler = Sampler(GREEDY, n_vocab)
    token = sampler(batch.step([(0, prompt)])[0])
    start = time.perf_counter()
    for _ in range(gen - 1):
        token = sampler(batch.step([(0, [token])])[0])
    return (gen - 1) / (time.perf_counter() - start)


def scheduled(sched: Scheduler, prompt: list[int], gen: int) -> float:
    sched.forget()
    handle = sched.submit(Request(prompt, GREEDY, gen))
    n = sum(1 for _ in handle)
    assert n == gen
    return handle.timings.decode_tps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu_int4")
    ap.add_argument("--model")
    ap.add_argument("--size", default="small", choices=["tiny", "small", "1b", "6b"])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    if a.size == "tiny":
        a.prompt_len, a.gen, a.rounds = 8, 8, 1
    model_dir, _ = model_dir_for(a.model, a.size)
    backend = resolve_backend(a.backend)
    cfg = ModelConfig.from_dir(model_dir)
    opts = backend.resolve(LoadOptions(threads=a.threads, capacity=a.prompt_len + a.gen + 1))
    batch = backend.load_batch(cfg, load_weights(model_dir, cfg), opts, 1)
    sched = Scheduler(batch, backend.capabilities(), n_vocab=cfg.vocab_size)
    prompt = [(11 + 13 * j) % cfg.vocab_size for j in range(a.prompt_len)]
    bare, through = [], []
    for _ in range(a.rounds):
        bare.append(bare_loop(batch, prompt, a.gen, cfg.vocab_size))
        through.append(scheduled(sched, prompt, a.gen))
    b, s = statistics.median(bare), statistics.median(through)
    print(f"{backend.name} {opts.precision}/{opts.weights}, {model_dir.name}, prompt {a.prompt_len}, {a.gen} generated, "
          f"threads {a.threads}, median of {a.rounds}")
    print(f"| loop | decode tok/s |\n|---|---:|\n| bare BatchSession.step + sampler | {b:.1f} |\n"
          f"| through the scheduler (one request) | {s:.1f} |")
    print(f"scheduler / bare: {s / b:.3f}")


if __name__ == "__main__":
    main()
