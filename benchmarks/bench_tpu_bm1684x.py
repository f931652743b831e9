"""Host-emulated BM1684X static graphs (onnxruntime) beside the torch reference: prefill and decode
speed and peak memory.

    python benchmarks/bench_tpu_bm1684x.py                      # tiny chatglm3 (CI smoke, seconds)
    python benchmarks/bench_tpu_bm1684x.py --size small         # synthetic chatglm3 small (~100M), made once in the cache
    python benchmarks/bench_tpu_bm1684x.py --size small --seq-len 256 --prompt 128 --gen 32 --json out.json

Each measurement runs in its own process, so its peak RSS is its own and torch's and onnxruntime's
thread pools never compete. The exported parts are made (or reused) in a separate process first, so
"load" is opening the parts, not exporting them.

What the numbers mean: this is an emulation on the host CPU, not BM1684X speed. The static prefill
graph always computes all SEQ_LEN positions however short the prompt (prefill tok/s counts only the
prompt's tokens, as a user sees it), and every decode step attends over the full SEQ_LEN window.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path


def model_dir(size: str, family: str, given: str | None) -> Path:
    """--model, or the synthetic checkpoint of that size in the cache (made once; the bench harness's)."""
    from glmcore_conformance.bench import model_dir_for
    return model_dir_for(given, size, family)[0]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(a) -> dict:
    """One backend configuration: load, prefill `prompt` tokens (best of `repeat`), decode `gen` steps."""
    from glmcore.backend import LoadOptions
    from glmcore.config import ModelConfig
    from glmcore.weights import load_weights
    cfg = ModelConfig.from_dir(a.model)
    weights = load_weights(a.model, cfg)
    opts = LoadOptions(precision=a.precision, capacity=a.seq_len, threads=a.threads,
                       cache_dir=Path(a.cache_dir))
    t0 = time.perf_counter()
    if a.backend == "torch":
        from glmcore_plugins.torch_ref import TorchBackend
        session = TorchBackend().load(cfg, weights, opts)
    else:
        from glmcore_plugins.tpu_bm1684x import TpuBm1684xBackend
        b = TpuBm1684xBackend()
        session = b.load(cfg, weights, b.resolve(opts))
    load_s = time.perf_counter() - t0
    if a.prepare:
        return {"load_s": load_s}
    ids = [(7 * i + 3) % cfg.vocab_size for i in range(a.prompt + a.gen)]
    session.prefill(ids[:4])                     # warm-up: first runs allocate
    session.reset()
    best = float("inf")
    for _ in range(a.repeat):
        session.reset()
        t0 = time.perf_counter()
        session.prefill(ids[:a.prompt])
        best = min(best, time.perf_counter() - t0)
    t0 = time.perf_counter()
    for t in ids[a.prompt:]:
        session.decode(t)
    decode_s = time.perf_counter() - t0
    session.close()
    return {"load_s": load_s, "prefill_tps": a.prompt / best, "prefill_s": best,
            "decode_tps": a.gen / decode_s, "decode_ms": 1000 * decode_s / a.gen, "peak_rss_mb": _peak_rss_mb()}


def run_worker(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"worker {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="tiny", choices=["tiny", "small", "1b"])
    ap.add_argument("--family", default="chatglm3", choices=["chatglm2", "chatglm3", "glm4"])
    ap.add_argument("--model", help="checkpoint directory (default: a synthetic one of --size)")
    ap.add_argument("--seq-len", type=int, default=512, help="SEQ_LEN of the static graphs (= capacity)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=32, help="decode steps")
    ap.add_argument("--precision", default="f32,f16", help="tpu_bm1684x precisions to run")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeat", type=int, default=3, help="prefill repetitions (best is kept)")
    ap.add_argument("--cache-dir", default=None, help="where exported parts go (default: glmcore's cache)")
    ap.add_argument("--json", help="also write the results here")
    # internal: one measurement
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a)))
        return 0
    if a.prompt + a.gen > a.seq_len:
        ap.error(f"--prompt {a.prompt} + --gen {a.gen} exceed --seq-len {a.seq_len}")
    if a.cache_dir is None:
        from glmcore.cache import cache_root
        a.cache_dir = str(cache_root() / "converted")
    model = model_dir(a.size, a.family, a.model)
    common = ["--model", str(model), "--seq-len", str(a.seq_len), "--prompt", str(a.prompt), "--gen", str(a.gen),
              "--threads", str(a.threads), "--repeat", str(a.repeat), "--cache-dir", a.cache_dir]
    rows = [("torch", "f32", run_worker(common + ["--backend", "torch", "--precision", "f32"]))]
    for p in a.precision.split(","):
        t0 = time.perf_counter()
        run_worker(common + ["--backend", "tpu_bm1684x", "--precision", p, "--prepare"])
        prepare_s = time.perf_counter() - t0
        r = run_worker(common + ["--backend", "tpu_bm1684x", "--precision", p])
        r["export_or_reuse_s"] = prepare_s
        rows.append(("tpu_bm1684x (host emulation)", p, r))

    ref = rows[0][2]
    print(f"model {model} ({a.family} {a.size if not a.model else ''}), SEQ_LEN {a.seq_len}, prompt {a.prompt}, "
          f"decode {a.gen}, threads {a.threads}")
    print(f"{'backend':<30} {'prec':<5} {'prefill tok/s':>13} {'decode tok/s':>12} {'ms/token':>9} "
          f"{'peak RSS MB':>11} {'prefill x':>9} {'decode x':>8}")
    for name, p, r in rows:
        print(f"{name:<30} {p:<5} {r['prefill_tps']:>13.1f} {r['decode_tps']:>12.1f} {r['decode_ms']:>9.2f} "
              f"{r['peak_rss_mb']:>11.0f} {r['prefill_tps'] / ref['prefill_tps']:>9.2f} "
              f"{r['decode_tps'] / ref['decode_tps']:>8.2f}")
    print("x = speed relative to the torch reference; the static prefill graph computes all SEQ_LEN positions.")
    for name, p, r in rows[1:]:
        print(f"{name} {p}: export (or reuse) {r['export_or_reuse_s']:.1f}s, open parts {r['load_s']:.1f}s")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": {k: v for k, v in vars(a).items() if k not in ("worker",)},
                                            "results": [{"backend": n, "precision": p, **r} for n, p, r in rows]},
                                           indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
