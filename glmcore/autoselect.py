"""The default backend by measurement: the first time glmcore runs on a kind of CPU without --backend, it times
each ready CPU backend's default format (prefill and decode on a small synthetic checkpoint, a few seconds
each) and keeps the fastest. A rule of CPU flags cannot know this: on AMD's AVX-512 OpenVINO's int8 decodes
at half cpu_int4's speed although the flags say it has integer kernels (issue 43).

Each architecture is timed on its own shape (a Mixture-of-Experts decode reads only the chosen experts and
routes every token: a backend's lead on dense layers need not hold there), the first time a checkpoint of it is
loaded. The result is cached in the glmcore cache (autoselect.json for the dense GLMs, autoselect-ARCH.json for
the others) with the package version, the CPU's identity and the set of backends measured, so it is measured
again only when one of those changes; `--backend auto` measures again; timings taken while other programs kept
the CPUs busy are provisional: measured again at the next start, up to BUSY_TRIES times (Contention).
GLMCORE_BACKEND=NAME pins the default; GLMCORE_AUTOSELECT=0 turns the measurement off (the speed_rank rule, as
before: the test suite does this, so no test depends on timings). The same switch and the
same cache helpers (read_cached, write_cached) serve a backend's own choices by timing: cpu_int4's kernel tier.

Which backends: the ready ones on this CPU (probe device "cpu") with a positive speed_rank (the reference
and the emulations of other hardware rank 0 or below; they are for checking, not speed). A ready backend on
another device ranked above them (an accelerator) keeps the rule. The choice: the fastest decode, except that
a backend within 10% of it whose default format keeps more bits wins (equal speed, better quality).
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import GlmcoreError

ENV_PIN = "GLMCORE_BACKEND"
ENV_OFF = "GLMCORE_AUTOSELECT"
CACHE_FILE = "autoselect.json"
NEAR = 0.9                 # within 10% of the fastest decode, the better format wins
PROMPT, GEN, ROUNDS = 64, 16, 3
# the synthetic checkpoint each architecture is timed on: (family, make-model size, layers); ~40M parameters
# dense, ~30M (7M active) for the MoE shapes. An architecture without one keeps the speed_rank rule.
BENCH_SHAPES = {"glm": ("chatglm3", "small", 4), "glm4_moe": ("glm4-moe", "small", 4),
                "glm4_moe_lite": ("glm4-moe-lite", "small", 4)}
# other programs' share of the machine's CPU time during a measurement above which its timings are provisional:
# taken again at the next start, up to BUSY_TRIES measurements (a machine that is always this busy keeps the last).
# Measured on a 2-vCPU Xeon: with a compiler on both CPUs, cpu_int4's AVX-512 tier timed 10% slower than its
# AVX-VNNI tier at prefill; on the quiet machine it is 1.5x faster.
BUSY, BUSY_TRIES = 0.25, 3
# bits a weight keeps in each default format: the quality order (a format with more bits loses less)
FORMAT_BITS = {"f32": 32, "bf16": 16, "f16": 16, "int8": 8, "int4": 4}


@dataclass
class Measured:
    backend: str
    weights: str = ""
    decode: float = 0.0            # tok/s, one sequence
    prefill: float = 0.0           # tok/s, a PROMPT-token prompt
    error: str = ""


@dataclass
class Choice:
    backend: str
    why: str
    results: list[Measured] = field(default_factory=list)
    cpu: str = ""
    version: str = ""
    measured_at: str = ""
    arch: str = "glm"              # the architecture whose shape was timed
    contention: float | None = None   # other programs' share of the CPUs while it was timed (Contention)
    tries: int = 1                 # measurements in a row taken under contention (write_cached counts them)


def cache_name(arch: str) -> str:
    return CACHE_FILE if arch == "glm" else f"autoselect-{arch}.json"


def cpu_identity() -> str:
    """What makes timings comparable: the CPU model, its ISA flags and how many CPUs this process may use."""
    from .cpuinfo import cpu_flags, cpu_name
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    import hashlib
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    return f"{cpu_name()} | {n} cpus | flags {flags}"


def _version() -> str:
    from . import __version__
    return __version__


def candidates(reg, config=None) -> tuple[list[str], str | None]:
    """(the ready CPU speed backends to measure, the rule's choice where it must stand: an accelerator); with a
    config, only those that run it."""
    ready = [n for n in reg.names() if reg.entries[n].backend is not None and reg.probe(n).ready
             and (config is None or reg.get(n).supports(config) is None)]
    rank = {n: reg.get(n).capabilities().speed_rank for n in ready}
    cpu = [n for n in ready if rank[n] > 0 and reg.probe(n).device == "cpu"]
    others = [n for n in ready if n not in cpu and rank[n] > max((rank[c] for c in cpu), default=-10**9)
              and reg.probe(n).device != "cpu"]
    return sorted(cpu), (max(others, key=lambda n: (rank[n], n)) if others else None)


def decide(results: list[Measured]) -> tuple[str, str]:
    """(backend, why) from the measurements: see the module docstring."""
    ok = [r for r in results if not r.error and r.decode > 0]
    if not ok:
        raise GlmcoreError("no backend could be measured: " + "; ".join(f"{r.backend}: {r.error}" for r in results))
    fastest = max(ok, key=lambda r: r.decode)
    near = [r for r in ok if r.decode >= NEAR * fastest.decode]
    best = max(near, key=lambda r: (FORMAT_BITS.get(r.weights, 0), r.decode))
    if best is fastest:
        others = ", ".join(f"{r.backend} {r.decode:.1f}" for r in ok if r is not best)
        why = f"fastest decode: {best.decode:.1f} tok/s" + (f" (vs {others})" if others else "")
    else:
        why = (f"decode {best.decode:.1f} tok/s is within {100 - 100 * NEAR:.0f}% of {fastest.backend}'s "
               f"{fastest.decode:.1f} with a better format ({best.weights} vs {fastest.weights})")
    return best.backend, why


def measurement_off() -> bool:
    """GLMCORE_AUTOSELECT=0: no choice by timing here or in a backend's own (cpu_int4's kernel tier)."""
    return os.environ.get(ENV_OFF, "").strip().lower() in ("0", "false", "no", "off")


class Contention:
    """`with Contention() as c:` around a measurement; c.share is then the share of the machine's CPU time that
    other programs (and, in a VM, the host: steal time) took while it ran, from /proc/stat less this process's own
    CPU time; None where the system does not say."""
    share: float | None = None

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat", encoding="ascii") as f:
                ticks = [int(v) for v in f.readline().split()[1:]]
            busy = sum(ticks[:8]) - ticks[3] - ticks[4]          # all but idle and iowait (steal counts: the host's)
            return busy / os.sysconf("SC_CLK_TCK"), time.process_time(), time.monotonic()
        except (OSError, ValueError, IndexError, AttributeError):
            return None

    def __enter__(self) -> "Contention":
        self._start = self._sample()
        return self

    def __exit__(self, *exc) -> None:
        end = self._sample()
        if self._start is None or end is None or end[2] <= self._start[2]:
            return
        others = (end[0] - self._start[0]) - (end[1] - self._start[1])
        self.share = max(0.0, others) / ((end[2] - self._start[2]) * (os.cpu_count() or 1))


def _busy(share) -> bool:
    """A Contention share above BUSY (None, or anything else an edited cache file holds: not busy)."""
    return isinstance(share, (int, float)) and share > BUSY


def provisional(raw: dict) -> bool:
    """Timings taken under contention, to be taken again while fewer than BUSY_TRIES were."""
    tries = raw.get("tries", 1)
    return _busy(raw.get("contention")) and isinstance(tries, int) and tries < BUSY_TRIES


def contention_note(share: float | None, tries: int) -> str:
    """What `glmcore backends` adds to a measurement taken under contention ('' otherwise)."""
    if not _busy(share):
        return ""
    then = ("provisional, measured again at the next start" if tries < BUSY_TRIES
            else f"kept: the last {tries} measurements all ran beside other work")
    return f" [other programs used {100 * share:.0f}% of the CPUs meanwhile: {then}]"


def _read_stamped(name: str, key: dict) -> dict | None:
    from .cache import read_json
    raw = read_json(name)        # None: none yet, or unreadable: measure again
    stamp = {"version": _version(), "cpu": cpu_identity(), **key}
    if not isinstance(raw, dict) or any(raw.get(k) != v for k, v in stamp.items()):
        return None
    return raw


def read_cached(name: str, **key) -> dict | None:
    """The measurement cached in the glmcore cache as `name`, if this version measured it on this CPU with the
    same `key` values (e.g. the backends measured); None when there is none, it is unreadable, stale or
    provisional (taken under contention: measure again)."""
    raw = _read_stamped(name, key)
    return None if raw is None or provisional(raw) else raw


def write_cached(name: str, data: dict, what: str) -> int:
    """Cache `data` (with the version and CPU stamps read_cached compares) whole or not at all; returns its count of
    tries: a measurement under contention (data's "contention") right after a provisional one is a further try."""
    from .cache import cache_root, write_json
    before = _read_stamped(name, {}) if _busy(data.get("contention")) else None
    tries = before.get("tries", 1) + 1 if before is not None and provisional(before) else 1
    try:
        write_json(name, {**data, "tries": tries, "version": _version(), "cpu": cpu_identity()})
    except OSError as e:
        print(f"note: could not cache {what} in {cache_root() / name} ({e.strerror})", file=sys.stderr)
    return tries


def cached(names: list[str] | None, arch: str = "glm") -> Choice | None:
    """The cached choice for arch, if it was measured by this version on this CPU over these backends (None:
    over whichever it measured)."""
    raw = read_cached(cache_name(arch))
    if raw is None:
        return None
    try:
        choice = Choice(**{**raw, "results": [Measured(**r) for r in raw["results"]]})
    except (TypeError, KeyError):
        return None
    if choice.arch != arch:              # an edited file: measure again
        return None
    return choice if names is None or sorted(r.backend for r in choice.results) == sorted(names) else None


def choose(reg, rerun: bool = False, measure: Callable[[str, str], Measured] | None = None,
           progress: Callable[[str], None] | None = None, config=None) -> Choice | None:
    """The measured default for config's architecture (the dense GLMs' without one; cached; rerun=True
    measures again), or None where the rule stands: measurement off, an accelerator ready, fewer than two CPU
    backends that run it, or an architecture without a timing shape. GLMCORE_BACKEND pins it."""
    pin = os.environ.get(ENV_PIN, "").strip()
    if pin:
        reg.get(pin)                      # an unknown name is a clear error
        return Choice(pin, f"pinned by {ENV_PIN}={pin}")
    arch = getattr(config, "arch", "glm")
    if measurement_off() or arch not in BENCH_SHAPES:
        return None
    names, accelerator = candidates(reg, config)
    if rerun:                            # what the backends chose by measuring (a kernel tier) goes first
        for n in names:
            reg.get(n).remeasure()
    if accelerator is not None or len(names) < 2:
        return None
    if not rerun:
        found = cached(names, arch)
        if found is not None:
            return found
    measure = measure or measure_backend
    say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    say(f"note: measuring {', '.join(names)} once on this CPU to choose the default backend for {arch} (a few "
        f"seconds each; cached, `--backend auto` measures again, {ENV_PIN}=NAME pins one)")
    results = []
    with Contention() as busy:
        for n in names:
            try:
                results.append(measure(n, arch))
            except Exception as e:           # a backend that fails here is not chosen; the others still are
                results.append(Measured(n, error=f"{type(e).__name__}: {e}"))
    backend, why = decide(results)
    choice = Choice(backend, why, results, cpu_identity(), _version(),
                    time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), arch, busy.share)
    choice.tries = write_cached(cache_name(arch), asdict(choice), "the backend measurement")
    return choice


# ---------------------------------------------------------------- the measurement

def _bench_model(arch: str) -> Path:
    """The architecture's synthetic checkpoint (BENCH_SHAPES), made once."""
    from .cache import build_once, cache_root
    from .synth import make_model
    family, size, layers = BENCH_SHAPES[arch]
    final = cache_root() / "autoselect" / f"{family}-{size}-{layers}l-{_version()}"
    return build_once(final, lambda tmp: make_model(family, size, tmp, layers=layers),
                      complete=lambda p: (p / "config.json").is_file())


def measure_backend(name: str, arch: str = "glm") -> Measured:
    """Prefill of a PROMPT-token prompt and GEN decode steps on one sequence, the median of ROUNDS after a
    warm-up, with the backend's default format (as `glmcore run` would load it)."""
    import numpy as np

    from .backend import LoadOptions, registry
    from .config import ModelConfig
    from .weights import load_weights
    d = _bench_model(arch)
    cfg = ModelConfig.from_dir(d)
    backend = registry().get(name)
    opts = backend.resolve(LoadOptions(capacity=PROMPT + GEN + 8))
    batch = backend.load_batch(cfg, load_weights(d, cfg), opts, 1)
    try:
        ids = [int(t) for t in np.random.default_rng(0).integers(0, cfg.vocab_size, PROMPT)]
        pre, dec = [], []
        for _ in range(ROUNDS + 1):                     # the first round warms up (compiles, pages in)
            batch.reset(0)
            t0 = time.perf_counter()
            logits = batch.step([(0, ids)])
            t1 = time.perf_counter()
            for _ in range(GEN):
                logits = batch.step([(0, [int(np.argmax(logits[-1]))])])
            t2 = time.perf_counter()
            pre.append(PROMPT / (t1 - t0))
            dec.append(GEN / (t2 - t1))
        return Measured(name, opts.weights or "", statistics.median(dec[1:]), statistics.median(pre[1:]))
    finally:
        batch.close()


def describe(choice: Choice | None, rule_choice: str) -> list[str]:
    """The lines `glmcore backends` prints about the default."""
    if choice is None:
        return [f"default: {rule_choice} (by speed_rank: measurement off ({ENV_OFF}=0), an accelerator is ready, "
                "or only one CPU backend is ready)"]
    family, size, layers = BENCH_SHAPES[choice.arch]
    lines = [f"default{'' if choice.arch == 'glm' else ' for ' + choice.arch}: {choice.backend} ({choice.why})"]
    if choice.results:
        lines.append(f"  measured {choice.measured_at} by glmcore {choice.version} on {choice.cpu} "
                     f"(synthetic {family} {size}, {layers} layers, one sequence; `--backend auto` measures again)"
                     f"{contention_note(choice.contention, choice.tries)}:")
        for r in choice.results:
            lines.append(f"  {r.backend:<14} " + (f"failed: {r.error}" if r.error else
                                                  f"{r.weights:<5} decode {r.decode:8.1f} tok/s  "
                                                  f"prefill {r.prefill:8.1f} tok/s"))
    return lines
