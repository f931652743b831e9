"""ascend_npu benchmark: graph mode vs eager mode vs the torch reference, prefill and decode, with the
first compile timed apart.

    python benchmarks/bench_ascend_npu.py                      # tiny chatglm3: CI smoke
    python benchmarks/bench_ascend_npu.py --size small         # synthetic small, made once in the cache
    python benchmarks/bench_ascend_npu.py --size small --cold  # fresh inductor cache: true compile time

How it measures:
- The three sessions live in one process, loaded once, on the device the backend picks (this machine:
  the CPU). Graph mode compiles its decode graph while loading and one graph per prompt bucket on first
  use; those calls are reported apart (load s, 1st prefill s, compile s, graphs), never mixed into speeds.
- Then --rounds rounds, each running every session in turn (graph, eager, torch): reset, prefill the
  --prompt ids, decode --steps tokens. Interleaving makes a busy phase of a shared machine hit all three
  alike. Prefill tok/s is the median round; decode ms/token the median of all timed steps.
- Inductor caches compiled kernels on disk (TORCHINDUCTOR_CACHE_DIR); a second run compiles from that
  cache and is much faster. --cold points it at a fresh directory to time a real first compile; the
  output says which it was.

    python benchmarks/bench_ascend_npu.py --size small --batch 1,16   # aggregate decode of batch sessions

--batch B1,B2,...: one native batch session (load_batch) of max(B) slots, one weight copy, a decode graph
per B. Per round and per B: B slots reset and get the --prompt ids (untimed), then --steps decode steps
in which each of the B slots takes one token; aggregate decode tok/s = B x steps / time. The sizes take
turns round by round; the figure is the median round. Round 0 compiles and warms up (reported apart).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def model_dir(size: str, family: str, given: str | None) -> Path:
    """--model, or the synthetic checkpoint of that size in the cache (made once; the bench harness's)."""
    from glmcore_conformance.bench import model_dir_for
    return model_dir_for(given, size, family)[0]


def timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", choices=["tiny", "small", "1b"])
    ap.add_argument("--family", default="chatglm3", choices=["chatglm2", "chatglm3", "glm4"])
    ap.add_argument("--model", help="checkpoint directory (default: the synthetic --size, made once in the cache)")
    ap.add_argument("--precision", default="f32", choices=["f32", "bf16", "f16"])
    ap.add_argument("--prompt", type=int, default=64, help="prompt length (graph mode pads to a bucket)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--capacity", type=int, default=1024, help="KV slots of every session")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--cold", action="store_true", help="fresh inductor cache: time a real first compile")
    ap.add_argument("--no-ref", action="store_true", help="skip the torch reference")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--batch", help="comma-separated batch sizes: aggregate decode of native batch sessions")
    a = ap.parse_args(argv)

    cache_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if a.cold:
        cache_dir = tempfile.mkdtemp(prefix="inductor-cold-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir      # before torch is imported
    import numpy as np
    import torch

    from glmcore.backend import LoadOptions
    from glmcore.config import ModelConfig
    from glmcore.weights import load_weights
    from glmcore_plugins.ascend_npu import AscendNpuBackend
    from glmcore_plugins.torch_ref import TorchBackend

    if a.threads:
        torch.set_num_threads(a.threads)
    path = model_dir(a.size, a.family, a.model)
    cfg = ModelConfig.from_dir(path)
    weights = load_weights(path, cfg)
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, min(cfg.vocab_size, 30000), a.prompt).tolist()
    tokens = rng.integers(100, min(cfg.vocab_size, 30000), a.steps + 1).tolist()

    backend = AscendNpuBackend()
    probe = backend.probe()
    if a.batch:
        return batch_bench(a, backend, probe, cfg, weights, prompt, tokens)
    sessions, loads = {}, {}
    for mode in ("graph", "eager"):
        opts = LoadOptions(precision=a.precision, capacity=a.capacity, threads=a.threads, extra={"mode": mode})
        loads[mode], sessions[mode] = timed(backend.load, cfg, weights, opts)
    if not a.no_ref and a.precision == "f32":
        loads["torch"], sessions["torch"] = timed(TorchBackend().load, cfg, weights,
                                                  LoadOptions(capacity=a.capacity, threads=a.threads))

    # First calls: graph mode compiled its decode graph in load() and compiles the prompt's bucket
    # here; the others just warm up. compile_seconds sums the calls that compiled.
    first = {}
    for name, s in sessions.items():
        t_pre, _ = timed(s.prefill, prompt)
        t_dec, _ = timed(s.decode, tokens[0])
        first[name] = {"prefill_s": t_pre, "decode_s": t_dec, "graphs": getattr(s, "compiles", 0),
                       "compile_s": getattr(s, "compile_seconds", 0.0)}
        s.reset()

    pre = {n: [] for n in sessions}
    dec = {n: [] for n in sessions}
    per_round = {n: [] for n in sessions}       # each round's median decode step
    for _ in range(a.rounds):
        for name, s in sessions.items():
            s.reset()
            t, _ = timed(s.prefill, prompt)
            pre[name].append(t)
            steps = [timed(s.decode, tok)[0] for tok in tokens[1:]]
            dec[name].extend(steps)
            per_round[name].append(statistics.median(steps))
    compiles_after = sessions["graph"].compiles

    rows = []
    for name in sessions:
        rows.append({"mode": name, "load_s": loads[name],
                     "first_prefill_s": first[name]["prefill_s"], "first_decode_s": first[name]["decode_s"],
                     "graphs_compiled": first[name]["graphs"], "compile_s": first[name]["compile_s"],
                     "prefill_tok_s": a.prompt / statistics.median(pre[name]),
                     "decode_ms": 1e3 * statistics.median(dec[name]),
                     "decode_tok_s": 1 / statistics.median(dec[name])})
    by = {r["mode"]: r for r in rows}
    cache_state = "cold (fresh cache dir)" if a.cold else "warm or cold (reused on-disk inductor cache)"
    print(f"ascend_npu bench: {a.family} {a.size} ({cfg.num_params() / 1e6:.1f}M params) {a.precision}, "
          f"device {probe.device}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"prompt {a.prompt}, {a.steps} decode steps x {a.rounds} rounds, capacity {a.capacity}")
    print(f"graph mode: {sessions['graph'].report()['compiler']}, buckets {sessions['graph'].buckets}, "
          f"inductor cache: {cache_state}")
    print(f"{'mode':<7} {'load s':>7} {'1st prefill s':>14} {'1st decode s':>13} {'graphs':>6} {'compile s':>10} "
          f"{'prefill tok/s':>14} {'decode ms/tok':>14} {'decode tok/s':>13}")
    for r in rows:
        print(f"{r['mode']:<7} {r['load_s']:>7.2f} {r['first_prefill_s']:>14.2f} {r['first_decode_s']:>13.2f} "
              f"{r['graphs_compiled']:>6} {r['compile_s']:>10.2f} {r['prefill_tok_s']:>14.1f} {r['decode_ms']:>14.2f} "
              f"{r['decode_tok_s']:>13.1f}")
    print("(graph mode: load includes the decode compile; 1st prefill the prompt bucket's compile; "
          "compile s = both)")
    speedup = by["eager"]["decode_ms"] / by["graph"]["decode_ms"]
    wins = sum(g < e for g, e in zip(per_round["graph"], per_round["eager"]))
    print(f"graph vs eager: decode {speedup:.2f}x (graph faster in {wins}/{a.rounds} rounds; per-round ms: graph "
          f"{' '.join(f'{1e3 * x:.2f}' for x in per_round['graph'])} | eager "
          f"{' '.join(f'{1e3 * x:.2f}' for x in per_round['eager'])}), prefill "
          f"{by['graph']['prefill_tok_s'] / by['eager']['prefill_tok_s']:.2f}x; "
          f"compiles during the timed rounds: {compiles_after - first['graph']['graphs']}")
    if "torch" in by:
        print(f"graph vs torch reference: decode {by['torch']['decode_ms'] / by['graph']['decode_ms']:.2f}x, "
              f"prefill {by['graph']['prefill_tok_s'] / by['torch']['prefill_tok_s']:.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "device": probe.device, "rows": rows,
                                            "decode_speedup_graph_vs_eager": speedup,
                                            "decode_round_medians_s": per_round}, indent=2))
    for s in sessions.values():
        s.close()
    return 0


def batch_bench(a, backend, probe, cfg, weights, prompt, tokens) -> int:
    import torch

    from glmcore.backend import LoadOptions
    sizes = [int(b) for b in a.batch.split(",")]
    opts = LoadOptions(precision=a.precision, capacity=a.capacity, threads=a.threads,
                       extra={"batch_buckets": a.batch})
    t0 = time.perf_counter()
    batch = backend.load_batch(cfg, weights, opts, max(sizes))
    load_s = time.perf_counter() - t0
    per_round = {n: [] for n in sizes}
    for r in range(a.rounds + 1):                      # round 0 compiles and warms up
        for n in sizes:
            for s in range(n):
                batch.reset(s)
            batch.step([(s, prompt) for s in range(n)])
            t0 = time.perf_counter()
            for tok in tokens[1:]:
                batch.step([(s, [tok]) for s in range(n)])
            if r:
                per_round[n].append(n * a.steps / (time.perf_counter() - t0))
    runner = batch.runner
    print(f"ascend_npu batch bench: {a.family} {a.size} ({cfg.num_params() / 1e6:.1f}M params) {a.precision}, "
          f"device {probe.device}, compiler {runner.compiler}, torch {torch.__version__}, threads "
          f"{torch.get_num_threads()}, one session of {max(sizes)} slots (load {load_s:.1f}s, {runner.compiles} graphs "
          f"compiled in {runner.compile_seconds:.1f}s in round 0), prompt {a.prompt} per slot, {a.steps} decode steps "
          f"x {a.rounds} rounds, capacity {a.capacity}")
    print(f"{'slots':>5} {'agg decode tok/s':>17} {'per-seq tok/s':>14} {'ms/step':>8}  per-round tok/s")
    rows = []
    for n in sizes:
        med = statistics.median(per_round[n])
        rows.append({"slots": n, "aggregate_decode_tok_s": med, "per_round": per_round[n]})
        print(f"{n:>5} {med:>17.1f} {med / n:>14.1f} {1e3 * n / med:>8.2f}  {' '.join(f'{x:.1f}' for x in per_round[n])}")
    if len(sizes) > 1:
        base = rows[0]["aggregate_decode_tok_s"]
        print(f"aggregate vs {sizes[0]} slot(s): " + ", ".join(
            f"{r['slots']}: {r['aggregate_decode_tok_s'] / base:.2f}x" for r in rows[1:]))
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "device": probe.device, "rows": rows,
                                            "compiles": runner.compiles, "compile_s": runner.compile_seconds},
                                           indent=2))
    batch.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
