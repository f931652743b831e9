"""The model-loading options every command shares (glmcore run/chat/serve, eval, conformance, bench):
their argparse group and their LoadOptions."""
from __future__ import annotations

import argparse
import json
import os

from .backend import LoadOptions
from .errors import GlmcoreError


def parse_opts(pairs: list[str]) -> dict:
    """--opt KEY=VALUE pairs as LoadOptions.extra (JSON values where they parse, else strings)."""
    out = {}
    for p in pairs or []:
        if "=" not in p:
            raise GlmcoreError(f"--opt {p!r}: expected KEY=VALUE, e.g. --opt group_size=128")
        k, v = p.split("=", 1)
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


def add_load_args(p: argparse.ArgumentParser, model_help: str = "checkpoint directory or .gguf file (default: "
                  "the built-in demo model)") -> None:
    p.add_argument("--backend", help="backend name (default: the best ready one; see `glmcore backends`)")
    p.add_argument("--model", help=model_help)
    p.add_argument("--precision", help="compute precision the backend offers: f32, bf16, f16")
    p.add_argument("--weights", help="weight format the backend offers: f32, f16, int8, int4 ...")
    p.add_argument("--ctx", type=int, help="context length (KV slots); default min(model, backend, 4096)")
    p.add_argument("--threads", type=int, help="CPU threads (default: the backend's choice)")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="backend-specific option, e.g. group_size=128, seq_len=512, mode=eager")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallel: split the model over N ranks started here (torch, ascend_npu); "
                        "under torchrun, the job's world size")


def load_options(a) -> LoadOptions:
    if a.ctx is not None and a.ctx < 2:
        raise GlmcoreError(f"invalid --ctx {a.ctx}: use at least 2")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if a.threads is not None and not 1 <= a.threads <= cpus:
        raise GlmcoreError(f"invalid --threads {a.threads}: this machine lets glmcore run on {cpus} CPUs; "
                           f"use 1..{cpus}")
    if a.tp < 1:
        raise GlmcoreError(f"invalid --tp {a.tp}: use a positive number of ranks")
    return LoadOptions(a.precision, a.weights, a.ctx, a.threads, extra=parse_opts(a.opt), tp=a.tp)
