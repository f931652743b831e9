"""Perplexity as llama-perplexity computes it, and the quantization-quality table across backends.

Chunks (default): the text's tokens are cut into chunks of `ctx` tokens; each chunk is evaluated on
its own with the model's prefix ([gMASK]sop, as llama.cpp puts BOS) over its first tokens, and only the
second half is scored (every scored token sees at least ctx/2 tokens of context). Sliding window
(`stride`): windows of `ctx` tokens every `stride` tokens, the last `stride` positions of each scored.
The error is llama.cpp's: ppl * sqrt(var(nll) / (n - 1)).

Across backends, the reference's log-probabilities at every scored position are kept (in a temporary
file, like llama.cpp's --kl-divergence-base) and each backend is compared with them: KL(reference ||
backend) per token (mean and 99th percentile) and how often both pick the same top-1 token.
"""
from __future__ import annotations

import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..backend import LoadOptions, registry
from ..errors import GlmcoreError
from ..files import decode_text, read_bounded
from .scoring import log_softmax, run_slots


@dataclass
class Spec:
    """One row of the table: a backend and its variant, e.g. `cpu_int4:g128` or `openvino_amx:int4:bf16`."""
    backend: str
    precision: str | None = None
    weights: str | None = None
    extra: dict = field(default_factory=dict)
    text: str = field(default="", compare=False)     # as written in --backends

    @classmethod
    def parse(cls, text: str) -> "Spec":
        """`backend[:variant...]`; a variant is a weight format or precision the backend offers, gN (group
        size N) or KEY=VALUE (a backend option, as --opt)."""
        name, *variants = [p.strip() for p in text.strip().split(":")]
        if not name:
            raise GlmcoreError(f"--backends entry {text!r} names no backend; write e.g. cpu_int4:g128")
        caps = registry().get(name).capabilities()
        spec = cls(name, text=text.strip())
        for v in variants:
            if v in caps.weight_formats and spec.weights is None:
                spec.weights = v
            elif v in caps.precisions and spec.precision is None:
                spec.precision = v
            elif v[:1] == "g" and v[1:].isdigit():
                spec.extra["group_size"] = int(v[1:])
            elif "=" in v:
                key, value = v.split("=", 1)
                spec.extra[key] = int(value) if value.isdigit() else value
            else:
                raise GlmcoreError(f"--backends {text!r}: unknown variant {v!r} for {name}; use a weight format "
                                   f"({', '.join(caps.weight_formats)}), a precision ({', '.join(caps.precisions)}), "
                                   "gN for a group size, or KEY=VALUE")
        return spec

    def options(self, ctx: int | None, threads: int | None) -> LoadOptions:
        return LoadOptions(self.precision, self.weights, ctx, threads, extra=dict(self.extra))

    def format(self, ctx: int | None = None) -> str:
        """precision/weights and options as the backend resolves them, e.g. `f32/int4 g128`."""
        o = registry().get(self.backend).resolve(self.options(ctx, None))
        extra = " ".join(f"g{v}" if k == "group_size" else f"{k}={v}" for k, v in sorted(o.extra.items()))
        return f"{o.precision}/{o.weights}" + (f" {extra}" if extra else "")


def parse_specs(text: str) -> list[Spec]:
    specs = [Spec.parse(t) for t in text.split(",") if t.strip()]
    if not specs:
        raise GlmcoreError("--backends is empty; list backends, e.g. --backends torch,cpu_int4:g32,cpu_int4:g128")
    return specs


def windows(n_tokens: int, ctx: int, stride: int | None = None, chunks: int | None = None,
            n_prefix: int = 2) -> list[tuple[int, int]]:
    """(start, first scored position) of each window of `ctx` tokens, as llama-perplexity places them."""
    if ctx < 2 * n_prefix + 2:
        raise GlmcoreError(f"--ctx {ctx} is too small to score anything; use at least {2 * n_prefix + 2}")
    if stride:
        if not 1 <= stride <= ctx - n_prefix - 1:
            raise GlmcoreError(f"--stride {stride} must be between 1 and ctx - {n_prefix + 1} = {ctx - n_prefix - 1} "
                               "(the window's first tokens are the model's prefix)")
        if n_tokens <= ctx:
            raise GlmcoreError(f"the text has {n_tokens} tokens; a sliding window of {ctx} needs more; use a "
                               "longer text or a smaller --ctx")
        out = [(i * stride, ctx - stride - 1) for i in range((n_tokens - ctx + stride - 1) // stride)]
    else:
        if n_tokens < 2 * ctx:
            raise GlmcoreError(f"the text has {n_tokens} tokens; perplexity with --ctx {ctx} needs at least "
                               f"{2 * ctx}; use a longer text or a smaller --ctx")
        out = [(i * ctx, ctx // 2) for i in range(n_tokens // ctx)]
    return out[:chunks] if chunks else out


def ppl_and_error(nll: np.ndarray) -> tuple[float, float]:
    """Perplexity exp(mean nll) and llama.cpp's error estimate ppl * sqrt(var(nll) / (n - 1))."""
    n = len(nll)
    if n == 0:
        return float("nan"), float("nan")
    mean = float(nll.mean(dtype=np.float64))
    ppl = math.exp(mean)
    var = float((nll.astype(np.float64) ** 2).mean()) - mean * mean
    return ppl, (ppl * math.sqrt(var / (n - 1)) if n > 1 and var > 0 else 0.0)


class ReferenceLogprobs:
    """The reference's log-probabilities at every scored position, in a temporary file (not in memory)."""

    def __init__(self, n_positions: int, vocab: int):
        self._file = tempfile.TemporaryFile(prefix="glmcore-ppl-ref-")
        self.rows = np.memmap(self._file, dtype=np.float32, mode="w+", shape=(max(n_positions, 1), vocab))

    def close(self) -> None:
        del self.rows
        self._file.close()


@dataclass
class Result:
    label: str
    fmt: str
    nll: np.ndarray                    # per scored token
    kl: np.ndarray | None = None       # per scored token, vs the reference
    top1: np.ndarray | None = None     # per scored token: same argmax as the reference
    seconds: float = 0.0
    tokens_fed: int = 0

    @property
    def ppl(self) -> tuple[float, float]:
        return ppl_and_error(self.nll)


class Progress:
    """A progress bar with the running estimate on stderr (one line per update when not a terminal)."""

    def __init__(self, label: str, total: int, stream=None, enabled: bool = True):
        self.label, self.total, self.stream, self.enabled = label, total, stream or sys.stderr, enabled
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()

    def update(self, done: int, nll: np.ndarray, tokens_fed: int) -> None:
        if not self.enabled:
            return
        ppl, err = ppl_and_error(nll)
        fill = int(20 * done / max(self.total, 1))
        rate = tokens_fed / max(time.perf_counter() - self.t0, 1e-9)
        line = (f"[{self.label}] [{'#' * fill}{'.' * (20 - fill)}] {done}/{self.total} chunks | "
                f"PPL {ppl:.4f} +/- {err:.5f} | {rate:.1f} tok/s")
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        if self.tty and done == self.total:
            self.stream.write("\n")
        self.stream.flush()


def measure(model, spec: Spec, text: str, ctx: int, stride: int | None = None, chunks: int | None = None,
            slots: int = 4, threads: int | None = None, reference: ReferenceLogprobs | None = None,
            keep: bool = False, show_progress: bool = True) -> tuple[Result, ReferenceLogprobs | None]:
    """Perplexity of `text` on one backend. `reference`: compare with those log-probs (KL, top-1).
    `keep`: keep this run's log-probs as the reference (returned) and compare with them as well."""
    from ..chat import chat_format_for
    from ..gguf import is_gguf
    from ..model import demo_model_dir, load_model, open_checkpoint
    from ..tokenizer import load_tokenizer
    fmt = spec.format(ctx)
    model = Path(model) if model else demo_model_dir()
    if not (model / "config.json").is_file() and not is_gguf(model):
        raise GlmcoreError(f"--model {str(model)!r} is not a checkpoint directory (no config.json) or a .gguf file")
    ckpt = open_checkpoint(model)
    config = ckpt.config
    if ctx > config.max_seq_len:
        raise GlmcoreError(f"--ctx {ctx} is longer than the model's context of {config.max_seq_len} tokens; use "
                           f"--ctx {config.max_seq_len} or less")
    tok = load_tokenizer(ckpt.tokenizer_dir, config.family)
    prefix = list(chat_format_for(tok).prefix)     # [gMASK]sop: what the GLM models expect first
    tokens = tok.encode(text)
    wins = windows(len(tokens), ctx, stride, chunks, n_prefix=len(prefix))    # checked before the load
    m = load_model(model, spec.backend, spec.options(ctx, threads), slots=slots)
    try:
        batch = m.scheduler.batch
        n_scored = sum(ctx - 1 - first for _, first in wins)
        record = ReferenceLogprobs(n_scored, m.config.vocab_size) if keep else None
        reference = record if record is not None else reference
        nll, kl, top1 = [], [], []
        row = fed = 0
        label = spec.backend + (f" {fmt}" if fmt else "")
        bar = Progress(label, len(wins), enabled=show_progress)
        t0 = time.perf_counter()
        for g in range(0, len(wins), batch.n_slots):
            group = wins[g:g + batch.n_slots]
            jobs = []
            for slot, (start, first) in enumerate(group):
                w = tokens[start:start + ctx]
                w[:len(prefix)] = prefix           # the model's prefix in place of the first tokens (llama.cpp: BOS)
                batch.reset(slot)
                jobs.append((slot, w[:-1], first))
                fed += len(w) - 1
            for (start, first), logits in zip(group, run_slots(batch, jobs)):
                targets = np.asarray(tokens[start + first + 1:start + ctx])
                lp = log_softmax(logits)
                nll.append(-lp[np.arange(len(targets)), targets].astype(np.float64))
                rows = slice(row, row + len(targets))
                if record is not None:
                    record.rows[rows] = lp
                if reference is not None:
                    ref = np.asarray(reference.rows[rows])
                    kl.append((np.exp(ref.astype(np.float64)) * (ref - lp)).sum(axis=-1))
                    top1.append(ref.argmax(axis=-1) == lp.argmax(axis=-1))
                row += len(targets)
            bar.update(min(g + batch.n_slots, len(wins)), np.concatenate(nll), fed)
        result = Result(spec.backend, fmt, np.concatenate(nll), np.concatenate(kl) if kl else None,
                        np.concatenate(top1) if top1 else None, time.perf_counter() - t0, fed)
        return result, record
    finally:
        m.close()


def final_line(r: Result, ctx: int) -> str:
    ppl, err = r.ppl
    return (f"Final estimate: PPL = {ppl:.4f} +/- {err:.5f} over {len(r.nll)} tokens "
            f"({r.label} {r.fmt}, ctx {ctx}; {r.tokens_fed / max(r.seconds, 1e-9):.1f} tok/s evaluated)")


def table_header(reference: Result) -> str:
    return (f"| backend | format | perplexity | Δ vs {reference.label} | KL mean | KL p99 | top-1 agreement |\n"
            "|---|---|---:|---:|---:|---:|---:|")


def table_row(r: Result, reference: Result) -> str:
    """One row: backend, format, perplexity +- error, delta vs the reference, KL mean/p99, top-1 agreement."""
    ppl, err = r.ppl
    ref_ppl = reference.ppl[0]
    delta = ppl - ref_ppl
    kl_mean = float(r.kl.mean()) if r.kl is not None else float("nan")
    kl_p99 = float(np.percentile(r.kl, 99)) if r.kl is not None else float("nan")
    top1 = float(r.top1.mean()) if r.top1 is not None else float("nan")
    return (f"| {r.label} | {r.fmt} | {ppl:.4f} ± {err:.4f} | {delta:+.4f} ({delta / ref_ppl:+.2%}) | "
            f"{kl_mean:.6f} | {kl_p99:.6f} | {top1:.2%} |")


def table(results: list[Result], reference: Result) -> str:
    """The Markdown table of `results` against `reference`."""
    return "\n".join([table_header(reference)] + [table_row(r, reference) for r in results])


MAX_TEXT_BYTES = 256 << 20    # wikitext-2's test split is 1.3 MB; a bound so /dev/zero is refused, not read forever


def read_text(path: str | Path) -> str:
    fix = "give a UTF-8 text file"
    text = decode_text(read_bounded(path, MAX_TEXT_BYTES, "--perplexity", fix), f"--perplexity {str(path)!r}", fix)
    if not text.strip():
        raise GlmcoreError(f"--perplexity {str(path)!r} is empty; give a text file (e.g. wikitext-2's wiki.test.raw)")
    return text
