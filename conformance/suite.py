"""`glmcore conformance`: every ready backend against the torch reference, teacher-forced.

    glmcore conformance                                   # every ready backend, three tiny families
    glmcore conformance --backend openvino_amx --model ./chatglm3-6b --out report/

From Python (third-party plugins, or backends built in a test):

    from glmcore_conformance import run_suite
    report = run_suite([MyBackend()], families=["chatglm3"])
    assert report.passed, format_table(report)

What is covered per backend: every precision and every weight format it declares at least once
(the default pair, then each other precision with the default weights and each other weight format with
the default precision; `all_combos` runs the full cross product), plus each extra configuration the
backend lists in an optional `conformance_variants()` method (see conformance/README.md).
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from glmcore.backend import Backend, LoadOptions, Session, SlotSession, registry
from glmcore.config import FAMILIES
from glmcore.errors import BackendError, GlmcoreError

from . import cases as C
from .metrics import ShapeMismatch, compare, out_of_bounds
from .models import Model, TokenSource, open_model, synthetic_dir
from .reference import Reference, reference_backend, shift_in_place
from .report import CaseResult, Report, format_table, write
from .tolerances import TOLERANCES, Tolerance, tolerance_key

DEFAULT_CAPACITY = 128
DEFAULT_DECODE_STEPS = 64
PINNED = ("precision", "weights")     # keys of a conformance variant that pick the formats


@dataclass(frozen=True)
class Config:
    precision: str
    weights: str
    extra: tuple = ()       # sorted (key, value) pairs of LoadOptions.extra

    @property
    def label(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.extra)
        return f"{self.precision}/{self.weights}" + (f" {opts}" if opts else "")


def variants(backend: Backend) -> list[dict]:
    """The backend's own extra configurations to check: `conformance_variants() -> list[dict]`, each a
    LoadOptions.extra dict, optionally pinning "precision"/"weights". Default: [{}]."""
    return [dict(v) for v in backend.conformance_variants() or []] or [{}]


def plan(backend: Backend, precision: str | None = None, weights: str | None = None,
         extra: dict | None = None, all_combos: bool = False) -> tuple[list[Config], list[Config]]:
    """(cover, more): `cover` is tried in order until every selected precision and weight format has
    loaded once (all of it with all_combos); `more` are the backend's further variants, each run once
    unless the cover already ran it."""
    caps = backend.capabilities()
    precisions = [precision] if precision else list(caps.precisions)
    formats = [weights] if weights else list(caps.weight_formats)
    declared = variants(backend) if extra is None else [dict(extra)]
    base = declared[0]
    dp = base.get("precision") or (caps.default_precision if caps.default_precision in precisions else precisions[0])
    dw = base.get("weights") or (caps.default_weights if caps.default_weights in formats else formats[0])
    if dp not in precisions or dw not in formats:    # the base variant pins what the user filtered out
        dp, dw = precisions[0], formats[0]
    base_extra = tuple(sorted((k, v) for k, v in base.items() if k not in PINNED))
    pairs = [(dp, dw)] + [(p, dw) for p in precisions] + [(dp, w) for w in formats]
    pairs += list(itertools.product(precisions, formats))
    cover = _unique(Config(p, w, base_extra) for p, w in pairs)
    more = []
    for v in declared[1:]:
        p, w = v.get("precision", dp), v.get("weights", dw)
        if p in precisions and w in formats:
            more.append(Config(p, w, tuple(sorted((k, x) for k, x in v.items() if k not in PINNED))))
    return cover, _unique(more)


def _unique(items) -> list:
    out = []          # by equality, not hash: option values may be lists or dicts
    for x in items:
        if x not in out:
            out.append(x)
    return out


FP32 = "fp32 ref"
OWN = "own weights"
SELF = "own prefill"


@dataclass
class Against:
    """One reference a configuration is compared with, and the tolerance row that applies."""
    name: str
    reference: Reference | None       # None: the backend against itself
    tolerance: Tolerance
    key: str


def own_weights_reference(backend: Backend, model: Model, options: LoadOptions, reference: Reference):
    """The reference run on the weights this configuration really computes with, when the backend says
    what they are: optional `conformance_weights(config, weights, options) -> (mapping, tolerance_key)`,
    the mapping holding float32 arrays under canonical names (dequantized int8/int4, rounded bf16 ...;
    names left out keep the checkpoint's), the key naming the row of tolerances.py that the remaining
    differences answer to (the compute path's: f32, bf16, or int8 for int8 activations).

    The quality comparison with the fp32 reference stays: a quantizer that is wrong in the same way in
    both the backend and its hook passes here, and fails there."""
    found = backend.conformance_weights(model.config, model.weights, options)
    if not found:
        return None
    own, key = found
    if key not in TOLERANCES:
        raise GlmcoreError(f"conformance_weights() names tolerance {key!r}; choose one of {', '.join(TOLERANCES)}")
    key = tolerance_key(key, "f32", experts=_has_experts(model))     # routing flips under rounding
    weights = dict(model.weights)
    unknown = sorted(set(own) - set(weights))
    if unknown:
        raise GlmcoreError(f"conformance_weights() returned unknown tensor {unknown[0]!r}; use canonical names")
    weights.update(own)
    own_model = Model(model.path, model.config, weights, model.synthetic)
    return Against(OWN, Reference(own_model, reference.backend, reference.threads), TOLERANCES[key], key)


class Suite:
    def __init__(self, capacity: int | None = None, decode_steps: int = DEFAULT_DECODE_STEPS,
                 cases: Sequence[str] = C.CASES, threads: int | None = None, seed: int = 0,
                 reference: Backend | None = None, progress: Callable[[str], None] | None = None):
        unknown = sorted(set(cases) - set(C.CASES))
        if unknown:
            raise GlmcoreError(f"unknown case {unknown[0]!r}; choose from {', '.join(C.CASES)}")
        if decode_steps < 1:
            raise GlmcoreError(f"invalid --decode-steps {decode_steps}: use a positive integer")
        self.capacity = capacity or max(DEFAULT_CAPACITY, C.PROMPT + decode_steps)
        if self.capacity < max(C.MIN_CAPACITY, C.PROMPT + decode_steps):
            raise GlmcoreError(f"--capacity {self.capacity} is too small: the cases need at least "
                               f"{max(C.MIN_CAPACITY, C.PROMPT + decode_steps)}")
        self.decode_steps = decode_steps
        self.cases = tuple(c for c in C.CASES if c in cases)
        self.threads = threads
        self.seed = seed
        self.reference_backend = reference
        self.progress = progress or (lambda msg: None)
        self.report = Report()

    # ------------------------------------------------------------ driving

    def run(self, backends: Sequence[Backend], models: Sequence[Model], precision=None, weights=None,
            extra=None, all_combos=False) -> Report:
        ref_backend = self.reference_backend or reference_backend()
        ready = []
        for b in backends:
            probe = b.probe()
            if probe.ready:
                ready.append(b)
            else:
                self._skip({"backend": b.name, "reason": f"not ready: {probe.reason}"})
        self.report.meta = self._meta(ref_backend, ready, models)
        for model in models:
            reference = Reference(model, ref_backend, self.threads)
            try:
                for backend in ready:
                    why = backend.supports(model.config)
                    if why:         # an architecture this backend does not run: said, not failed
                        self._skip({"backend": backend.name, "model": model.label, "reason": why})
                        continue
                    if precision and precision not in backend.capabilities().precisions or \
                            weights and weights not in backend.capabilities().weight_formats:
                        self._skip({"backend": backend.name, "config": f"{precision or '*'}/{weights or '*'}",
                                    "reason": "not offered by this backend"})
                        continue
                    self._run_backend(backend, model, reference, precision, weights, extra, all_combos)
            finally:
                reference.close()
        return self.report

    def _run_backend(self, backend, model, reference, precision, weights, extra, all_combos) -> None:
        cover, more = plan(backend, precision, weights, extra, all_combos)
        need_p = {c.precision for c in cover}
        need_w = {c.weights for c in cover}
        refused: dict[str, str] = {}
        ran = []
        for cfg in cover:
            if not all_combos and cfg.precision not in need_p and cfg.weights not in need_w:
                continue
            if self._run_config(backend, model, reference, cfg, refused):
                ran.append(cfg)
                need_p.discard(cfg.precision)
                need_w.discard(cfg.weights)
        for cfg in more:
            if cfg not in ran:
                self._run_config(backend, model, reference, cfg, refused)
        for what, names in (("precision", need_p), ("weight format", need_w)):
            for name in sorted(names):
                why = "; ".join(m for label, m in refused.items() if name in label.split()[0].split("/"))
                cfg = Config(name, "*") if what == "precision" else Config("*", name)
                self._fail(backend, model, cfg, "load",
                           f"declares {what} {name!r} but no configuration with it loads: {why}")

    def _run_config(self, backend: Backend, model: Model, reference: Reference, cfg: Config,
                    refused: dict) -> bool:
        """Load one configuration and run the cases on it. False when the backend refused it."""
        from glmcore.cache import cache_root
        caps = backend.capabilities()
        limits = [self.capacity, model.config.max_seq_len] + ([caps.max_context] if caps.max_context else [])
        opts = LoadOptions(cfg.precision, cfg.weights, min(limits), self.threads, cache_root() / "converted",
                           dict(cfg.extra))
        self.progress(f"conformance: {backend.name} {model.label} {cfg.label}: loading")
        try:
            tol_key = tolerance_key(cfg.precision, cfg.weights, experts=_has_experts(model))
        except GlmcoreError as e:
            self._fail(backend, model, cfg, "load", str(e))
            return True
        t0 = time.perf_counter()
        try:
            opts = backend.resolve(opts)
            # the single-sequence API where the backend offers one, else slot 0 of its batch session
            session = (backend.load(model.config, model.weights, opts) if backend.offers("load")
                       else SlotSession(backend.load_batch(model.config, model.weights, opts, 1)))
        except BackendError as e:          # a clean refusal of this combination
            refused[cfg.label] = str(e)
            self._skip({"backend": backend.name, "config": cfg.label, "reason": f"refused: {e}"})
            return False
        except Exception as e:
            self._fail(backend, model, cfg, "load", f"load failed: {type(e).__name__}: {e}")
            return True
        load_s = time.perf_counter() - t0
        try:
            if session.kv_len != 0:
                raise C.ContractError(f"a new session has kv_len {session.kv_len}, expected 0")
            script = C.Script.build(TokenSource(model, self.seed), session.capacity, self.decode_steps)
        except (C.ContractError, GlmcoreError) as e:
            self._fail(backend, model, cfg, "load", str(e))
            session.close()
            return True
        self.progress(f"conformance: {backend.name} {model.label} {cfg.label}: loaded in {load_s:.1f}s, "
                      f"capacity {session.capacity}")
        refs = [Against(FP32, reference, TOLERANCES[tol_key], tol_key)]
        try:
            own = own_weights_reference(backend, model, opts, reference)
        except Exception as e:
            self._fail(backend, model, cfg, "load", f"conformance_weights() failed: {type(e).__name__}: {e}")
            own = None
        if own:
            refs.append(own)
        try:
            self._run_cases(backend, model, refs, cfg, session, script)
            if {"batch_mixed", "batch_generate"} & set(self.cases):
                self._batch_cases(backend, model, refs, cfg, opts, session, script)
        finally:
            session.close()
            if own:
                own.reference.close()
        return True

    def _batch_cases(self, backend, model, refs: list["Against"], cfg, opts, session: Session, sc: C.Script) -> None:
        """Contract v2 on the backend's batch session (native, or the core's adapter)."""
        vocab, can_shift = model.config.vocab_size, backend.capabilities().can_shift
        names = [n for n in ("batch_mixed", "batch_generate") if n in self.cases]
        try:
            bs = backend.load_batch(model.config, model.weights, opts, C.BATCH_SLOTS)
        except Exception as e:
            for n in names:
                self._fail(backend, model, cfg, n, f"load_batch failed: {_describe(e)}", refs[0].key)
            return
        try:
            if bs.n_slots != C.BATCH_SLOTS or bs.capacity < sc.capacity:
                raise C.ContractError(f"load_batch gave {bs.n_slots} slots of {bs.capacity}, asked for "
                                      f"{C.BATCH_SLOTS} of {sc.capacity}")
            if "batch_mixed" in self.cases:
                t0 = time.perf_counter()
                try:
                    got = C.batch_mixed(bs, sc, vocab, backend.capabilities())
                except Exception as e:
                    self._fail(backend, model, cfg, "batch_mixed", _describe(e), refs[0].key)
                else:
                    seconds = time.perf_counter() - t0
                    in_place = shift_in_place if can_shift else None
                    for against in refs:
                        want = against.reference.run(("batch_mixed", sc.capacity, can_shift), sc.capacity,
                                                     lambda s: C.batch_mixed_reference(s, sc, vocab, in_place))
                        self._judge(backend, model, cfg, "batch_mixed", want["batch_mixed"], got["batch_mixed"],
                                    against, seconds)
            if "batch_generate" in self.cases:
                for slot in range(bs.n_slots):
                    bs.reset(slot)
                self._batch_generate(backend, model, cfg, bs, session, sc, can_shift, refs[0].key)
        except C.ContractError as e:
            for n in names:
                self._fail(backend, model, cfg, n, str(e), refs[0].key)
        finally:
            bs.close()

    def _batch_generate(self, backend, model, cfg, bs, session, sc, can_shift, tol_key) -> None:
        """Tokens of requests run together equal each run alone. Judged where the backend computes in
        f32 with f32 weights (elsewhere a batched kernel may round differently and flip a near-tie:
        reported, not judged)."""
        t0 = time.perf_counter()
        try:
            r = C.batch_generate(bs, session, sc, model.config.vocab_size, backend.capabilities())
        except Exception as e:
            self._fail(backend, model, cfg, "batch_generate", _describe(e), tol_key)
            return
        differ = [i for i, (a, b) in enumerate(zip(r["together"], r["alone"])) if a != b]
        judged = tol_key == "f32"
        note = (f"{len(r['together'])} requests (request {r['seeded']} seeded) equal to each run alone" if not differ
                else f"requests {differ} differ from their runs alone: {[r['together'][i] for i in differ]} vs "
                     f"{[r['alone'][i] for i in differ]}")
        if not judged:
            note += f" (informative at {tol_key}: not judged)"
        self.report.results.append(CaseResult(
            backend.name, model.label, cfg.label, "batch_generate", cfg.precision, cfg.weights, dict(cfg.extra),
            tol_key, failed=["tokens"] if differ and judged else [], note=note, seconds=time.perf_counter() - t0))

    def _run_cases(self, backend, model, refs: list["Against"], cfg, session: Session, sc: C.Script) -> None:
        vocab = model.config.vocab_size
        can_shift = backend.capabilities().can_shift
        cap = sc.capacity
        in_place = shift_in_place if can_shift else None
        groups = [
            (("prefill", "decode"), lambda s: C.prefill_decode(s, sc, vocab),
             ("prefill_decode", cap), lambda s: C.prefill_decode(s, sc, vocab)),
            (("reset_reuse",), lambda s: C.reset_reuse(s, sc, vocab),
             ("reset_reuse", cap), lambda s: C.reset_reuse(s, sc, vocab)),
            (("near_capacity",), lambda s: C.near_capacity(s, sc, vocab),
             ("near_capacity", cap), lambda s: C.near_capacity(s, sc, vocab)),
            (("window_shift",), lambda s: C.window_shift(s, sc, vocab, can_shift),
             ("window_shift", cap, can_shift), lambda s: C.window_shift_reference(s, sc, vocab, in_place)),
            (("chat_continuation",), lambda s: C.chat_continuation(s, sc, vocab),
             ("chat_continuation", cap), lambda s: C.chat_continuation_reference(s, sc, vocab)),
        ]
        for i, (names, run, ref_key, ref_run) in enumerate(groups):
            names = [n for n in names if n in self.cases]
            self_check = i == 0 and "decode_vs_prefill" in self.cases
            if not names and not self_check:
                continue
            t0 = time.perf_counter()
            try:
                got = run(session)
            except Exception as e:
                for n in names + ["decode_vs_prefill"] * self_check:
                    self._fail(backend, model, cfg, n, _describe(e), refs[0].key)
                continue
            seconds = time.perf_counter() - t0
            for against in refs:
                want = against.reference.run(ref_key, cap, ref_run) if names else {}
                for n in names:
                    self._judge(backend, model, cfg, n, want[n], got[n], against, seconds / len(names))
            if self_check:
                self._decode_vs_prefill(backend, model, cfg, session, sc, got)
        if "seed" in self.cases:
            self._seed_case(backend, model, refs[0].reference, cfg, session, sc, can_shift, refs[0].key)

    def _decode_vs_prefill(self, backend, model, cfg, session, sc: C.Script, got: dict) -> None:
        """The backend against itself: its decode steps against one prefill of the same ids. Both use
        the same weights, so this holds to the compute precision's row whatever the weight format,
        which keeps a positional bug in an int4 backend from hiding in the loose int4 row."""
        key = tolerance_key(cfg.precision, "f32", experts=_has_experts(model))
        t0 = time.perf_counter()
        try:
            want = C.one_shot_prefill(session, sc, model.config.vocab_size)["decode_vs_prefill"]
        except Exception as e:
            self._fail(backend, model, cfg, "decode_vs_prefill", _describe(e), key)
            return
        stepped = np.concatenate([got["prefill"], got["decode"]])
        self._judge(backend, model, cfg, "decode_vs_prefill", want, stepped, Against(SELF, None, TOLERANCES[key], key),
                    time.perf_counter() - t0)

    def _seed_case(self, backend, model, reference, cfg, session, sc, can_shift, tol_key) -> None:
        vocab = model.config.vocab_size
        t0 = time.perf_counter()
        try:
            first = C.seeded_tokens(session, sc, vocab, can_shift)
            second = C.seeded_tokens(session, sc, vocab, can_shift)
        except Exception as e:
            self._fail(backend, model, cfg, "seed", _describe(e), tol_key)
            return
        ref = reference.run(("seed", sc.capacity), sc.capacity, lambda s: C.seeded_tokens(s, sc, vocab, False))
        same = sum(a == b for a, b in zip(first, second))
        as_ref = sum(a == b for a, b in zip(first, ref))
        identical = first == second
        note = (f"{len(first)} sampled tokens identical in both runs" if identical else
                f"runs differ: {same}/{max(len(first), len(second))} tokens equal; {first} vs {second}")
        note += f" (equal to the reference's draw: {as_ref}/{len(ref)}; informative, not judged)"
        self.report.results.append(CaseResult(
            backend.name, model.label, cfg.label, "seed", cfg.precision, cfg.weights, dict(cfg.extra), tol_key,
            failed=[] if identical else ["tokens"], note=note, seconds=time.perf_counter() - t0))

    # ------------------------------------------------------------ results

    def _judge(self, backend, model, cfg, case, want, got, against: "Against", seconds) -> None:
        try:
            metrics = compare(want, got)
        except ShapeMismatch as e:
            self._fail(backend, model, cfg, case, str(e), against.key)
            return
        bounds = against.tolerance.bounds()
        self.report.results.append(CaseResult(
            backend.name, model.label, cfg.label, case, cfg.precision, cfg.weights, dict(cfg.extra), against.key,
            metrics=metrics, bounds=bounds, failed=out_of_bounds(metrics, bounds), seconds=seconds,
            against=against.name))

    def _skip(self, entry: dict) -> None:
        if entry not in self.report.skipped:      # once, not once per model
            self.report.skipped.append(entry)

    def _fail(self, backend, model, cfg, case, error, tol_key="") -> None:
        self.report.results.append(CaseResult(
            backend.name, model.label, cfg.label, case, cfg.precision, cfg.weights, dict(cfg.extra), tol_key,
            error=error))

    def _meta(self, ref_backend: Backend, backends: Sequence[Backend], models: Sequence[Model]) -> dict:
        import glmcore
        from glmcore.cpuinfo import cpu_name
        probes = {}
        for b in [ref_backend, *backends]:
            p = b.probe()
            probes[b.name] = {"device": p.device, **{k: str(v) for k, v in p.details.items()}}
        return {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "glmcore": getattr(glmcore, "__version__", ""),
            "machine": f"{cpu_name()}, {platform.system()} {platform.machine()}, Python {platform.python_version()}",
            "reference": ref_backend.name,
            "backends": probes,
            "models": [{"label": m.label, "path": str(m.path), "synthetic": m.synthetic,
                        "config": m.config.to_dict()} for m in models],
            "capacity": self.capacity,
            "decode_steps": self.decode_steps,
            "cases": list(self.cases),
            "tolerances": {k: v.bounds() for k, v in TOLERANCES.items()},
        }


def _has_experts(model: Model) -> bool:
    """Whether the model routes tokens to experts (the MoE GLMs' configs say how many)."""
    return getattr(model.config, "num_experts", 0) > 0


def _describe(e: Exception) -> str:
    if isinstance(e, C.ContractError):
        return f"contract: {e}"
    return f"{type(e).__name__}: {e}"


def load_models(families: Sequence[str] = FAMILIES, model_dir=None, size: str = "tiny") -> list[Model]:
    if model_dir:
        return [open_model(model_dir)]
    bad = [f for f in families if f not in FAMILIES]
    if bad:
        raise GlmcoreError(f"unknown family {bad[0]!r}; choose from {', '.join(FAMILIES)}")
    return [open_model(synthetic_dir(f, size), synthetic=True) for f in families]


@dataclass
class SuiteOptions:
    """What run_suite checks and how (each field is also a keyword of run_suite)."""
    families: Sequence[str] = FAMILIES        # synthetic checkpoints of these families ...
    model_dir: str | None = None              # ... or this checkpoint instead
    size: str = "tiny"
    precision: str | None = None              # only this compute precision / weight format
    weights: str | None = None
    extra: dict | None = None                 # LoadOptions.extra; replaces the backends' conformance_variants()
    all_combos: bool = False                  # every precision x weight format pair
    capacity: int | None = None               # KV slots per session (default 128, or the backend's max)
    decode_steps: int = DEFAULT_DECODE_STEPS
    cases: Sequence[str] = field(default_factory=lambda: list(C.CASES))
    threads: int | None = None
    seed: int = 0
    reference: Backend | None = None          # default: the torch backend
    progress: Callable[[str], None] | None = None


def run_suite(backends: Sequence[Backend], options: SuiteOptions | None = None, **fields) -> Report:
    """Run the cases on each backend (Backend objects: registered or not) and return the Report.
    Backends whose probe is not ready are listed in report.skipped. `fields` override `options`'."""
    o = replace(options or SuiteOptions(), **fields)
    suite = Suite(o.capacity, o.decode_steps, o.cases, o.threads, o.seed, o.reference, o.progress)
    return suite.run(backends, load_models(o.families, o.model_dir, o.size), o.precision, o.weights, o.extra,
                     o.all_combos)


# ---------------------------------------------------------------- command line

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="glmcore conformance",
        description="Check backends against the torch reference logits, teacher-forced on identical token ids. "
                    "Exit 0 when every case passes, 1 when any fails, 2 on a usage error.")
    ap.add_argument("--backend", action="append", default=[], metavar="NAME",
                    help="backend to check (repeat, or comma-separate); default: every ready backend")
    ap.add_argument("--model", help="a checkpoint directory to check on (default: synthetic tiny models)")
    ap.add_argument("--family", action="append", default=[], choices=FAMILIES,
                    help="synthetic model families (default: all three)")
    ap.add_argument("--size", default="tiny", choices=["tiny", "small", "1b", "6b"],
                    help="synthetic model size (default tiny)")
    ap.add_argument("--precision", help="only this compute precision")
    ap.add_argument("--weights", help="only this weight format")
    ap.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                    help="backend option (LoadOptions.extra); replaces the backend's conformance_variants()")
    ap.add_argument("--all-combos", action="store_true",
                    help="every precision x weight format pair, not just each of them once")
    ap.add_argument("--capacity", type=int, help=f"KV slots per session (default {DEFAULT_CAPACITY}); "
                    "the near-capacity case fills all of them")
    ap.add_argument("--decode-steps", type=int, default=DEFAULT_DECODE_STEPS)
    ap.add_argument("--cases", help=f"comma-separated subset of: {', '.join(C.CASES)}")
    ap.add_argument("--quick", action="store_true", help="one family (chatglm3) instead of three")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--tp", type=int, default=1, metavar="N",
                    help="split each backend over N tensor-parallel ranks (torch, ascend_npu); the reference "
                         "stays one rank")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random ids where no tokenizer is found")
    ap.add_argument("--out", help="write conformance.json and conformance.md into this directory")
    return ap


def main(argv: list[str] | None = None) -> int:
    from glmcore.options import parse_opts
    from glmcore.model import resolve_backend
    a = build_parser().parse_args(argv)
    if a.out and Path(a.out).exists() and not Path(a.out).is_dir():     # refuse before the suite runs
        raise GlmcoreError(f"--out {a.out} is a file; give a directory for conformance.json and conformance.md")
    reg = registry()
    names = [n for arg in a.backend for n in arg.split(",") if n]
    if names:
        backends = [resolve_backend(n) for n in names]     # unknown or not ready: GlmcoreError, exit 2
    else:
        backends = [reg.get(n) for n in reg.ready()]
        for n in reg.names():
            if n not in reg.ready():
                print(f"conformance: skipping {n}: not ready ({reg.probe(n).reason})", file=sys.stderr)
    if not backends:
        raise GlmcoreError('no backend is ready; run `glmcore backends`, e.g. pip install "glmcore[torch]"')
    if a.tp != 1:       # each backend split over --tp ranks, held to the single-rank reference
        from glmcore.parallel import TensorParallel
        if a.tp < 1:
            raise GlmcoreError(f"invalid --tp {a.tp}: use a positive number of ranks")
        if not names:
            for b in backends:
                if not b.offers("load_shard"):
                    print(f"conformance: skipping {b.name}: no tensor-parallel path", file=sys.stderr)
            backends = [b for b in backends if b.offers("load_shard")]
        backends = [TensorParallel(b, a.tp) for b in backends]     # a named one without it: error, exit 2
    if a.precision and not any(a.precision in b.capabilities().precisions for b in backends):
        raise GlmcoreError(f"no selected backend offers precision {a.precision!r}; see `glmcore backends`")
    if a.weights and not any(a.weights in b.capabilities().weight_formats for b in backends):
        raise GlmcoreError(f"no selected backend offers weight format {a.weights!r}; see `glmcore backends`")
    if a.threads is not None and a.threads < 1:
        raise GlmcoreError(f"invalid --threads {a.threads}: use a positive integer")
    families = ["chatglm3"] if a.quick else (a.family or list(FAMILIES))
    cases = a.cases.split(",") if a.cases else C.CASES
    extra = parse_opts(a.opt) if a.opt else None
    t0 = time.perf_counter()
    report = run_suite(backends, SuiteOptions(families, a.model, a.size, a.precision, a.weights, extra, a.all_combos,
                                              a.capacity, a.decode_steps, cases, a.threads, a.seed,
                                              progress=lambda m: print(m, file=sys.stderr, flush=True)))
    print(format_table(report))
    if a.out:
        js, md = write(report, a.out)
        print(f"wrote {js} and {md}", file=sys.stderr)
    print(f"({time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    return 0 if report.passed else 1


if __name__ == "__main__":
    from glmcore.cli import main as cli_main
    sys.exit(cli_main(["conformance", *sys.argv[1:]]))
