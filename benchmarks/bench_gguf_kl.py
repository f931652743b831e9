"""Quality of llama.cpp's quantized GGUFs in glmcore beside llama.cpp's own (issue 40): KL divergence and top-1
agreement against each runtime's f32 run of the same checkpoint.

    GLMCORE_LLAMACPP=/path/to/llama.cpp python benchmarks/bench_gguf_kl.py                 # the demo model
    GLMCORE_LLAMACPP=... python benchmarks/bench_gguf_kl.py --model DIR --text FILE --types Q4_K_M,Q4_0,Q8_0
    GLMCORE_LLAMACPP=... python benchmarks/bench_gguf_kl.py --size tiny --threads 1        # smoke: 2 chunks

llama.cpp's own tools make the files: convert_hf_to_gguf.py (f32) and llama-quantize (each --types). llama.cpp's
rows are llama-perplexity's --kl-divergence of each file against its --kl-divergence-base run of the f32 GGUF;
glmcore's are `glmcore eval --perplexity`'s measure() of each file on torch (gguf-py's dequantization) and on
cpu_int4 (packed from the file's blocks) against torch on the f32 checkpoint. Both score chunks of --ctx tokens,
the second half of each, so the same text positions; each runtime tokenizes the text itself. Needs llama.cpp's
llama-quantize and llama-perplexity (built here into the tree if missing, with conformance/llamacpp.py's
build_targets).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
TEXT = REPO / "tests" / "data" / "demo_heldout_poems.txt"


def main(argv=None) -> int:
    from glmcore.errors import GlmcoreError
    from glmcore.evaluate.perplexity import Spec, measure, read_text
    from glmcore.model import demo_model_dir
    from glmcore_conformance.llamacpp import build_targets, find
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="checkpoint directory (default: the demo model)")
    ap.add_argument("--text", type=Path, default=TEXT, help="UTF-8 text scored (default: the demo's held-out poems)")
    ap.add_argument("--types", default="Q4_K_M,Q4_0", help="llama-quantize types, comma-separated")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, help="score at most this many chunks")
    ap.add_argument("--size", choices=["full", "tiny"], default="full", help="tiny: 2 chunks (smoke test)")
    ap.add_argument("--threads", type=int)
    a = ap.parse_args(argv)
    chunks = 2 if a.size == "tiny" and not a.chunks else a.chunks
    lc = find()
    if lc is None:      # every file measured is made by llama.cpp's tools: nothing to run without them
        print("bench_gguf_kl: skipped, no llama.cpp build: set $GLMCORE_LLAMACPP to a built llama.cpp tree "
              "(conformance/llamacpp.py says how)", file=sys.stderr)
        return 0
    if not lc.tool("llama-perplexity").exists():
        print("building llama.cpp's llama-perplexity (once; minutes)", file=sys.stderr)
        build_targets(lc.root, ["llama-perplexity"], timeout=3600)
    model = a.model or demo_model_dir()
    text = read_text(a.text)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        os.environ["GLMCORE_CACHE"] = str(tmp / "cache")        # cpu_int4 packs each file afresh
        f32 = tmp / "F32.gguf"
        subprocess.run([sys.executable, "-m", "glmcore_conformance.llamacpp", "convert", str(lc.root), str(model),
                        str(f32), "--outtype", "f32"], check=True, capture_output=True)
        files = {}
        for t in a.types.split(","):
            files[t] = tmp / f"{t}.gguf"
            subprocess.run([str(lc.tool("llama-quantize")), str(f32), str(files[t]), t], check=True, capture_output=True)
        lc.kl_base(f32, a.text, a.ctx, tmp / "base.kld", chunks, a.threads)
        for t, path in files.items():
            rows.append((t, "llama.cpp", lc.kl_divergence(path, tmp / "base.kld", a.threads)))
        common = dict(ctx=a.ctx, chunks=chunks, threads=a.threads, show_progress=False)
        ref, store = measure(model, Spec("torch"), text, keep=True, **common)
        try:
            for t, path in files.items():
                for backend in ("torch", "cpu_int4"):
                    try:
                        r, _ = measure(path, Spec(backend), text, reference=store, **common)
                    except GlmcoreError as e:
                        print(f"{t} on {backend}: not measured: {e}", file=sys.stderr)
                        continue
                    rows.append((t, f"glmcore {backend} {r.fmt}", {"kl_mean": float(r.kl.mean()),
                                 "kl_p99": float(np.percentile(r.kl, 99)),
                                 "top1": float(r.top1.mean())}))
        finally:
            store.close()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?") \
        if os.path.exists("/proc/cpuinfo") else "?"
    print(f"{Path(model).name} on {a.text.name}: chunks of {a.ctx} tokens, second half scored"
          f"{f', {chunks} chunks' if chunks else ''}; each runtime against its own f32 run; CPU {cpu}\n")
    print("| file | runtime | KL mean | KL p99 | top-1 agreement |\n|---|---|---:|---:|---:|")
    for t, who, m in rows:
        print(f"| {t} | {who} | {m['kl_mean']:.5f} | {m['kl_p99']:.5f} | {m['top1']:.2%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
