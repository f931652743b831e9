"""What constrained decoding costs: the masking cost per token per request at GLM-4's 151,552 ids, and the
aggregate decode speed of 16 constrained requests beside 16 unconstrained ones on one backend.

    python benchmarks/bench_structured.py [--backend cpu_int4] [--size 1b] [--threads 16] [--gen 64]
    python benchmarks/bench_structured.py --size tiny --threads 1          # CI smoke size

1. Masking: a JSON Schema with nested objects, bounded strings, enums, integer ranges and arrays, walked by
   seeded random generation (random logits, masked, sampled); each step times what the scheduler does per
   constrained request -- the grammar's bitmask (llguidance), its expansion and the masked copy of the
   logits row (numpy) -- alone and for a batch of 16 (llguidance's executor). The tokenizer is GLM-4's real
   one when shared/models/glm-4-9b-chat is present (--tokenizer DIR), else the model's own padded to 151,552.
2. Throughput: 16 requests of `--gen` tokens each through the scheduler, all constrained (an array of
   objects that cannot close within --gen tokens, so both sides generate the same number of tokens) or
   none, alternating round by round on one loaded model; medians and their ratio are printed.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from glmcore import structured
from glmcore.backend import LoadOptions
from glmcore.model import load_model
from glmcore.sampling import Sampler, SamplingParams
from glmcore.scheduler import Request
from glmcore.structured import Grammar, compile_grammar, mask_rows
from glmcore.tokenizer import load_tokenizer
from glmcore_conformance.bench import model_dir_for

GLM4_LOGITS = 151552
REAL_GLM4 = Path(__file__).resolve().parents[2] / "shared" / "models" / "glm-4-9b-chat"
ITEM = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "kind": {"enum": ["person", "robot", "animal"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
    "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                              "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
             "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "kind", "tags", "home"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": ITEM, "minItems": 1, "maxItems": 4}},
          "required": ["items"], "additionalProperties": False}
ENDLESS = {"type": "array", "items": ITEM, "minItems": 100000}     # never complete within --gen tokens


def masking(tokenizer, n_logits: int, steps: int, batch: int, seed: int = 0) -> tuple[list[float], list[float]]:
    """Per request-token seconds of mask_rows: one request at a time, and a batch (per request)."""
    constraint = compile_grammar(tokenizer, Grammar.json_schema(SCHEMA), n_logits, leading_space=False)
    rng = np.random.default_rng(seed)
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=1.0, seed=seed), tokenizer.n_vocab)
    stops = [tokenizer.eos_id]
    executor = structured.executor()

    def walk(matchers, timings, per):
        for _ in range(steps):
            live = [m for m in matchers if not m.stopped]
            if not live:
                return
            rows = [(rng.standard_normal(n_logits) * 4).astype(np.float32) for _ in live]
            t = time.perf_counter()
            masked, alive = mask_rows(live, rows, [stops] * len(live), [True] * len(live), executor)
            timings.append((time.perf_counter() - t) / per(len(live)))
            for m, row, ok in zip(live, masked, alive):
                token = sampler(row) if ok else tokenizer.eos_id
                if token == tokenizer.eos_id or m.advance(token) is not None:
                    m.ll.consume_token(tokenizer.eos_id)      # done: stop this walk

    alone: list[float] = []
    while len(alone) < steps:
        walk([constraint.start()], alone, lambda n: 1)
    together: list[float] = []
    while len(together) < max(8, steps // batch):
        walk([constraint.start() for _ in range(batch)], together, lambda n: n)
    return alone, together


def throughput(model, n: int, gen: int, constrained: bool) -> float:
    """Aggregate generated tok/s of n requests of gen tokens each."""
    sched, tok = model.scheduler, model.tokenizer
    sched.forget()
    constraint = (compile_grammar(tok, Grammar.json_schema(ENDLESS), model.config.vocab_size)
                  if constrained else None)
    prefix = [tok.special_ids["[gMASK]"], tok.special_ids.get("<sop>", tok.special_ids.get("sop"))]
    start = time.perf_counter()
    handles = [sched.submit(Request(prefix + tok.encode(f"record {i}:"), SamplingParams(temperature=1.0, seed=i),
                                    gen, (), constraint=constraint)) for i in range(n)]
    sched.run()
    wall = time.perf_counter() - start
    made = sum(len(h.tokens) for h in handles)
    bad = [h for h in handles if h.error is not None]
    if bad:
        raise SystemExit(f"a request failed: {bad[0].error}")
    return made / wall


def ms(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu_int4")
    ap.add_argument("--model", help="a checkpoint directory (default: the synthetic glm4 of --size)")
    ap.add_argument("--size", default="1b", choices=["tiny", "small", "1b", "6b"])
    ap.add_argument("--tokenizer", help="a GLM-4 checkpoint directory whose tokenizer the masking part uses")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2000, help="masking steps timed")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    if a.size == "tiny":
        a.gen, a.rounds, a.steps = 8, 1, 200
    model_dir, _ = model_dir_for(a.model, a.size, family="glm4")
    tok_dir = Path(a.tokenizer) if a.tokenizer else REAL_GLM4 if (REAL_GLM4 / "tokenizer.model").is_file() else None
    tok = load_tokenizer(tok_dir or model_dir, "glm4")
    which = f"{tok_dir.name}'s tokenizer ({tok.n_vocab} ids)" if tok_dir else f"the model's tokenizer ({tok.n_vocab} ids)"
    alone, together = masking(tok, GLM4_LOGITS, a.steps, a.requests)
    print(f"masking, {which} at {GLM4_LOGITS} logits, JSON Schema of nested objects/arrays/enums/ranges:")
    print(f"| requests per step | steps | median ms/token/request | p99 ms/token/request |\n|---|---:|---:|---:|\n"
          f"| 1 | {len(alone)} | {ms(alone, 50):.3f} | {ms(alone, 99):.3f} |\n"
          f"| {a.requests} | {len(together)} | {ms(together, 50):.3f} | {ms(together, 99):.3f} |")

    model = load_model(model_dir, a.backend, LoadOptions(threads=a.threads, capacity=64 + a.gen),
                       slots=a.requests, token_budget=max(256, 16 * a.requests))
    free, con = [], []
    throughput(model, a.requests, min(a.gen, 4), False)       # warm-up (kernels, caches)
    for _ in range(a.rounds):
        free.append(throughput(model, a.requests, a.gen, False))
        con.append(throughput(model, a.requests, a.gen, True))
    model.close()
    f, c = statistics.median(free), statistics.median(con)
    print(f"\n{a.backend}, synthetic glm4 {a.size if not a.model else a.model} ({model.config.vocab_size} logits), "
          f"{a.requests} requests x {a.gen} tokens, {a.threads} threads, median of {a.rounds}:")
    print(f"| requests | aggregate tok/s |\n|---|---:|\n| {a.requests} unconstrained | {f:.1f} |\n"
          f"| {a.requests} constrained (JSON Schema) | {c:.1f} |")
    print(f"constrained / unconstrained: {c / f:.2f}x")


if __name__ == "__main__":
    main()
