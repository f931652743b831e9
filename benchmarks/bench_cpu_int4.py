"""cpu_int4 benchmark: prefill and decode tok/s beside torch fp32 (and openvino_amx where installed),
bytes per token, fraction of the measured memory bandwidth, peak RSS against the packed model size.

    python benchmarks/bench_cpu_int4.py --size tiny                  # CI smoke, seconds
    python benchmarks/bench_cpu_int4.py --size 1b --model /tmp/glm-1b --threads 2
    python benchmarks/bench_cpu_int4.py --size 1b --batch 1,4,16 --group-size 32   # native batch steps
    glmcore make-model --family glm4-moe-lite --size flash --layers 12 --out /tmp/flash12     # GLM-4.7-Flash shape
    python benchmarks/bench_cpu_int4.py --model /tmp/flash12 --group-size 32 --no-torch

Where $GLMCORE_LLAMACPP names a built llama.cpp (conformance/llamacpp.py), llama.cpp Q4_0 of the same checkpoint
(its own converter and llama-quantize) runs right after cpu_int4 in the same run (llama-bench, the same prompt
length, decode steps and threads), and the ratios are taken from that run. Bytes per token count what a decode
step reads: the layers' matrices (of an MoE layer the top_k chosen experts' share, the shared expert and the fp32
router), the output layer, and the KV cache at mid-run (the latent cache for latent attention).

Each backend runs in its own process, so one's threads, memory and page cache state do not leak into
another's numbers (torch's OpenMP pool keeps spinning after its ops, for one). The int4 model is
converted in a separate process before the measured one, so peak RSS is that of serving, not quantizing.
Timings on a shared machine are noisy: prefill takes the best of --repeat runs, decode the median step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from glmcore_conformance.memory import peak_rss, reset_peak
from glmcore_plugins.cpu_int4.native import ISAS

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- memory bandwidth (numpy)

def bandwidth(threads: int, mib: int = 512, repeat: int = 5) -> dict:
    """Read and copy bandwidth with `threads` numpy threads (ufunc loops release the GIL). The read test
    is a max-reduction: numpy's float sum is compute-bound here (about 8 GB/s even on cached data),
    which would understate the bandwidth and flatter the kernels; max runs ~3x faster than memory."""
    a = np.ones(mib << 18, np.float32)              # mib MiB, far beyond the caches
    b = np.empty_like(a)
    parts = np.array_split(np.arange(a.size), threads)
    spans = [(p[0], p[-1] + 1) for p in parts]
    out = {}
    with ThreadPoolExecutor(threads) as ex:
        def timed(fn):
            best = float("inf")
            for _ in range(repeat):
                t = time.perf_counter()
                list(ex.map(fn, spans))
                best = min(best, time.perf_counter() - t)
            return best
        out["read_GBps"] = a.nbytes / timed(lambda s: a[s[0]:s[1]].max()) / 1e9
        out["copy_GBps"] = 2 * a.nbytes / timed(lambda s: np.copyto(b[s[0]:s[1]], a[s[0]:s[1]])) / 1e9
    return out


# ---------------------------------------------------------------- one backend in this process

def measure(args) -> dict:
    from glmcore.backend import LoadOptions, registry
    from glmcore.config import ModelConfig
    from glmcore.weights import load_weights
    cfg = ModelConfig.from_dir(args.model)
    weights = load_weights(args.model, cfg)
    backend = registry().get(args.worker)
    extra = json.loads(args.extra or "{}")
    opts = backend.resolve(LoadOptions(weights=args.weights, capacity=args.prefill + args.decode + 8,
                                       threads=args.threads, cache_dir=Path(args.cache), extra=extra))
    t = time.perf_counter()
    session = backend.load(cfg, weights, opts)
    load_s = time.perf_counter() - t
    rng = np.random.default_rng(0)
    prompt = [int(i) for i in rng.integers(0, cfg.vocab_size, args.prefill)]
    times = []
    for _ in range(args.repeat):
        session.reset()
        t = time.perf_counter()
        logits = session.prefill(prompt)
        times.append(time.perf_counter() - t)
    # Decode in rounds, each next to a bandwidth probe in this same process: on a shared machine the
    # bandwidth left to us moves by 2x within a minute, so a fraction is only meaningful pairwise.
    steps, rounds = [], []
    tok = int(np.argmax(logits))
    per_round = max(1, args.decode // args.rounds)
    peak, exact = peak_rss(), True          # loading and prefill
    for _ in range(args.rounds):
        bw = bandwidth(args.threads, mib=args.bw_mib, repeat=2)["read_GBps"]
        exact = reset_peak() and exact       # the probe's arrays are freed; do not count them
        t0 = time.perf_counter()
        for _ in range(per_round):
            t = time.perf_counter()
            logits = session.decode(tok)
            steps.append(time.perf_counter() - t)
            tok = int(np.argmax(logits))
        rounds.append({"bw_GBps": bw, "decode_tps": per_round / (time.perf_counter() - t0)})
        peak = max(peak, peak_rss())
    res = {"backend": args.worker, "load_s": load_s, "prefill_tokens": args.prefill,
           "prefill_tps": args.prefill / min(times), "prefill_tps_median": args.prefill / statistics.median(times),
           "decode_tps": 1.0 / statistics.median(steps), "decode_tps_mean": len(steps) / sum(steps),
           "rounds": rounds, "peak_rss": peak, "peak_rss_exact": exact}
    if hasattr(session, "info"):
        res["info"] = session.info()
    session.close()
    return res


def measure_batch(args) -> dict:
    """Per batch size B: one step with the B prompts (prefill of the whole batch), then decode steps of
    one token per sequence; aggregate decode tok/s = B / median step time."""
    from glmcore.backend import LoadOptions, registry
    from glmcore.config import ModelConfig
    from glmcore.weights import load_weights
    cfg = ModelConfig.from_dir(args.model)
    weights = load_weights(args.model, cfg)
    backend = registry().get(args.worker)
    extra = json.loads(args.extra or "{}")
    opts = backend.resolve(LoadOptions(capacity=args.prefill + args.decode + 8, threads=args.threads,
                                       cache_dir=Path(args.cache), extra=extra))
    rng = np.random.default_rng(0)
    rows = []
    for B in sorted(int(b) for b in args.batch.split(",")):
        session = backend.load_batch(cfg, weights, opts, B)
        prompts = [[int(i) for i in rng.integers(0, cfg.vocab_size, args.prefill)] for _ in range(B)]
        best = float("inf")
        for _ in range(args.repeat):
            for slot in range(B):
                session.reset(slot)
            t = time.perf_counter()
            logits = session.step(list(enumerate(prompts)))
            best = min(best, time.perf_counter() - t)
        toks = np.argmax(logits, axis=1)
        steps = []
        for _ in range(args.decode):
            t = time.perf_counter()
            logits = session.step([(slot, [int(toks[slot])]) for slot in range(B)])
            steps.append(time.perf_counter() - t)
            toks = np.argmax(logits, axis=1)
        step_s = statistics.median(steps)
        rows.append({"batch": B, "prefill_ms": 1e3 * best, "prefill_tps": B * args.prefill / best,
                     "step_ms": 1e3 * step_s, "decode_tps": B / step_s, "native": backend.capabilities().native_batch})
        info = session.info() if hasattr(session, "info") else None
        session.close()
    return {"backend": args.worker, "rows": rows, "info": info}


def print_batch(label: str, res: dict, args) -> None:
    rows = res["rows"]
    one = next((r for r in rows if r["batch"] == 1), None)
    print(f"\n{label} ({'native batch steps' if rows[0]['native'] else 'adapter over single sessions'}): "
          f"prompt {args.prefill} tokens per sequence, {args.decode} decode steps")
    print(f"{'batch':>6}{'prefill ms':>12}{'prefill tok/s':>15}{'ms/step':>10}{'decode tok/s':>14}"
          f"{'x batch 1':>11}{'of prefill':>12}")
    for r in rows:
        vs1 = f"{r['decode_tps'] / one['decode_tps']:.2f}x" if one else "-"
        print(f"{r['batch']:>6}{r['prefill_ms']:>12.0f}{r['prefill_tps']:>15.1f}{r['step_ms']:>10.1f}"
              f"{r['decode_tps']:>14.1f}{vs1:>11}{r['decode_tps'] / r['prefill_tps']:>11.2f}x")


def run_worker(args, worker: str, extra: dict | None = None, weights: str | None = None) -> dict | None:
    cmd = [sys.executable, __file__, "--worker", worker, "--model", str(args.model), "--cache", str(args.cache),
           "--prefill", str(args.prefill), "--decode", str(args.decode), "--repeat", str(args.repeat),
           "--rounds", str(args.rounds), "--bw-mib", str(args.bw_mib),
           "--threads", str(args.threads), "--extra", json.dumps(extra or {})]
    if args.batch:
        cmd += ["--batch", args.batch]
    if weights:
        cmd += ["--weights", weights]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode != 0:
        print(f"  {worker}: failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def convert(args, extra: dict) -> None:
    """Quantize into the cache in a separate process (prints the progress bar and bits per weight)."""
    code = ("import sys, json; from pathlib import Path; from glmcore.config import ModelConfig; "
            "from glmcore.weights import load_weights; from glmcore_plugins.cpu_int4.quant import QuantOptions, "
            "ensure_packed; m=sys.argv[1]; cfg=ModelConfig.from_dir(m); "
            "ensure_packed(cfg, load_weights(m, cfg), QuantOptions.from_extra(json.loads(sys.argv[3])), "
            "Path(sys.argv[2]), progress=lambda s: print(s, file=sys.stderr, flush=True))")
    subprocess.run([sys.executable, "-c", code, str(args.model), str(args.cache), json.dumps(extra)], check=True,
                   cwd=ROOT)


def llamacpp_row(args) -> dict | None:
    """llama.cpp Q4_0 on the same checkpoint (one llama-bench repetition per --repeat, the best prefill and the
    median decode), or None where $GLMCORE_LLAMACPP is unset or the conversion fails (it is optional)."""
    from glmcore.errors import GlmcoreError
    from glmcore_conformance.llamacpp import find
    lc = find()
    if lc is None:
        return None
    try:
        gguf = lc.gguf(Path(args.model), "int4", progress=lambda m: print(f"  {m}", flush=True))
        # its decode after the prompt's tokens of context, as cpu_int4's decode steps follow its prefill
        runs = [lc.bench(gguf, args.prefill, args.decode, args.threads, depth=args.prefill) for _ in range(args.repeat)]
    except GlmcoreError as e:
        print(f"  llama.cpp: skipped ({e})")
        return None
    return {"label": "llama.cpp Q4_0", "prefill_tps": max(r["prefill_tps"] for r in runs),
            "decode_tps": statistics.median(r["decode_tps"] for r in runs),
            "peak_rss": max(r["peak_rss_mib"] for r in runs) * 2**20}


# ---------------------------------------------------------------- the report

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--size", default="tiny", choices=["tiny", "small", "1b", "6b", "9b", "air", "355b", "flash"])
    ap.add_argument("--family", choices=["chatglm2", "chatglm3", "glm4", "glm4-moe", "glm4-moe-lite"],
                    help="default chatglm3, glm4 at --size 9b")
    ap.add_argument("--no-llamacpp", action="store_true", help="leave out llama.cpp even where $GLMCORE_LLAMACPP is set")
    ap.add_argument("--model", help="checkpoint dir (default: the synthetic --size, made once in the cache)")
    ap.add_argument("--cache", help="packed-model cache (default: the glmcore cache)")
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4, help="decode rounds, each beside a bandwidth probe")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--group-size", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--asym", action="store_true", help="asymmetric int4 (default symmetric, Q4_0)")
    ap.add_argument("--head-bits", type=int, default=None)
    ap.add_argument("--kv-dtype", default=None)
    ap.add_argument("--isa", default=None, choices=ISAS,
                    help="kernel variant (default: auto, the fastest timed on this CPU), e.g. avx2 on an AVX-512 machine")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch fp32 reference")
    ap.add_argument("--no-openvino", action="store_true")
    ap.add_argument("--batch", help="batch sizes, e.g. 1,4,16: prefill ms of the whole batch, ms per decode "
                    "step and aggregate decode tok/s per size (cpu_int4 only)")
    ap.add_argument("--bw-mib", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--extra", help=argparse.SUPPRESS)
    ap.add_argument("--weights", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.cache is None:
        from glmcore.cache import cache_root
        args.cache = str(cache_root() / "converted")
    if args.bw_mib is None:
        args.bw_mib = 128 if args.size == "tiny" else 512
    if args.batch:
        try:
            sizes = [int(b) for b in args.batch.split(",")]
        except ValueError:
            sizes = []
        if not sizes or min(sizes) < 1:
            ap.error(f"--batch {args.batch!r}: give positive batch sizes separated by commas, e.g. 1,4,16")
    if args.worker:
        print(json.dumps(measure_batch(args) if args.batch else measure(args)))
        return 0

    from glmcore_conformance.bench import model_dir_for   # --model, or the synthetic size, made once
    args.model = model_dir_for(args.model, args.size, args.family)[0]
    from glmcore.config import ModelConfig
    cfg = ModelConfig.from_dir(args.model)
    print(f"model: {args.model} ({cfg.family}, {cfg.num_params() / 1e6:.0f}M parameters); "
          f"{args.threads} threads; prompt {args.prefill} tokens, {args.decode} decode steps")

    bw = bandwidth(args.threads, mib=args.bw_mib)
    print(f"memory bandwidth (numpy, {args.threads} threads) at start: read {bw['read_GBps']:.1f} GB/s, "
          f"copy {bw['copy_GBps']:.1f} GB/s; each decode round is paired with its own read probe")

    if args.batch:
        for g in args.group_size:
            extra = {"group_size": g, "sym": not args.asym}
            convert(args, extra)
            if args.isa:
                extra["isa"] = args.isa
            r = run_worker(args, "cpu_int4", extra)
            if r:
                print_batch(f"cpu_int4 g{g} {'asym' if args.asym else 'sym'}, kernels {r['info']['isa']}, "
                            f"{args.threads} threads", r, args)
        return 0

    rows = []
    for g in args.group_size:
        extra = {"group_size": g, "sym": not args.asym}
        if args.head_bits:
            extra["head_bits"] = args.head_bits
        if args.kv_dtype:
            extra["kv_dtype"] = args.kv_dtype
        if args.isa:
            extra["isa"] = args.isa
        convert(args, {k: v for k, v in extra.items() if k not in ("kv_dtype", "isa")})
        r = run_worker(args, "cpu_int4", extra)
        if r:
            r["label"] = f"cpu_int4 g{g} {'asym' if args.asym else 'sym'}"
            rows.append(r)
    lc = None if args.no_llamacpp else llamacpp_row(args)
    if lc:
        rows.append(lc)
    torch_row = None
    if not args.no_torch:
        torch_row = run_worker(args, "torch")
        if torch_row:
            torch_row["label"] = "torch fp32"
            rows.append(torch_row)
    if not args.no_openvino:
        from glmcore.backend import registry
        reg = registry()
        if "openvino_amx" in reg.entries and reg.probe("openvino_amx").ready:
            fmts = reg.get("openvino_amx").capabilities().weight_formats
            w = "int4" if "int4" in fmts else None
            r = run_worker(args, "openvino_amx", weights=w)
            if r:
                r["label"] = f"openvino_amx {w or 'default'}"
                rows.append(r)
        else:
            print("  openvino_amx: not installed or not ready here; skipped")

    print()
    print(f"{'backend':<22}{'prefill tok/s':>14}{'decode tok/s':>14}{'peak RSS':>11}{'MB/token':>10}"
          f"{'GB/s':>7}{'bw':>7}{'of bw':>7}{'roofline':>10}")
    for r in rows:
        line = (f"{r['label']:<22}{r['prefill_tps']:>14.1f}{r['decode_tps']:>14.1f}"
                f"{r['peak_rss'] / 2**20:>9.0f}Mi")
        info = r.get("info")
        if info:
            ctx = args.prefill + args.decode / 2
            kv_elt = 2 if info["kv_dtype"] == "f16" else 4
            per_layer = getattr(cfg, "latent_size", 0) or 2 * cfg.kv_size     # a latent row, or K and V
            kv = cfg.num_layers * per_layer * kv_elt * ctx        # KV cache read per step, mid-run
            per_tok = info["bytes_per_token"] + kv
            # per round: achieved GB/s against the bandwidth probed right before it; report the median
            fr = sorted(per_tok * x["decode_tps"] / 1e9 / x["bw_GBps"] for x in r["rounds"])
            frac = statistics.median(fr)
            bw_med = statistics.median(x["bw_GBps"] for x in r["rounds"])
            gbps = per_tok * r["decode_tps"] / 1e9
            r["roofline"] = {"bytes_per_token": per_tok, "fraction_median": frac, "fractions": fr, "bw_median": bw_med}
            line += (f"{per_tok / 1e6:>10.1f}{gbps:>7.1f}{bw_med:>7.1f}{frac:>7.0%}"
                     f"{bw_med * 1e9 / per_tok:>8.1f}/s")
        print(line)
    for r in rows:
        info = r.get("info")
        if not info:
            continue
        print(f"\n{r['label']}: {info['quantization']}; kernels {info['isa']}, {info['threads']} threads, "
              f"KV cache {info['kv_dtype']}")
        print(f"  packed file {info['file_bytes'] / 2**20:.1f} MiB ({info['bits_per_weight']} bits/weight overall, "
              f"{info['linear_bits_per_weight']} in the layers); peak RSS {r['peak_rss'] / 2**20:.0f} MiB = "
              f"{r['peak_rss'] / info['file_bytes']:.2f}x the packed size"
              + ("" if r.get("peak_rss_exact", True) else " (includes the bandwidth probes: clear_refs refused)"))
        print(f"  decode median {r['decode_tps']:.1f} tok/s (mean {r['decode_tps_mean']:.1f}); "
              f"prefill best {r['prefill_tps']:.1f} tok/s (median {r['prefill_tps_median']:.1f})")
        rl = r["roofline"]
        print("  decode rounds, fraction of the bandwidth probed beside each: "
              + ", ".join(f"{f:.0%}" for f in rl["fractions"]) + " (probes: "
              + ", ".join(f"{x['bw_GBps']:.1f}" for x in r["rounds"]) + " GB/s)")
        if lc:
            print(f"  vs llama.cpp Q4_0 (same run): prefill {r['prefill_tps'] / lc['prefill_tps']:.2f}x, "
                  f"decode {r['decode_tps'] / lc['decode_tps']:.2f}x")
        if torch_row:
            print(f"  vs torch fp32: prefill {r['prefill_tps'] / torch_row['prefill_tps']:.2f}x, "
                  f"decode {r['decode_tps'] / torch_row['decode_tps']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
