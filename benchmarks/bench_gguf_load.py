"""Loading a GGUF into cpu_int4 (issue 40): time and peak RSS against the file's size.

    python benchmarks/bench_gguf_load.py --out /tmp/glm6b-q4_0.gguf            # ChatGLM3-6B's shape, Q4_0
    python benchmarks/bench_gguf_load.py --out /tmp/tiny.gguf --size tiny       # smoke test, seconds

Writes (once) a GGUF of the size's shape as llama-quantize's Q4_0 lays it out: every matrix Q4_0 but the output
layer, Q6_K; norms and biases F32; random blocks (the time and memory of loading do not depend on the values).
Then, each in a fresh process: the conversion to cpu_int4's packed form (Q4_0 blocks taken as they are, the Q6_K
output layer dequantized and quantized to int8), and a load of the packed model with one decode step. Peak RSS is
the process's (ru_maxrss), mapped file pages it touched included. On a machine with a slow disk the wall time is
mostly writing the packed file (and reading it back where the page cache dropped it): the CPU seconds say what
the conversion itself costs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

SHAPES = {   # chatglm layout (llama.cpp's chatglm architecture)
    "tiny": dict(hidden=64, layers=2, heads=4, kv=2, head_dim=16, ffn=160, vocab=1024),
    "6b": dict(hidden=4096, layers=28, heads=32, kv=2, head_dim=128, ffn=13696, vocab=65024),
}


def write_file(out: Path, size: str, seed: int = 0) -> Path:
    """The random GGUF, tensors streamed one at a time (the writer never holds the model)."""
    import gguf
    s = SHAPES[size]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(out, "chatglm")
    w.add_name(f"chatglm3-{size}-random")
    w.add_context_length(8192)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ffn"])
    w.add_block_count(s["layers"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(s["head_dim"] // 2)
    w.add_rope_freq_base(10000.0)
    _vocab(w, s["vocab"])
    h, qkv = s["hidden"], (s["heads"] + 2 * s["kv"]) * s["head_dim"]
    tensors = {"token_embd.weight": ((s["vocab"], h), "Q4_0"), "output_norm.weight": ((h,), "F32"),
               "output.weight": ((s["vocab"], h), "Q6_K" if h % 256 == 0 else "Q8_0")}
    for i in range(s["layers"]):
        p = f"blk.{i}."
        tensors.update({p + "attn_norm.weight": ((h,), "F32"), p + "attn_qkv.weight": ((qkv, h), "Q4_0"),
                        p + "attn_qkv.bias": ((qkv,), "F32"), p + "attn_output.weight": ((h, s["heads"] * s["head_dim"]), "Q4_0"),
                        p + "ffn_norm.weight": ((h,), "F32"), p + "ffn_up.weight": ((2 * s["ffn"], h), "Q4_0"),
                        p + "ffn_down.weight": ((h, s["ffn"]), "Q4_0")})
    for name, (shape, kind) in tensors.items():
        qt = gguf.GGMLQuantizationType[kind]
        block, size_ = gguf.GGML_QUANT_SIZES[qt]
        nbytes = int(np.prod(shape)) * size_ // block
        stored = shape if kind == "F32" else (shape[0], shape[1] // block * size_)     # quantized: bytes per row
        w.add_tensor_info(name, stored, np.dtype(np.float32 if kind == "F32" else np.uint8), nbytes,
                          raw_dtype=None if kind == "F32" else qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, (shape, kind) in tensors.items():
        w.write_tensor_data(_random(rng, shape, kind))
    w.close()
    return out


def _random(rng, shape, kind) -> np.ndarray:
    import gguf
    if kind == "F32":
        return np.ones(shape, np.float32)
    qt = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qt]
    blocks = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    scale = np.full(blocks.shape[:2], 0.01, np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
    if kind in ("Q4_0", "Q8_0"):
        blocks[..., :2] = scale             # d first
    else:
        blocks[..., -2:] = scale            # Q6_K: d last; its 16 int8 sub-scales stay random
    return blocks.reshape(shape[0], -1)


def _vocab(w, n: int) -> None:
    """A SentencePiece-style vocabulary of n ids (ChatGLM3's specials after 256 byte pieces), as the converter
    writes one."""
    import gguf
    from glmcore.tokenizer import SP_SPECIALS
    T = gguf.TokenType
    tokens = ["<unk>", "<bos>", "<eos>"] + [f"<0x{b:02X}>" for b in range(256)]
    kinds = [T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256
    words = min(1000, n - 300)
    tokens += [f"▁w{i}" for i in range(words)]
    kinds += [T.NORMAL] * words
    tokens += SP_SPECIALS["chatglm3"]
    kinds += [T.CONTROL] * len(SP_SPECIALS["chatglm3"])
    kinds += [T.UNUSED] * (n - len(tokens))
    tokens += [f"[PAD{i}]" for i in range(len(tokens), n)]
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("chatglm-spm")
    w.add_token_list(tokens)
    w.add_token_types(kinds)
    w.add_token_scores([-float(i) for i in range(n)])
    w.add_eos_token_id(2)


_CHILD = r"""
import json, os, resource, sys, time
from pathlib import Path
os.environ["GLMCORE_CACHE"] = sys.argv[2]
t0 = time.perf_counter()
from glmcore.model import load_model
lm = load_model(sys.argv[1], "cpu_int4")
loaded = time.perf_counter() - t0
logits = lm.scheduler.batch.step([(0, [5])])
lm.close()
u = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"seconds": loaded, "cpu_seconds": u.ru_utime + u.ru_stime, "peak_rss": u.ru_maxrss * 1024}))
"""


def measure(path: Path, cache: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(cache)], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="the GGUF to write (kept: reused when it exists; default: a "
                    "temporary file, removed afterwards)")
    ap.add_argument("--size", choices=sorted(SHAPES), default="6b")
    ap.add_argument("--threads", type=int, help="accepted for the benchmark suite's common flags; loading is "
                    "single-threaded")
    a = ap.parse_args(argv)
    if a.out is None:
        with tempfile.TemporaryDirectory() as tmp:
            return main([*(argv if argv is not None else sys.argv[1:]), "--out", str(Path(tmp) / f"{a.size}.gguf")])
    if not a.out.is_file():
        write_file(a.out, a.size)
    size = a.out.stat().st_size
    with tempfile.TemporaryDirectory(dir=a.out.parent) as cache:
        first = measure(a.out, Path(cache))          # converts: packs the blocks into the cache
        again = measure(a.out, Path(cache))          # maps the packed model
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?") \
        if os.path.exists("/proc/cpuinfo") else "?"
    print(f"{a.out.name}: {size / 2**30:.2f} GiB ({a.size} shape, Q4_0, output layer Q6_K where its width allows, else Q8_0), CPU {cpu}, "
          f"{os.cpu_count()} cores")
    for what, m in (("convert + load", first), ("load packed", again)):
        print(f"  {what:15s} {m['seconds']:6.1f} s ({m['cpu_seconds']:.1f} s of CPU)   peak RSS {m['peak_rss'] / 2**30:5.2f} GiB "
              f"= {m['peak_rss'] / size:.2f} x the file")
    return 0


if __name__ == "__main__":
    sys.exit(main())
