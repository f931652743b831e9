"""Time to first token in an agent-like session, with and without the prompt cache (--cache-ram).

    python benchmarks/bench_prompt_cache.py --backend cpu_int4 --size 1b --turns 8 --turn-len 200 --gen 16
    python benchmarks/bench_prompt_cache.py --size tiny --threads 1          # smoke (CI)

`--convs` conversations (default 4) take turns on `--slots` slots (default 2), round robin, as agents resend
their whole growing history every turn: turn t of each conversation is its history (earlier turns and the
model's greedy replies) plus `--turn-len` new ids, and `--gen` ids are generated. With more conversations
than slots every slot has been taken by another conversation before its owner comes back, so without the
cache each turn prefills the whole history again; with it the history is restored from host RAM and only
the new turn is prefilled. Both runs use one loaded batch session, the cache-less one first, with the same
ids; their replies must be identical. Printed: median time to first token over turns 2.. (turn 1 is a cold
prefill in both) and over the last turn, tokens prefilled and restored, the cache's peak bytes, peak RSS.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from glmcore.backend import LoadOptions
from glmcore.config import ModelConfig
from glmcore.engine.prompt_cache import DEFAULT_CACHE_MIB, PromptCache
from glmcore.model import resolve_backend
from glmcore.sampling import SamplingParams
from glmcore.scheduler import Request, Scheduler
from glmcore.weights import load_weights
from glmcore_conformance.bench import model_dir_for
from glmcore_conformance.memory import peak_rss

GREEDY = SamplingParams(temperature=0)


def session(sched: Scheduler, users: list[list[list[int]]], gen: int) -> dict:
    """Every conversation's turns, round robin; per turn the time to first token and what was prefilled."""
    histories = [[] for _ in users]
    ttft = [[] for _ in users[0]]              # [turn][conversation]
    replies, prefilled, restored, cache_peak = [], 0, 0, 0
    start = time.perf_counter()
    for t in range(len(users[0])):
        for c, turns in enumerate(users):
            prompt = histories[c] + turns[t]
            handle = sched.submit(Request(prompt, GREEDY, gen))
            reply = list(handle)
            ttft[t].append(handle.timings.ttft_s)
            prefilled += handle.timings.prompt_tokens
            restored += handle.timings.cached_tokens
            histories[c] = prompt + reply
            replies.append(reply)
            cache = sched.table.cache
            cache_peak = max(cache_peak, cache.nbytes if cache else 0)
    return {"ttft": ttft, "replies": replies, "prefilled": prefilled, "reused": restored, "cache_peak": cache_peak,
            "wall_s": time.perf_counter() - start, "history": max(len(h) for h in histories),
            "stats": sched.table.cache.stats if sched.table.cache else None}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu_int4")
    ap.add_argument("--model")
    ap.add_argument("--size", default="small", choices=["tiny", "small", "1b", "6b"])
    ap.add_argument("--convs", type=int, default=4)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--turns", type=int, help="turns per conversation (default 6; 4 at --size tiny)")
    ap.add_argument("--turn-len", type=int, help="new ids per turn (default 128; 24 at --size tiny)")
    ap.add_argument("--gen", type=int, help="ids generated per turn (default 16; 4 at --size tiny)")
    ap.add_argument("--cache-ram", type=int, default=DEFAULT_CACHE_MIB, help="MiB")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    defaults = (4, 24, 4) if a.size == "tiny" else (6, 128, 16)
    a.turns, a.turn_len, a.gen = (given or default for given, default in zip((a.turns, a.turn_len, a.gen), defaults))
    model_dir, _ = model_dir_for(a.model, a.size)
    backend = resolve_backend(a.backend)
    cfg = ModelConfig.from_dir(model_dir)
    capacity = a.turns * (a.turn_len + a.gen) + 8
    opts = backend.resolve(LoadOptions(threads=a.threads, capacity=capacity))
    t0 = time.perf_counter()
    batch = backend.load_batch(cfg, load_weights(model_dir, cfg), opts, a.slots)
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    users = [[rng.integers(100, cfg.vocab_size, a.turn_len).tolist() for _ in range(a.turns)]
             for _ in range(a.convs)]
    runs = {}
    for name, cache in (("off", None), ("on", PromptCache(a.cache_ram << 20))):
        sched = Scheduler(batch, backend.capabilities(), n_vocab=cfg.vocab_size, prompt_cache=cache)
        runs[name] = session(sched, users, a.gen)
        sched.forget()             # the next run's slot table starts from empty slots
    off, on = runs["off"], runs["on"]
    print(f"{backend.name} {opts.precision}/{opts.weights}, {model_dir.name}, {a.convs} conversations x {a.turns} turns "
          f"on {a.slots} slots, +{a.turn_len} ids and {a.gen} generated per turn (history up to {on['history']} ids), "
          f"threads {a.threads}, load {load_s:.1f} s")
    print("| prompt cache | TTFT median, turns 2.. | TTFT median, last turn | ids prefilled | ids reused | "
          "prefill tok/s | wall |\n|---|---:|---:|---:|---:|---:|---:|")
    for name, r in runs.items():
        later = [x for turn in r["ttft"][1:] for x in turn]
        prefill_s = sum(x for turn in r["ttft"] for x in turn)
        print(f"| {name} | {statistics.median(later) * 1e3:.1f} ms | {statistics.median(r['ttft'][-1]) * 1e3:.1f} ms "
              f"| {r['prefilled']} | {r['reused']} | {r['prefilled'] / prefill_s:.1f} | {r['wall_s']:.1f} s |")
    speedup = (statistics.median([x for t in off["ttft"][1:] for x in t])
               / statistics.median([x for t in on["ttft"][1:] for x in t]))
    last = statistics.median(off["ttft"][-1]) / statistics.median(on["ttft"][-1])
    st = on["stats"]
    print(f"TTFT with the cache: {speedup:.1f}x faster (median, turns 2..), {last:.1f}x on the last turn; "
          f"cache {st.hits} hits, {st.misses} misses, peak {on['cache_peak'] / 2**20:.1f} MiB of --cache-ram "
          f"{a.cache_ram} MiB; peak RSS {peak_rss() / 2**20:.0f} MiB")
    same = off["replies"] == on["replies"]
    print(f"replies identical with and without the cache: {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
