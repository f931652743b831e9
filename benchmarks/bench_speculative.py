"""What speculative decoding can gain on a backend: (1) the cost of a verification step (1 + k tokens of one
sequence, logits of every position) against a one-token decode step, on a model of real width; (2) prompt
lookup's acceptance and decode speed against plain decoding, on an input-grounded task (the demo model asked
to continue lines it was given twice) and on free generation.

    python benchmarks/bench_speculative.py --backend cpu_int4 --size 1b [--model DIR] [--threads 2]

The projected decode speed-up at a size is about (1 + accepted tokens per step) / (verify step / 1-token step).
"""
from __future__ import annotations

import argparse
import statistics
import time

from glmcore.backend import LoadOptions
from glmcore.config import ModelConfig
from glmcore.model import load_model, resolve_backend
from glmcore.sampling import SamplingParams
from glmcore.scheduler import Request, Scheduler, Speculation
from glmcore.weights import load_weights
from glmcore_conformance.bench import model_dir_for

GREEDY = SamplingParams(temperature=0)


def step_costs(backend_name: str, size: str, model: str | None, threads: int, ks: list[int], runs: int) -> None:
    model_dir, _ = model_dir_for(model, size)
    backend = resolve_backend(backend_name)
    cfg = ModelConfig.from_dir(model_dir)
    opts = backend.resolve(LoadOptions(threads=threads, capacity=512))
    batch = backend.load_batch(cfg, load_weights(model_dir, cfg), opts, 1)
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


POEM = ("床前明月光，疑是地上霜。举头望明月，低头思故乡。", "白日依山尽，黄河入海流。欲穷千里目，更上一层楼。")


def lookup(backend_name: str, threads: int, k: int, gen: int) -> None:
    m = load_model(None, backend_name, LoadOptions(threads=threads), slots=1)
    caps, batch, tok = m.backend.capabilities(), m.scheduler.batch, m.tokenizer
    tasks = {"grounded (continue lines given twice)": f"{POEM[0]}{POEM[1]}\n{POEM[0]}",
             "free generation": "写一首关于秋天的诗"}
    print(f"\nprompt lookup on the demo model ({m.backend.name}, threads {threads}, --draft-tokens {k}, greedy, "
          f"{gen} new tokens)")
    print("| task | plain tok/s | ngram tok/s | speed-up | drafted | accepted | accepted / step |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for name, text in tasks.items():
        prompt = m.chat_format.encode_messages([_user(text)])
        result = {}
        for spec in (None, Speculation("ngram", k)):
            m.scheduler.forget()
            sched = Scheduler(batch, caps, n_vocab=tok.n_vocab, speculation=spec)
            rates = []
            for _ in range(3):
                sched.forget()
                h = sched.submit(Request(prompt, GREEDY, gen, stop_ids=()))
                h.wait()
                rates.append(h.timings.decode_tps)
            result[spec is not None] = (statistics.median(rates), h.tokens, sched)
        (plain, ref, _), (fast, out, s) = result[False], result[True]
        assert out == ref, "speculation changed the greedy output"
        steps = max(s.steps // 3 - 1, 1)
        print(f"| {name} | {plain:.1f} | {fast:.1f} | {fast / plain:.2f} | {s.drafted // 3} | {s.accepted // 3} | "
              f"{s.accepted / 3 / steps:.2f} |")
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
    ap.add_argument("--skip-lookup", action="store_true", help="only the step costs")
    a = ap.parse_args(argv)
    step_costs(a.backend, a.size, a.model, a.threads, [1, 2, 4, 8], a.runs)
    if not a.skip_lookup:
        lookup(a.backend, a.threads, a.draft_tokens, a.gen)


if __name__ == "__main__":
    main()
