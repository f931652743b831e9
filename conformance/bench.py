"""`glmcore bench`: time to first token, prefill and decode speed, peak memory, and the roofline.

    glmcore bench --backend openvino_amx --size small --prompt-len 128 --gen 64 --runs 3 --vs torch

How it measures, and why:
- Each backend runs in its own worker process (spawned, not forked), loaded once. With --vs the main
  process asks the two workers for one run each in turn (A, B, A, B, ...), so a slow phase of a shared
  machine hits both alike. Each figure is the median over --runs, after --warmup untimed runs (the first
  run of a backend pays one-time costs: kernel compilation, page faults on memory-mapped weights).
- A run is production's code path: one request through the core's Scheduler with greedy sampling, over random-free
  fixed token ids (the model's tokenizer on a fixed text), stop tokens ignored so exactly --gen tokens
  are made. Time to first token = prefill + sampling the first token; decode tok/s = (gen - 1) / the
  time of the remaining steps, as glmcore.scheduler.Timings reports it.
- Peak RSS is per backend, because each backend is alone in its process: before each run the worker
  resets the kernel's high-water mark (/proc/self/clear_refs, Linux) and reads VmHWM after it, so the
  figure is the peak resident memory during that run: interpreter + runtime + the weights it touched
  (memory-mapped pages count once resident) + KV cache + activations. Where the reset is not allowed,
  the figure is the process's peak since start (ru_maxrss), and the output says so.
- Roofline: a decode step must read every weight once (the embedding only one row) and the KV cache;
  bytes per token = weights in the backend's format + KV read at the mean context of the run. The
  ceiling is the memory bandwidth (a multi-threaded numpy read of a buffer 8x the last-level cache,
  measured at startup, between rounds and after the last, the median: on a shared machine it swings by a
  third from minute to minute) divided by those bytes. "Reached" pairs each round with the bandwidth
  around it (the mean of the probes just before and just after it): the median over rounds of that
  round's decode tok/s over its own ceiling, so a busy minute lowers the decode and its ceiling alike.
  A backend may state its own bytes with an optional `bytes_per_token(config, options, kv_len)`.
  At tiny sizes the weights sit in cache and the ceiling means little; it is meant for 1b/6b.
- llama.cpp, optional: where $GLMCORE_LLAMACPP names a built llama.cpp tree (conformance/llamacpp.py says
  how to build one), the same checkpoint is converted to the GGUF type matching each weight format (int8 ->
  Q8_0, int4 -> Q4_0) and one llama-bench repetition runs after each round of the backends' runs; the
  table gains a "vs llama.cpp" column (decode speed over llama.cpp's). `--no-llamacpp` leaves it out.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from glmcore.backend import Backend, LoadOptions, registry
from glmcore.cli import add_spec_args, speculation
from glmcore.config import FAMILIES, ModelConfig
from glmcore.cpuinfo import cpu_name
from glmcore.errors import GlmcoreError
from glmcore.model import resolve_backend
from glmcore.scheduler import Speculation

from .memory import peak_rss, reset_peak

SIZES = ("tiny", "small", "1b", "6b", "9b")
# Seconds to wait after a llama.cpp run: its process frees ~1 GB when it exits, and on VMs with free page
# reporting (the guest hands freed memory to the host ~2 s later) that work took the cores of the next
# round measured (see BandwidthProbe).
SETTLE_S = 3.0
# Bytes per weight as stored; the int formats include one f16 scale per group (32 for int4) or row.
WEIGHT_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5 + 2 / 32}


# ---------------------------------------------------------------- the machine


def machine() -> str:
    mem = ""
    try:
        mem = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM"
    except (ValueError, OSError, AttributeError):
        pass
    return f"{cpu_name()}, {os.cpu_count()} CPUs{mem}, {platform.system()} {platform.release()}"


def _llc_bytes() -> int:
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        best = max(best, int(text.rstrip("KMG")) * scale)
    return best or (32 << 20)


class BandwidthProbe:
    """Memory read bandwidth in bytes/s: `threads` threads each max-reducing its part of a byte buffer 8x
    the last-level cache (numpy's SIMD max releases the GIL and outruns memory; an OR-reduce of uint64
    did not, and read 18 GB/s where a decode kernel streamed 22). The buffer is written once, so its
    pages exist, and kept until close(): freeing a gigabyte between rounds slowed the round after it
    (1b cpu_int4 decode 28.0 -> 29.5-31.3 ms/token; a burst of 35-47 ms tokens about 2 s after the
    free: the guest kernel reporting the freed pages to the host took the backend's cores)."""

    def __init__(self, threads: int | None = None):
        self.threads = threads or os.cpu_count() or 1
        self.buf = np.ones(min(max(8 * _llc_bytes(), 256 << 20), 1 << 30), dtype=np.uint8)

    def measure(self, seconds: float = 0.5) -> float:
        """Best of the repetitions that fit in `seconds`."""
        from concurrent.futures import ThreadPoolExecutor
        parts = np.array_split(self.buf, self.threads)
        best = 0.0
        with ThreadPoolExecutor(self.threads) as pool:
            start = time.perf_counter()
            for i in range(20):
                t0 = time.perf_counter()
                list(pool.map(np.maximum.reduce, parts))
                best = max(best, self.buf.nbytes / (time.perf_counter() - t0))
                if i >= 2 and time.perf_counter() - start > seconds:
                    break
        return best

    def close(self) -> None:
        self.buf = None


def measure_bandwidth(threads: int | None = None, seconds: float = 0.5) -> float:
    """One probe (see BandwidthProbe)."""
    probe = BandwidthProbe(threads)
    try:
        return probe.measure(seconds)
    finally:
        probe.close()


# ---------------------------------------------------------------- roofline

def default_bytes_per_token(config: ModelConfig, options: LoadOptions, kv_len: int) -> int:
    """Weights read by one decode step in the stored format (the embedding: one row; tied to the output layer,
    GLM-Edge's is read whole for the logits anyway) + the KV cache read at kv_len (f32 when computing in f32,
    else 2 bytes)."""
    per_weight = WEIGHT_BYTES.get(options.weights or "f32", 4.0)
    unread = 0 if config.tie_embeddings else (config.vocab_size - 1) * config.hidden_size
    weights = (config.num_params() - unread) * per_weight
    kv_item = 4 if (options.precision or "f32") == "f32" else 2
    kv = 2 * config.num_layers * kv_len * config.kv_size * kv_item
    return int(weights + kv)


def bytes_per_token(backend: Backend, config: ModelConfig, options: LoadOptions, kv_len: int) -> tuple[int, str]:
    """What one decode step reads: the backend's own figure (Backend.bytes_per_token) where it states one."""
    try:
        value = backend.bytes_per_token(config, options, kv_len)
    except Exception as e:     # a broken hook must not lose the measurements
        print(f"bench: {backend.name}.bytes_per_token failed ({type(e).__name__}: {e}); using the default",
              file=sys.stderr)
        value = None
    if value:
        return int(value), "stated by the backend"
    return default_bytes_per_token(config, options, kv_len), "estimated from the weight format"


# ---------------------------------------------------------------- the worker (one per backend)

def _worker(conn, name: str, model_dir: str, options: dict, speculation: tuple[str, int]) -> None:
    """Load one backend and answer ("run", prompt, gen) requests until ("stop",)."""
    try:
        from glmcore.cache import cache_root
        from glmcore.model import open_checkpoint
        from glmcore.sampling import SamplingParams
        from glmcore.scheduler import Request, Scheduler
        from glmcore.parallel import follower_pids, tensor_parallel
        backend = tensor_parallel(registry().get(name), options.get("tp", 1))
        checkpoint = open_checkpoint(model_dir)
        config = checkpoint.config
        opts = backend.resolve(LoadOptions(**options))
        if opts.cache_dir is None:
            opts.cache_dir = cache_root() / "converted"
        t0 = time.perf_counter()
        batch = backend.load_batch(config, checkpoint.weights(), opts, 1)
        load_s = time.perf_counter() - t0
        scheduler = Scheduler(batch, backend.capabilities(), n_vocab=config.vocab_size,
                              speculation=Speculation(*speculation))
        ranks = ["self", *follower_pids()]      # tensor parallel: every rank's memory counts
        conn.send(("ready", {"backend": backend.name, "load_s": load_s, "precision": opts.precision,
                             "weights": opts.weights,
                             "capacity": batch.capacity, "rss_after_load": peak_rss()}))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}" if not isinstance(e, GlmcoreError) else str(e),
                   isinstance(e, GlmcoreError)))
        return
    greedy = SamplingParams(temperature=0.0)
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            batch.close()
            conn.send(("stopped",))
            return
        _, prompt, gen = msg
        try:
            scheduler.forget()          # every run prefills its whole prompt
            per_run = all([reset_peak(p) for p in ranks])
            handle = scheduler.submit(Request(prompt, greedy, gen))
            n = sum(1 for _ in handle)
            t = handle.timings
            conn.send(("result", {"ttft_s": t.ttft_s, "prefill_tps": t.prefill_tps, "decode_tps": t.decode_tps,
                                  "new_tokens": n, "drafted": t.drafted, "accepted": t.accepted,
                                  "peak_rss": max(peak_rss(p) for p in ranks),
                                  "peak_rss_ranks": [peak_rss(p) for p in ranks], "rss_per_run": per_run}))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}", isinstance(e, GlmcoreError)))


class Worker:
    def __init__(self, name: str, model_dir: Path, options: LoadOptions, speculation: Speculation):
        ctx = mp.get_context("spawn")    # a fresh interpreter: no inherited memory, no forked thread pools
        self.name = name
        self.conn, child = ctx.Pipe()
        opts = {k: v for k, v in asdict(options).items() if k != "cache_dir"}
        spec = (speculation.method.value, speculation.draft_tokens)
        self.proc = ctx.Process(target=_worker, args=(child, name, str(model_dir), opts, spec), daemon=True)
        self.proc.start()
        child.close()

    def _recv(self, what: str):
        try:
            msg = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise GlmcoreError(f"backend {self.name!r} worker died while {what} (exit code {self.proc.exitcode}); "
                               "it may have run out of memory: try a smaller --size") from None
        if msg[0] == "error":
            if msg[2]:
                raise GlmcoreError(msg[1])
            raise RuntimeError(f"backend {self.name!r} failed while {what}: {msg[1]}")
        return msg[1]

    def ready(self) -> dict:
        return self._recv("loading")

    def run(self, prompt: list[int], gen: int) -> dict:
        self.conn.send(("run", prompt, gen))
        return self._recv("generating")

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
                self.conn.recv()
            except (EOFError, OSError, BrokenPipeError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)


# ---------------------------------------------------------------- the benchmark

@dataclass
class Result:
    backend: str
    precision: str
    weights: str
    load_s: float
    ttft_ms: float
    prefill_tps: float
    decode_tps: float
    peak_rss_mib: float
    rss_per_run: bool
    bytes_per_token: int
    bytes_source: str
    ceiling_tps: float
    reached: float
    drafted: int = 0            # speculative decoding: tokens drafted in a run (the median run)
    accepted: int = 0           # ... and accepted by the target
    runs: list = field(default_factory=list)


def default_family(size: str | None) -> str:
    """The family a synthetic size stands for when none is named: 9b is GLM-4-9B-chat, the others ChatGLM3."""
    return "glm4" if size == "9b" else "chatglm3"


def model_dir_for(model: str | None, size: str | None, family: str | None = None) -> tuple[Path, bool]:
    from .models import synthetic_dir
    family = family or default_family(size)
    if model:
        path = Path(model)
        if not (path / "config.json").is_file():
            raise GlmcoreError(f"--model {model!r} is not a checkpoint directory (no config.json)")
        return path, False
    if family not in FAMILIES:
        raise GlmcoreError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    return synthetic_dir(family, size or "small", purpose="bench", seed=0), True


def bench(backends: list[tuple[str, LoadOptions]], model_dir: Path, prompt_len: int = 128, gen: int = 64,
          runs: int = 3, warmup: int = 1, threads: int | None = None, bandwidth: float | None = None,
          progress=lambda msg: None, llamacpp=None, speculation: Speculation | None = None) -> dict:
    """Run each (backend name, options) in its own worker, alternating, and return the figures; with
    `llamacpp` (glmcore_conformance.llamacpp.LlamaCpp), llama.cpp on the same checkpoint in the same rounds;
    with `speculation`, every backend decodes with it (its runs count drafted and accepted tokens)."""
    speculation = speculation or Speculation()
    from .models import open_model, TokenSource
    if prompt_len < 1 or gen < 2 or runs < 1 or warmup < 0:
        raise GlmcoreError("--prompt-len must be >= 1, --gen >= 2, --runs >= 1, --warmup >= 0")
    model = open_model(model_dir)
    config = model.config
    prompt = TokenSource(model).take(prompt_len)
    probes = []              # memory bandwidth beside each round (unless given)
    probe = None
    workers = []
    try:
        if bandwidth is None:
            progress("bench: measuring memory bandwidth")
            probe = BandwidthProbe(threads)
            probes.append(probe.measure())
        for name, opts in backends:
            resolve_backend(name).resolve(opts)     # refuse a bad precision/format before spawning
            opts.capacity = opts.capacity or prompt_len + gen
            opts.threads = threads
            progress(f"bench: loading {name}")
            workers.append((Worker(name, model_dir, opts, speculation), opts))
        infos = [w.ready() for w, _ in workers]
        ggufs = _llamacpp_models(llamacpp, model_dir, {i["weights"] for i in infos}, progress)
        lc_runs: dict = {w: [] for w in ggufs}
        results = [[] for _ in workers]
        for r in range(warmup + runs):
            label = "warm-up" if r < warmup else f"run {r - warmup + 1}/{runs}"
            if probe is not None and r >= warmup:
                probes.append(probe.measure())        # after the round before, before this one
            for i, (w, _) in enumerate(workers):
                progress(f"bench: {w.name} {label}")
                out = w.run(prompt, gen)
                if r >= warmup:
                    results[i].append(out)
            for weights, path in ggufs.items() if r >= warmup else ():
                progress(f"bench: llama.cpp {path.parent.name} {label}")
                # decode after the prompt's context, as the backends' decode follows their prefill
                lc_runs[weights].append(llamacpp.bench(path, prompt_len, gen, threads, depth=prompt_len))
                time.sleep(SETTLE_S)
        if probe is not None:
            probes.append(probe.measure())            # after the last round
    finally:
        for w, _ in workers:
            w.stop()
        if probe is not None:
            probe.close()
    kv_len = prompt_len + gen // 2
    if probes:
        bandwidth = statistics.median(probes)
    # the bandwidth around round i: probes[i + 1] was taken just before it, probes[i + 2] just after
    around = [(probes[i + 1] + probes[i + 2]) / 2 for i in range(runs)] if len(probes) == runs + 2 else \
        [bandwidth] * runs
    out = []
    for (w, opts), info, rs in zip(workers, infos, results):
        med = lambda k: statistics.median(x[k] for x in rs)
        resolved = LoadOptions(info["precision"], info["weights"], opts.capacity, threads, extra=opts.extra)
        nbytes, source = bytes_per_token(registry().get(w.name), config, resolved, kv_len)
        ceiling = bandwidth / nbytes
        reached = statistics.median(x["decode_tps"] * nbytes / bw for x, bw in zip(rs, around))
        out.append(Result(info["backend"], info["precision"], info["weights"], info["load_s"], med("ttft_s") * 1000,
                          med("prefill_tps"), med("decode_tps"), med("peak_rss") / 2**20,
                          all(x["rss_per_run"] for x in rs), nbytes, source, ceiling, reached,
                          int(med("drafted")), int(med("accepted")), rs))
    return {"model": str(model_dir), "family": config.family, "params": config.num_params(),
            "prompt_len": prompt_len, "gen": gen, "runs": runs, "warmup": warmup, "threads": threads,
            "speculation": {"method": speculation.method.value, "draft_tokens": speculation.draft_tokens},
            "bandwidth": bandwidth, "bandwidth_probes": probes, "machine": machine(), "kv_len": kv_len,
            "date": time.strftime("%Y-%m-%d"), "results": [asdict(r) for r in out],
            "llamacpp": {w: {"type": ggufs[w].parent.name, "runs": rs,
                             **{k: statistics.median(x[k] for x in rs) for k in rs[0]}}
                         for w, rs in lc_runs.items()}}


def _llamacpp_models(llamacpp, model_dir: Path, formats: set, progress) -> dict:
    """weight format -> its GGUF, for the formats llama.cpp has; a failed conversion skips the comparison
    (it is optional) and says why."""
    if llamacpp is None:
        return {}
    from .llamacpp import GGUF_TYPES
    try:
        return {w: llamacpp.gguf(model_dir, w, progress) for w in sorted(formats) if w in GGUF_TYPES}
    except GlmcoreError as e:
        progress(f"bench: no llama.cpp comparison: {e}")
        return {}


def _probed(data: dict) -> str:
    probes = data.get("bandwidth_probes") or []
    if not probes:
        return "given"
    return (f"median of {len(probes)} probes, at startup, between rounds and after the last: "
            f"{min(probes) / 1e9:.1f}-{max(probes) / 1e9:.1f}")


def format_bench(data: dict) -> str:
    lines = [f"model {data['model']} ({data['family']}, {data['params'] / 1e6:.1f}M parameters); prompt "
             f"{data['prompt_len']} tokens, {data['gen']} generated; median of {data['runs']} runs "
             f"after {data['warmup']} warm-up; threads {data['threads'] or 'backend default'}",
             f"machine: {data['machine']}; memory bandwidth {data['bandwidth'] / 1e9:.1f} GB/s ({_probed(data)})",
             ""]
    header = ["backend", "precision/weights", "load s", "TTFT ms", "prefill tok/s", "decode tok/s", "peak RSS MiB"]
    rows = [[r["backend"], f"{r['precision']}/{r['weights']}", f"{r['load_s']:.1f}", f"{r['ttft_ms']:.1f}",
             f"{r['prefill_tps']:.1f}", f"{r['decode_tps']:.1f}",
             f"{r['peak_rss_mib']:.0f}" + ("" if r["rss_per_run"] else "*")] for r in data["results"]]
    lc = data.get("llamacpp") or {}
    if lc:
        header.append("decode vs llama.cpp")
        for row, r in zip(rows, data["results"]):
            ref = lc.get(r["weights"])
            row.append(f"{r['decode_tps'] / ref['decode_tps']:.2f}x {ref['type']}" if ref else "-")
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header] + rows]
    lines.append("")
    for r in data["results"]:
        lines.append(f"roofline {r['backend']} {r['precision']}/{r['weights']}: {r['bytes_per_token'] / 1e6:.2f} MB "
                     f"read per decode token ({r['bytes_source']}, KV at {data['kv_len']} tokens) at "
                     f"{data['bandwidth'] / 1e9:.1f} GB/s -> ceiling {r['ceiling_tps']:.1f} tok/s; "
                     f"reached {100 * r['reached']:.0f}% (the median round against the bandwidth around it)")
    spec = data.get("speculation") or {"method": "off"}
    for r in data["results"] if spec["method"] != "off" else ():
        lines.append(f"speculative {spec['method']} (up to {spec['draft_tokens']} drafts a step) {r['backend']}: "
                     f"drafted {r['drafted']}, accepted {r['accepted']} "
                     f"({100 * r['accepted'] / max(r['drafted'], 1):.0f}%) of {data['gen']} generated tokens")
    for ref in lc.values():
        lines.append(f"llama.cpp {ref['type']} (same checkpoint, llama-bench, median of {len(ref['runs'])}): prefill "
                     f"{ref['prefill_tps']:.1f} tok/s, decode {ref['decode_tps']:.1f} tok/s, peak RSS "
                     f"{ref['peak_rss_mib']:.0f} MiB")
    for r in data["results"]:
        ranks = [statistics.median(x) for x in zip(*(run["peak_rss_ranks"] for run in r["runs"]))]
        if len(ranks) > 1:
            lines.append(f"peak RSS per rank {r['backend']}: {', '.join(f'{x / 2**20:.0f}' for x in ranks)} MiB "
                         "(the table shows the largest)")
    if any(not r["rss_per_run"] for r in data["results"]):
        lines.append("* peak RSS since the worker started (the per-run reset is not available here)")
    res = data["results"]
    if len(res) == 2:
        a, b = res
        ratio = lambda x, y: x / y if y else float("inf")
        lines.append(f"{a['backend']} vs {b['backend']}: prefill {ratio(a['prefill_tps'], b['prefill_tps']):.2f}x, "
                     f"decode {ratio(a['decode_tps'], b['decode_tps']):.2f}x the speed; time to first token "
                     f"{ratio(a['ttft_ms'], b['ttft_ms']):.2f}x, "
                     f"peak RSS {ratio(a['peak_rss_mib'], b['peak_rss_mib']):.2f}x")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="glmcore bench", description="Measure time to first token, prefill and "
                                 "decode speed and peak memory of a backend (optionally against another).")
    ap.add_argument("--backend", required=True)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint directory")
    src.add_argument("--size", choices=SIZES, help="synthetic checkpoint size, made once in the cache (default small)")
    ap.add_argument("--family", choices=FAMILIES, help="family of the synthetic checkpoint (default chatglm3; "
                    "glm4 at --size 9b)")
    ap.add_argument("--precision", help="compute precision of --backend")
    ap.add_argument("--weights", help="weight format of --backend")
    ap.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", help="backend option of --backend")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--vs", metavar="BACKEND", help="a second backend (at its defaults), run alternately")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--tp", type=int, default=1, metavar="N", help="split --backend over N tensor-parallel ranks "
                    "(--vs stays one); peak RSS is then the largest rank's")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--batch", metavar="B1,B2,...", help="many sequences at once: per batch size, the prefill time "
                    "of the whole batch, ms per decode step and aggregate decode tok/s (e.g. 1,4,8,16,32,48)")
    ap.add_argument("--no-llamacpp", action="store_true", help="leave out the llama.cpp comparison even where "
                    "$GLMCORE_LLAMACPP names a build")
    add_spec_args(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    from glmcore.options import parse_opts
    a = build_parser().parse_args(argv)
    if a.threads is not None and a.threads < 1:
        raise GlmcoreError(f"invalid --threads {a.threads}: use a positive integer")
    resolve_backend(a.backend)
    if a.vs:
        resolve_backend(a.vs)
    model_dir, _ = model_dir_for(a.model, a.size, a.family)
    if a.batch and a.speculative != "off":
        raise GlmcoreError("--speculative times one sequence's decoding; drop --batch (or --speculative)")
    if a.batch:
        from .batchbench import batch_bench, format_batch, parse_sizes
        data = batch_bench(a.backend, model_dir, LoadOptions(a.precision, a.weights, threads=a.threads,
                                                             extra=parse_opts(a.opt)),
                           parse_sizes(a.batch), a.prompt_len, a.gen,
                           progress=lambda m: print(m, file=sys.stderr, flush=True), runs=a.runs, warmup=a.warmup)
        print(json.dumps(data, indent=2) if a.json else format_batch(data))
        return 0
    if a.tp < 1:
        raise GlmcoreError(f"invalid --tp {a.tp}: use a positive number of ranks")
    pairs = [(a.backend, LoadOptions(a.precision, a.weights, extra=parse_opts(a.opt), tp=a.tp))]
    if a.vs:
        pairs.append((a.vs, LoadOptions()))
    from .llamacpp import find
    data = bench(pairs, model_dir, a.prompt_len, a.gen, a.runs, a.warmup, a.threads,
                 progress=lambda m: print(m, file=sys.stderr, flush=True),
                 llamacpp=None if a.no_llamacpp else find(), speculation=speculation(a))
    print(json.dumps(data, indent=2) if a.json else format_bench(data))
    return 0


if __name__ == "__main__":
    from glmcore.cli import main as cli_main
    sys.exit(cli_main(["bench", *sys.argv[1:]]))
