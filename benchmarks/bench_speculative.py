"""What speculative decoding can gain on a backend: (1) the cost of a verification step (1 + k tokens of one
sequence, logits of every position) against a one-token decode step, on a model of real width; (2) prompt
lookup's and the demo model's NextN layer's acceptance and decode speed against plain decoding, on an
input-grounded task (the demo model asked to continue lines it was given twice), on free generation and on
held-out poem prompts (mtp where the backend runs the NextN layer: torch, cpu_int4).

    python benchmarks/bench_speculative.py --backend cpu_int4 --size 1b [--model DIR] [--threads 2]

The projected decode speed-up at a size is about (1 + accepted tokens per step) / (verify step / 1-token step).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from glmcore.backend import LoadOptions
from glmcore.model import load_model, open_checkpoint, resolve_backend
from glmcore.options import parse_opts
from glmcore.sampling import SamplingParams
from glmcore.scheduler import Request, Scheduler, Speculation
from glmcore_conformance.bench import model_dir_for

GREEDY = SamplingParams(temperature=0)


def step_costs(backend_name: str, size: str, model: str | None, threads: int, ks: list[int], runs: int,
               extra: dict | None = None) -> None:
    model_dir = Path(model) if model else model_dir_for(None, size)[0]     # a checkpoint directory or a GGUF
    backend = resolve_backend(backend_name)
    checkpoint = open_checkpoint(model_dir)
    cfg = checkpoint.config
    opts = backend.resolve(LoadOptions(threads=threads, capacity=512, extra=extra or {}))
    batch = backend.load_batch(cfg, checkpoint.weights(), opts, 1)
    prompt = [(11 + 13 * j) % cfg.vocab_size for j in range(256)]
    batch.step([(0, prompt)])
    n = len(prompt)

    def timed(ids, all_logits):
        t = time.perf_counter()
        batch.step([(0, ids)], all_logits)
        took = time.perf_counter() - t
        batch.copy_prefix(0, 0, n)            # drop what the step appended (a rejected draft)
        return took

    sizes = [0] + ks
    timed([5], False)                         # warm-up
    times: dict[int, list[float]] = {k: [] for k in sizes}
    for _ in range(runs):                     # interleaved, so a slow phase of a shared machine hits every size
        for k in sizes:
            times[k].append(timed([5 + i for i in range(1 + k)], k > 0))
    one = statistics.median(times[0])
    print(f"{backend.name} {opts.precision}/{opts.weights}, {model_dir.name} ({cfg.num_layers} layers, hidden "
          f"{cfg.hidden_size}, vocab {cfg.vocab_size}), kv {n}, threads {threads}, median (min) of {runs}")
    print("| tokens in the step (1 + drafts) | ms | / 1-token step |\n|---:|---:|---:|")
    for k in sizes:
        t = statistics.median(times[k])
        print(f"| {1 + k} | {t * 1e3:.1f} ({min(times[k]) * 1e3:.1f}) | {t / one:.2f} "
              f"({min(times[k]) / min(times[0]):.2f}) |")
    batch.close()


HELDOUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "demo_heldout_prompts.json"   # never trained on
POEM = ("床前明月光，疑是地上霜。举头望明月，低头思故乡。", "白日依山尽，黄河入海流。欲穷千里目，更上一层楼。")


def drafters(backend_name: str, threads: int, k: int, gen: int, n_prompts: int) -> None:
    """Prompt lookup and the demo model's trained NextN layer (where the backend runs it) against plain greedy
    decoding on the demo model: an input-grounded task, free generation, and held-out poem prompts."""
    m = load_model(None, backend_name, LoadOptions(threads=threads), slots=1)
    caps, batch, tok = m.backend.capabilities(), m.scheduler.batch, m.tokenizer
    heldout = [p["prompt"] for p in json.loads(HELDOUT.read_text(encoding="utf-8"))][:n_prompts]
    tasks = {"grounded (continue lines given twice)": [f"{POEM[0]}{POEM[1]}\n{POEM[0]}"],
             "free generation": ["写一首关于秋天的诗"],
             f"held-out poem prompts ({len(heldout)})": heldout}
    methods = ["ngram"] + (["mtp"] if batch.has_nextn else [])
    print(f"\nspeculative decoding on the demo model ({m.backend.name}, threads {threads}, --draft-tokens {k}, "
          f"greedy, up to {gen} new tokens{'' if batch.has_nextn else '; mtp: this backend does not run NextN'})")
    print("| task | method | plain tok/s | speculative tok/s | speed-up | drafted | accepted | acceptance | "
          "accepted / step |\n|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, texts in tasks.items():
        prompts = [m.chat_format.encode_messages([_user(t)]) for t in texts]
        runs = 3 if len(prompts) == 1 else 1
        rate = {}
        for method in [None] + methods:
            sched = Scheduler(batch, caps, n_vocab=tok.n_vocab,
                              speculation=Speculation(method, k) if method else None)
            outs, best = [], None
            for _ in range(runs):
                n_new, took, outs = 0, 0.0, []
                for prompt in prompts:
                    sched.forget()
                    h = sched.submit(Request(prompt, GREEDY, gen, stop_ids=m.chat_format.stop_ids))
                    h.wait()
                    n_new, took = n_new + h.timings.new_tokens - 1, took + h.timings.decode_s
                    outs.append(h.tokens)
                best = max(best or 0.0, n_new / took if took else 0.0)
            rate[method] = (best, outs, sched)
            if method is None:
                continue
            assert outs == rate[None][1], f"{method} speculation changed the greedy output"
            plain, fast = rate[None][0], best
            steps = max(sched.steps // runs - len(prompts), 1)
            drafted, accepted = sched.drafted // runs, sched.accepted // runs
            print(f"| {name} | {method} | {plain:.1f} | {fast:.1f} | {fast / plain:.2f} | {drafted} | {accepted} | "
                  f"{accepted / max(drafted, 1):.0%} | {accepted / steps:.2f} |")
    m.close()


def _user(text):
    from glmcore.chat import as_message
    return as_message({"role": "user", "content": text})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu_int4")
    ap.add_argument("--model")
    ap.add_argument("--size", default="1b", choices=["tiny", "small", "1b", "6b"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--prompts", type=int, default=8, help="held-out poem prompts to generate from")
    ap.add_argument("--skip-lookup", action="store_true", help="only the step costs")
    ap.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                    help="backend option for the step costs, e.g. packed=DIR (a converted model of --model)")
    a = ap.parse_args(argv)
    step_costs(a.backend, a.size, a.model, a.threads, [1, 2, 4, 8], a.runs, parse_opts(a.opt))
    if not a.skip_lookup:
        drafters(a.backend, a.threads, a.draft_tokens, a.gen, a.prompts)


if __name__ == "__main__":
    main()
