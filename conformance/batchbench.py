"""`glmcore bench --batch 1,4,8,16,32,48`: many sequences at once through the continuous-batching scheduler.

Per batch size B, in the layout of the Ascend deployment's table: the time to prefill the whole batch's
prompts (B prompts of --prompt-len ids, all admitted in one step), the time per decode step (one token
for each of the B sequences), and the aggregate decode tok/s (B x the steps per second), beside batch 1.
The backend is loaded once with max(B) slots; each batch size runs on fresh slots with prompts that
share no prefix (so no prefix reuse hides the prefill). Greedy, stop ids ignored: exactly --gen tokens.
A warm-up round (the smallest size, not reported) pages the weights in; each size then runs `runs`
rounds and reports their medians, since a shared machine's speed swings from minute to minute.
"""
from __future__ import annotations

import statistics
import time

from glmcore.backend import LoadOptions
from glmcore.config import ModelConfig
from glmcore.model import resolve_backend
from glmcore.sampling import SamplingParams
from glmcore.scheduler import Request, Scheduler
from glmcore.weights import load_weights


def parse_sizes(text: str) -> list[int]:
    from glmcore.errors import GlmcoreError
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise GlmcoreError(f"--batch {text!r}: give positive batch sizes, e.g. --batch 1,4,16")
    return sizes


def batch_bench(backend_name: str, model_dir, options: LoadOptions, sizes: list[int], prompt_len: int, gen: int,
                progress=lambda msg: None, runs: int = 1, warmup: int = 1) -> dict:
    from .memory import peak_rss, reset_peak
    backend = resolve_backend(backend_name)
    config = ModelConfig.from_dir(model_dir)
    opts = backend.resolve(options)
    opts.capacity = opts.capacity or prompt_len + gen + 1
    progress(f"bench --batch: loading {backend.name} with {max(sizes)} slots")
    batch = backend.load_batch(config, load_weights(model_dir, config), opts, max(sizes))
    caps = backend.capabilities()
    rounds = 0

    def one_round(B: int) -> dict:
        nonlocal rounds
        for slot in range(batch.n_slots):
            batch.reset(slot)
        sched = Scheduler(batch, caps, n_vocab=config.vocab_size, token_budget=B * (prompt_len + 1))
        # distinct first ids: no two prompts (of this or an earlier round) share a prefix
        prompts = [[(7 + 97 * (rounds * 64 + i)) % config.vocab_size] +
                   [(11 + 13 * j) % config.vocab_size for j in range(prompt_len - 1)] for i in range(B)]
        rounds += 1
        reset = reset_peak()
        start = time.perf_counter()
        handles = [sched.submit(Request(p, SamplingParams(temperature=0), gen)) for p in prompts]
        while not all(h.tokens or h.done for h in handles):
            sched.step()
        prefilled = time.perf_counter()
        steps0 = sched.steps
        sched.run()
        end = time.perf_counter()
        errors = [h.error for h in handles if h.error is not None]
        if errors:
            raise errors[0]
        return {"prefill_ms": (prefilled - start) * 1e3, "step_ms": (end - prefilled) / max(sched.steps - steps0, 1) * 1e3,
                "decode_tps": sum(len(h.tokens) - 1 for h in handles) / (end - prefilled),
                "peak_rss_mib": peak_rss() / 2**20, "peak_reset": reset}

    rows = []
    try:
        for _ in range(warmup):
            progress(f"bench --batch: warm-up ({sizes[0]})")
            one_round(sizes[0])
        for B in sizes:
            rs = []
            for r in range(runs):
                rs.append(one_round(B))
                progress(f"bench --batch: {B}, run {r + 1}/{runs}")
            row = {k: statistics.median(x[k] for x in rs) for k in ("prefill_ms", "step_ms", "decode_tps")}
            row.update(batch=B, prefill_tps=B * prompt_len / (row["prefill_ms"] / 1e3),
                       peak_rss_mib=max(x["peak_rss_mib"] for x in rs), peak_reset=all(x["peak_reset"] for x in rs),
                       runs=rs)
            rows.append(row)
    finally:
        batch.close()
    return {"backend": backend.name, "native": backend.capabilities().native_batch, "precision": opts.precision, "weights": opts.weights,
            "prompt_len": prompt_len, "gen": gen, "threads": opts.threads, "runs": runs, "warmup": warmup,
            "rows": rows}


def format_batch(data: dict) -> str:
    kind = "native batched steps" if data["native"] else "core adapter over single sessions (not faster)"
    out = [f"{data['backend']} {data['precision']}/{data['weights']}, {kind}; prompt {data['prompt_len']} tokens, "
           f"{data['gen']} generated per sequence, threads {data['threads']}; median of {data['runs']} runs after "
           f"{data['warmup']} warm-up", "",
           "| batch | prefill ms (whole batch) | prefill tok/s | ms / decode step | aggregate decode tok/s | "
           "decode / prefill | vs batch 1 | peak RSS MiB |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = data["rows"][0]["decode_tps"] if data["rows"] and data["rows"][0]["batch"] == 1 else None
    for r in data["rows"]:
        ratio = f"{r['decode_tps'] / base:.2f}x" if base else "-"
        out.append(f"| {r['batch']} | {r['prefill_ms']:.1f} | {r['prefill_tps']:.1f} | {r['step_ms']:.1f} | "
                   f"{r['decode_tps']:.1f} | {r['decode_tps'] / r['prefill_tps']:.2f}x | {ratio} | "
                   f"{r['peak_rss_mib']:.0f} |")
    return "\n".join(out)
