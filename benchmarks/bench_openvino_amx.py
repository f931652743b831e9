"""openvino_amx benchmark: prefill and decode tok/s and peak RSS for each weight format beside the torch fp32
reference, the same IR run through openvino_genai.LLMPipeline (greedy, same prompt) as the ceiling for our
Python generation loop, and OpenVINO's own best form of the same checkpoint: our f16 IR compressed by NNCF
(`nncf.compress_weights`: INT8_ASYM per channel for int8, its default; INT4_SYM at its default group of 128 for
int4) run through LLMPipeline, where nncf is installed.

    python benchmarks/bench_openvino_amx.py --size tiny            # CI smoke, well under a minute
    python benchmarks/bench_openvino_amx.py --size 1b              # the real numbers (made once in the cache)

Each measurement runs in its own process, so one runtime's threads, memory and page cache do not leak into
another's numbers, and peak RSS (VmHWM) is that process's own. The IR is converted in a separate process first,
and the high-water mark is reset after the warm-up (Linux clear_refs), so "peak RSS" is the steady state of
serving (beside the IR's size: "/ IR") and "load peak" the packing of the weights, when the plugin's copy and
the mapped IR are both resident. Every measurement does one untimed warm-up generation
(kernel compilation, first touch of the weights), then --runs timed ones (median): ours through the core's scheduler
(the loop `glmcore run` uses), LLMPipeline through its generate() on token ids, both greedy with stop tokens
ignored and with identical plugin settings (`session.compile_config`: precision, KV-cache precision, the
dynamic-quantization group; SDPA attention).
Timings on a shared machine are noisy; the numbers come from one run of this script.
Where $GLMCORE_LLAMACPP names a built llama.cpp (see conformance/llamacpp.py), llama.cpp runs the same
checkpoint as GGUF of the matching type (int8 -> Q8_0, int4 -> Q4_0, f16 -> F16, f32 -> F32), one llama-bench
repetition in each round of the turns, and gets a row of its own (its peak RSS: llama-bench's whole run).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import numpy as np

FORMATS = ("f32", "f16", "int8", "int4")


# ---------------------------------------------------------------- the model

def model_dir(size: str, family: str, given: str | None) -> Path:
    """--model, or the synthetic checkpoint of that size in the cache (made once; the bench harness's)."""
    from glmcore_conformance.bench import model_dir_for
    return model_dir_for(given, size, family)[0]


# ---------------------------------------------------------------- workers (one per process)

# NNCF's form of each of our compressed formats: (mode, group size)
NNCF_FORMS = {"int8": ("INT8_ASYM", -1), "int4": ("INT4_SYM", 128)}


def nncf_ir(f16_ir: Path, weights: str, say) -> Path:
    """The directory of our f16 IR compressed by NNCF into `weights`' NNCF form, written once beside it (every
    file of the f16 IR's directory but the model, so LLMPipeline loads it the same way)."""
    import shutil

    import glmcore  # noqa: F401  (first: its telemetry block keeps NNCF's usage reports off the network)
    import openvino as ov
    from glmcore.cache import build_once
    import nncf
    mode, group = NNCF_FORMS[weights]
    src = f16_ir.parent
    final = src.parent / f"{src.name}.nncf-{mode.lower()}-g{group}"

    def write(tmp: Path) -> None:
        say(f"  compressing {src.name} with NNCF {mode}" + (f" group {group}" if group > 0 else "") + f" -> {final}")
        model = ov.Core().read_model(str(f16_ir))
        # ADJUST: a layer narrower than the group (small test models) gets a group that divides it
        kw = {}
        if group > 0:
            kw = dict(group_size=group, ratio=1.0, advanced_parameters=nncf.AdvancedCompressionParameters(
                group_size_fallback_mode=nncf.GroupSizeFallbackMode.ADJUST))
        model = nncf.compress_weights(model, mode=getattr(nncf.CompressWeightsMode, mode), **kw)
        ov.save_model(model, str(tmp / f16_ir.name), compress_to_fp16=False)
        for f in src.iterdir():
            if f.is_file() and f.stem != f16_ir.stem:
                shutil.copy2(f, tmp / f.name)

    build_once(final, write, complete=lambda d: (d / f16_ir.name).is_file())
    return final


def _prompt(cfg, n: int) -> list[int]:
    return np.random.default_rng(0).integers(100, min(cfg.vocab_size, 30000), n).tolist()


def serve(spec: dict) -> None:
    """Load one runtime, then answer the parent: "run" -> one timed greedy generation, "quit" -> peak RSS."""
    from glmcore.backend import LoadOptions, SessionAdapter, registry
    from glmcore.config import ModelConfig
    from glmcore.sampling import SamplingParams
    from glmcore.scheduler import Request, Scheduler
    from glmcore.weights import load_weights
    from glmcore_conformance.memory import peak_rss, reset_peak
    cfg = ModelConfig.from_dir(spec["model"])
    weights = load_weights(spec["model"], cfg)
    prompt, new = _prompt(cfg, spec["prompt_len"]), spec["new_tokens"]
    capacity = len(prompt) + new + 8
    kind = spec["kind"]
    info: dict = {}
    if kind in ("ours", "prepare", "genai", "nncf"):
        from glmcore_plugins.openvino_amx import session as ovs
        backend = registry().get("openvino_amx")
        ir_weights = "f16" if spec.get("nncf") else spec["weights"]     # NNCF compresses our f16 IR
        opts = backend.resolve(LoadOptions(spec["precision"], ir_weights, capacity, spec["threads"],
                                           Path(spec["cache"])))
    if kind == "prepare":            # convert (once per model + options) outside the measured processes
        say = lambda m: print(f"  {m}", file=sys.stderr, flush=True)   # noqa: E731
        path = ovs.cached_ir(cfg, weights, opts, say)
        _reply({"ir": str(nncf_ir(path, spec["weights"], say) if spec.get("nncf") else path.parent)})
        return
    t = time.perf_counter()
    if kind in ("genai", "nncf"):
        import openvino as ov
        import openvino_genai
        # the plugin settings of the format run (NNCF's IR is compressed from our f16 one, so not opts'), so that
        # its activations are quantized in the groups ours are
        run_opts = backend.resolve(dataclasses.replace(opts, weights=spec["weights"]))
        pipe = openvino_genai.LLMPipeline(spec["ir"], "CPU", ATTENTION_BACKEND="SDPA",
                                          **ovs.compile_config(run_opts))
        gc = openvino_genai.GenerationConfig()
        gc.do_sample, gc.ignore_eos = False, True
        ids = ov.Tensor(np.array([prompt], dtype=np.int64))

        def one(n: int) -> dict:
            gc.max_new_tokens = n
            r = pipe.generate(ids, gc)           # each generate() starts from an empty state
            m = r.perf_metrics
            return dict(prefill_tps=len(prompt) / (m.get_ttft().mean / 1000), decode_tps=1000 / m.get_tpot().mean,
                        tokens=list(r.tokens[0]))
    else:
        if kind == "torch":
            backend = registry().get("torch")
            opts = backend.resolve(LoadOptions(capacity=capacity, threads=spec["threads"]))
        session = backend.load(cfg, weights, opts)
        if kind == "ours":
            info["runtime_precision"] = session.runtime_precision
        sched = Scheduler(SessionAdapter([session]))      # the stateful model, one sequence
        greedy = SamplingParams(temperature=0)

        def one(n: int) -> dict:
            sched.forget()
            handle = sched.submit(Request(prompt, greedy, n))
            tokens = list(handle)
            timings = handle.timings
            return dict(prefill_tps=timings.prefill_tps, decode_tps=timings.decode_tps, tokens=tokens)
    info["load_s"] = time.perf_counter() - t
    one(4)                                       # warm-up: kernel compilation, first touch of the weights
    info["load_peak_rss_mib"] = peak_rss() / 2**20
    info["steady"] = reset_peak()                # from here the peak is that of serving (not of packing weights)
    _reply({"ready": True, **info})
    for line in sys.stdin:
        if line.strip() == "run":
            _reply(one(new))
        else:
            _reply({"peak_rss_mib": peak_rss() / 2**20, **info})
            return


REPLY = "glmcore-bench-reply "   # marks the worker's answers: libraries print to stdout too (NNCF's log)


def _reply(obj: dict) -> None:
    print(REPLY + json.dumps(obj), flush=True)


class Worker:
    """One runtime in its own process, driven run by run, so two of them can take turns (A, B, A, B, ...) and a
    busy phase of a shared machine hits both alike."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.runs: list[dict] = []
        self.info = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
            sys.stderr.write(line)           # what a library printed in the worker
        raise SystemExit(f"worker {self.spec['kind']} {self.spec.get('weights', '')} failed "
                         f"(exit {self.proc.wait()})")

    def run(self) -> None:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        self.runs.append(self._read())

    def finish(self) -> dict:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        end = self._read()
        self.proc.wait()
        return {**self.info, **end, "prefill_tps": median(r["prefill_tps"] for r in self.runs),
                "decode_tps": median(r["decode_tps"] for r in self.runs), "tokens": self.runs[-1]["tokens"]}


def measure(specs: list[dict], runs: int, together: bool, beside=None) -> list[dict]:
    """Each spec in its own process; with `together`, all loaded at once and run in turns. `beside` (a
    callable giving one run's figures: llama.cpp) runs after each round; its medians come last."""
    if not together:
        return [measure([s], runs, True)[0] for s in specs] + ([measure([], runs, True, beside)[0]] if beside else [])
    from glmcore_conformance.bench import SETTLE_S
    workers = [Worker(s) for s in specs]
    extra = []
    for _ in range(runs):
        for w in workers:
            w.run()
        if beside:
            extra.append(beside())
            time.sleep(SETTLE_S)     # llama-bench's exit frees its model: let the host take it back first
    out = [w.finish() for w in workers]
    if beside:
        out.append({k: median(r[k] for r in extra) for k in extra[0]})
    return out


# ---------------------------------------------------------------- the table

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="tiny", choices=["tiny", "small", "1b"])
    ap.add_argument("--model", help="checkpoint directory (default: synthetic chatglm3 of --size)")
    ap.add_argument("--weights", default=",".join(FORMATS), help="comma-separated weight formats")
    ap.add_argument("--precision", help="f32 or bf16 (default: the backend's default for this CPU)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3, help="timed generations per measurement (median)")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--cache", help="IR cache directory (default: the glmcore cache)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-genai", action="store_true")
    ap.add_argument("--no-nncf", action="store_true", help="leave out the NNCF-compressed IR through LLMPipeline")
    ap.add_argument("--sequential", action="store_true",
                    help="load ours and LLMPipeline one after the other (half the memory), not side by side in turns")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        serve(json.loads(a.worker))
        return 0

    say = lambda m: print(m, file=sys.stderr, flush=True)   # noqa: E731
    import importlib.util

    import openvino as ov
    from glmcore.backend import registry
    from glmcore.config import ModelConfig
    from glmcore.cache import cache_root
    from glmcore.cpuinfo import cpu_name
    from glmcore_plugins.openvino_amx.cpu import has_amx, has_avx512_bf16
    from glmcore_plugins.openvino_amx.session import IR_NAME
    d = model_dir(a.size, "chatglm3", a.model)
    cfg = ModelConfig.from_dir(d)
    backend = registry().get("openvino_amx")
    precision = a.precision or backend.capabilities().default_precision
    cache = a.cache or str(cache_root() / "converted")
    base = dict(model=str(d), prompt_len=a.prompt_len, new_tokens=a.new_tokens, threads=a.threads, cache=cache,
                precision=precision, runs=a.runs)
    genai = not a.no_genai and importlib.util.find_spec("openvino_genai") is not None
    use_nncf = genai and not a.no_nncf and importlib.util.find_spec("nncf") is not None
    if genai and not a.no_nncf and not use_nncf:
        say("bench: nncf is not installed: no row for OpenVINO's own compressed form (pip install nncf)")
    from glmcore_conformance.llamacpp import GGUF_TYPES, find
    llama = find()
    torch = not a.no_torch and registry().probe("torch").ready
    rows: list[tuple[str, dict]] = []
    if torch:
        say("bench: torch fp32 reference")
        rows.append(("torch fp32 (reference)", measure([{**base, "kind": "torch"}], a.runs, True)[0]))
    for w in a.weights.split(","):
        spec = {**base, "weights": w}
        say(f"bench: openvino_amx {precision}/{w}: converting (cached)")
        irs = {"genai": Worker({**spec, "kind": "prepare"}).info["ir"]}     # LLMPipeline's directory for each kind
        nncf = use_nncf and w in NNCF_FORMS
        if nncf:
            irs["nncf"] = Worker({**spec, "kind": "prepare", "nncf": True}).info["ir"]
        say(f"bench: openvino_amx {precision}/{w}: our generation loop" + (" and LLMPipeline on the same IR"
            + (" and on NNCF's" if nncf else "") + ", in turns" if genai else ""))
        gguf = llama.gguf(d, w, say) if llama and w in GGUF_TYPES and cfg.family != "glm4" else None
        beside = ((lambda: llama.bench(gguf, a.prompt_len, a.new_tokens, a.threads, depth=a.prompt_len))
                  if gguf else None)
        kinds = ["ours"] + (["genai"] if genai else []) + (["nncf"] if nncf else [])
        results = measure([{**spec, "kind": k, "ir": irs.get(k)} for k in kinds], a.runs, not a.sequential, beside)
        ir_mib = {k: (Path(d) / IR_NAME).with_suffix(".bin").stat().st_size / 2**20 for k, d in irs.items()}
        rows.append((f"openvino_amx {precision}/{w}", {**results[0], "weights": w, "ir_mib": ir_mib["genai"]}))
        if genai:
            rows.append(("  LLMPipeline, same IR",
                         {**results[1], "weights": w, "genai": True, "ir_mib": ir_mib["genai"]}))
        if nncf:
            mode, group = NNCF_FORMS[w]
            rows.append((f"  LLMPipeline, NNCF {mode}" + (f" g{group}" if group > 0 else ""),
                         {**results[2], "weights": w, "genai": True, "other_weights": True, "ir_mib": ir_mib["nncf"]}))
        if gguf:
            rows.append((f"  llama.cpp {GGUF_TYPES[w]}, same model", {**results[-1], "weights": w, "llamacpp": True}))

    ref = rows[0][1]["decode_tps"] if torch else None
    ours_by_w = {r["weights"]: r for label, r in rows if label.startswith("openvino_amx")}
    print(f"Model: {d} ({cfg.family}, {cfg.num_params() / 1e6:.1f}M parameters); prompt {a.prompt_len} tokens, "
          f"{a.new_tokens} generated, greedy; median of {a.runs} runs after one warm-up.")
    print(f"Machine: {cpu_name()}, {os.cpu_count()} cores, AMX {'yes' if has_amx() else 'no'}, AVX512-BF16 "
          f"{'yes' if has_avx512_bf16() else 'no'}; OpenVINO {ov.get_version()}; Python {platform.python_version()}; "
          f"threads {a.threads or 'default'}; {time.strftime('%Y-%m-%d %H:%M')}.")
    runtime = next((r.get("runtime_precision") for _, r in rows if r.get("runtime_precision")), None)
    if runtime and runtime != precision:
        print(f"Note: precision {precision} requested; OpenVINO runs {runtime} on this CPU.")
    print()
    print(f"| {'configuration':<34} | prefill tok/s | decode tok/s | peak RSS MiB |    / IR | load peak MiB | "
          "decode vs torch fp32 | ours vs this row: decode       | our peak RSS vs this row |")
    print(f"|{'-' * 36}|--------------:|-------------:|-------------:|--------:|--------------:|---------------------:|"
          "-------------------------------:|-------------------------:|")
    for label, r in rows:
        vs_torch = f"{r['decode_tps'] / ref:.2f}x" if ref else "-"
        vs_row = vs_rss = "-"
        if r.get("genai") or r.get("llamacpp"):
            mine = ours_by_w[r["weights"]]
            same = ("" if r.get("llamacpp") else " (its own weights)" if r.get("other_weights")
                    else " (same tokens)" if mine["tokens"] == r["tokens"] else " (TOKENS DIFFER)")
            vs_row = f"{mine['decode_tps'] / r['decode_tps']:.2f}x{same}"
            vs_rss = f"{mine['peak_rss_mib'] / r['peak_rss_mib']:.2f}x" if r.get("peak_rss_mib") else "-"
        steady = "" if r.get("steady", True) else "*"
        per_ir = f"{r['peak_rss_mib'] / r['ir_mib']:.2f}x" if r.get("ir_mib") else "-"
        load = f"{r['load_peak_rss_mib']:.0f}" if r.get("load_peak_rss_mib") else "-"
        print(f"| {label:<34} | {r['prefill_tps']:13.1f} | {r['decode_tps']:12.2f} | {r['peak_rss_mib']:11.0f}"
              f"{steady or ' '} | {per_ir:>7} | {load:>13} | {vs_torch:>20} | {vs_row:>30} | {vs_rss:>24} |")
    if not all(r.get("steady", True) for _, r in rows):
        print("* this kernel refused to reset the high-water mark (clear_refs): that peak includes loading")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": str(d), "precision": precision, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
