"""StreamingLLM, measured: perplexity over a token stream several times longer than the context.

    python tools/streaming_ppl.py --model DIR --text tests/data/demo_heldout_poems.txt --ctx 256 \
        --tokens 2048 --backends torch,cpu_int4 --out streaming.json --plot streaming.png

The stream is the text's tokens after `[gMASK]sop`, fed one token at a time (teacher forcing); every
token's negative log-likelihood is taken from the logits of the step before it. Policies:

- `full`: the whole stream in one cache (capacity = stream length), whatever the model was trained on;
- `window` (n_keep 4): StreamingLLM, the core's `--overflow window`: when the cache is full, keep the
  first n_keep tokens (attention sinks) and discard half of the rest (glmcore.scheduler.make_room's
  default), shifting in place where the backend can (`can_shift`, cpu_int4) and re-prefilling the
  kept tokens elsewhere (torch), as glmcore.scheduler.Scheduler.shift does;
- `window-nosink` (n_keep 0): the same window without sinks;
- `truncate`: when the cache is full, start again from `[gMASK]sop` with nothing else kept.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

POLICIES = ("full", "window", "window-nosink", "truncate")


def log_softmax_at(logits: np.ndarray, t: int) -> float:
    x = logits.astype(np.float64)
    m = x.max()
    return float(x[t] - m - math.log(np.exp(x - m).sum()))


def stream_nll(backend, cfg, weights, prefix: list[int], tokens: list[int], ctx: int, policy: str,
               options) -> tuple[list[float], int]:
    """Per-token NLL of `tokens` after `prefix` under one policy; and how many times the window moved."""
    from glmcore.backend import LoadOptions
    capacity = len(prefix) + len(tokens) if policy == "full" else ctx
    opts = backend.resolve(LoadOptions(options.precision, options.weights, capacity, options.threads,
                                       extra=dict(options.extra)))
    batch = backend.load_batch(cfg, weights, opts, 1)
    can_shift = backend.capabilities().can_shift
    n_keep = {"window": 4, "window-nosink": 0}.get(policy, 0)
    cache = list(prefix)
    logits = batch.step([(0, cache)])[0]
    nll, moves = [], 0
    try:
        for t in tokens:
            nll.append(-log_softmax_at(logits[:cfg.vocab_size], t))
            if len(cache) + 1 > capacity:
                moves += 1
                if policy == "truncate":
                    batch.reset(0)
                    cache = list(prefix)
                    batch.step([(0, cache)])
                else:
                    discard = max(1, (len(cache) - n_keep) // 2)
                    kept = cache[:n_keep] + cache[n_keep + discard:]
                    if can_shift:
                        batch.shift(0, n_keep, discard)
                    else:
                        batch.reset(0)
                        if kept:
                            batch.step([(0, kept)])
                    cache = kept
            logits = batch.step([(0, [t])])[0]
            cache.append(t)
    finally:
        batch.close()
    return nll, moves


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint directory (default: the built-in demo model)")
    ap.add_argument("--text", required=True)
    ap.add_argument("--ctx", type=int, default=256, help="the window: KV capacity of every policy but full")
    ap.add_argument("--tokens", type=int, default=2048, help="length of the stream")
    ap.add_argument("--backends", default="torch,cpu_int4")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True, help="results JSON")
    ap.add_argument("--plot", help="PNG: NLL per 128-token bin along the stream")
    a = ap.parse_args(argv)
    from glmcore.backend import LoadOptions, registry
    from glmcore.chat import chat_format_for
    from glmcore.config import ModelConfig
    from glmcore.tokenizer import load_tokenizer
    from glmcore.weights import load_weights
    if a.model:
        model = Path(a.model)
    else:
        from glmcore.demo import demo_model_dir
        model = demo_model_dir()
    cfg = ModelConfig.from_dir(model)
    tok = load_tokenizer(model, cfg.family)
    prefix = chat_format_for(tok).prefix
    tokens = tok.encode(Path(a.text).read_text(encoding="utf-8"))[:a.tokens]
    if len(tokens) < a.tokens:
        sys.exit(f"error: {a.text} has only {len(tokens)} tokens; pass --tokens {len(tokens)} or a longer text")
    weights = load_weights(model, cfg)
    results = {"model": str(model), "ctx": a.ctx, "tokens": len(tokens), "rows": []}
    reg = registry()
    for name in a.backends.split(","):
        b = reg.get(name)
        for policy in a.policies.split(","):
            nll, moves = stream_nll(b, cfg, weights, prefix, tokens, a.ctx, policy, LoadOptions(threads=a.threads))
            after = nll[a.ctx - len(prefix):]
            row = {"backend": name, "policy": policy, "ppl": math.exp(float(np.mean(nll))),
                   "ppl_after_first_window": math.exp(float(np.mean(after))), "window_moves": moves,
                   "nll": [round(x, 4) for x in nll]}
            results["rows"].append(row)
            print(f"{name:12s} {policy:14s} ppl {row['ppl']:9.2f}  after the first {a.ctx}: "
                  f"{row['ppl_after_first_window']:9.2f}  ({moves} window moves)", flush=True)
    Path(a.out).write_text(json.dumps(results, indent=1))
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, len(a.backends.split(",")), figsize=(11, 3.8), dpi=100, squeeze=False)
        for ax, name in zip(axes[0], a.backends.split(",")):
            for r in (r for r in results["rows"] if r["backend"] == name):
                nll = np.array(r["nll"])
                bins = np.arange(0, len(nll), 128)
                ax.plot(bins + 64, [math.exp(nll[i:i + 128].mean()) for i in bins], marker=".", label=r["policy"])
            ax.axvline(a.ctx, color="gray", lw=0.8, ls=":")
            ax.set_yscale("log")
            ax.set_title(f"{name} (window {a.ctx})")
            ax.set_xlabel("position in the stream (tokens)")
            ax.set_ylabel("perplexity per 128-token bin")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(a.plot)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
