"""`glmcore eval`: perplexity of a text file on one backend or a table across backends, or
lm-evaluation-harness tasks with the "glmcore" model (every other option goes to the harness)."""
from __future__ import annotations

import argparse
import sys
import traceback

from ..errors import GlmcoreError

EPILOG = """examples:
  glmcore eval --model DIR --backend cpu_int4 --perplexity wiki.test.raw --ctx 512
  glmcore eval --model DIR --perplexity wiki.test.raw --ctx 512 \\
      --backends torch,openvino_amx:int8,openvino_amx:int4,cpu_int4:g32,cpu_int4:g128,tpu_bm1684x:f16
  glmcore eval --model DIR --backend cpu_int4 --tasks piqa,hellaswag --num_fewshot 0 --limit 200

--backends entries are backend[:variant...]: a weight format or precision the backend offers, gN (group
size N) or KEY=VALUE (a backend option). With --tasks, every option glmcore does not know goes to the
harness (`lm-eval run --help`): --num_fewshot, --limit, --apply_chat_template, --include_path,
--output_path, --log_samples, --gen_kwargs, --seed ..."""


def build_parser() -> argparse.ArgumentParser:
    from ..options import add_load_args
    p = argparse.ArgumentParser(prog="glmcore eval", description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_load_args(p)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--perplexity", metavar="FILE", help="perplexity of this UTF-8 text file")
    what.add_argument("--tasks", help="lm-evaluation-harness tasks, comma-separated (e.g. piqa,hellaswag)")
    p.add_argument("--backends", help="perplexity on each of these (backend[:variant...], comma-separated): one "
                                      "table with KL divergence and top-1 agreement against --reference")
    p.add_argument("--reference", default="torch", help="the reference row of the --backends table (default: torch)")
    p.add_argument("--stride", type=int, help="perplexity: a sliding window moved by this many tokens, the last "
                                              "STRIDE positions of each scored (default: chunks, second half scored)")
    p.add_argument("--chunks", type=int, help="perplexity: score at most this many chunks/windows")
    p.add_argument("--slots", type=int, default=4, help="sequences evaluated at once (default: 4)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str]) -> int:
    p = build_parser()
    a, rest = p.parse_known_args(argv)
    if a.slots < 1:
        raise GlmcoreError(f"invalid --slots {a.slots}: use a positive number")
    if getattr(a, "tp", 1) != 1:
        raise GlmcoreError("glmcore eval runs the model on one rank; drop --tp")
    if a.tasks is not None:
        return run_tasks(a, rest)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    return run_perplexity(a)


def run_perplexity(a) -> int:
    from ..options import load_options
    from .perplexity import Spec, final_line, measure, parse_specs, read_text, table_header, table_row
    text = read_text(a.perplexity)
    ctx = a.ctx or 512
    if a.chunks is not None and a.chunks < 1:
        raise GlmcoreError(f"invalid --chunks {a.chunks}: use a positive number")
    opts = load_options(a)          # validates --ctx/--threads/--opt
    common = dict(ctx=ctx, stride=a.stride, chunks=a.chunks, slots=a.slots, threads=a.threads,
                  show_progress=not a.quiet)
    how = (f"sliding window of {ctx} tokens, stride {a.stride}" if a.stride else
           f"chunks of {ctx} tokens, second half scored")
    if not a.backends:
        from ..model import resolve_backend
        spec = Spec(resolve_backend(a.backend).name, opts.precision, opts.weights, opts.extra)
        print(f"perplexity of {a.perplexity}: {how}", file=sys.stderr)
        result, _ = measure(a.model, spec, text, **common)
        print(final_line(result, ctx))
        return 0
    if a.backend or a.precision or a.weights or a.opt:
        raise GlmcoreError("with --backends, give each backend's variant in the list (e.g. --backends "
                           "torch,cpu_int4:g128,openvino_amx:int4), not --backend/--precision/--weights/--opt")
    specs, ref_spec = parse_specs(a.backends), Spec.parse(a.reference)
    print(f"perplexity of {a.perplexity}: {how}; reference {a.reference}", file=sys.stderr)
    ref, store = measure(a.model, ref_spec, text, keep=True, **common)
    print(final_line(ref, ctx), file=sys.stderr)
    # the table is printed row by row as each backend finishes: a run cut short keeps the rows it has
    print(f"\nPerplexity of {a.perplexity} ({len(ref.nll)} tokens scored; {how}); KL divergence and top-1 "
          f"agreement per scored token against {ref.label} {ref.fmt}\n")
    print(table_header(ref), flush=True)
    failed = []
    try:
        for spec in specs:
            if spec == ref_spec:
                print(table_row(ref, ref), flush=True)
                continue
            try:
                r, _ = measure(a.model, spec, text, reference=store, **common)
            except Exception as e:       # one backend that cannot run (or crashes) does not lose the others' rows
                if not isinstance(e, GlmcoreError):
                    traceback.print_exc()
                failed.append(f"{spec.text}: {type(e).__name__}: {e}")
                print(f"error: {failed[-1]}", file=sys.stderr)
                continue
            print(final_line(r, ctx), file=sys.stderr)
            print(table_row(r, ref), flush=True)
    finally:
        store.close()
    for f in failed:
        print(f"\nnot measured: {f}")
    return 1 if failed else 0


def run_tasks(a, rest: list[str]) -> int:
    from . import INSTALL, register_harness_model
    if a.backends or a.stride or a.chunks:
        raise GlmcoreError("--backends, --stride and --chunks belong to --perplexity; with --tasks run one "
                           "--backend at a time")
    if not register_harness_model():
        raise GlmcoreError(f"--tasks needs the lm-evaluation-harness: {INSTALL}")
    from ..options import parse_opts
    args = {"model": a.model, "backend": a.backend, "precision": a.precision, "weights": a.weights,
            "ctx": a.ctx, "threads": a.threads, "slots": a.slots, **parse_opts(a.opt)}
    model_args = ",".join(f"{k}={v}" for k, v in args.items() if v is not None)
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging
    setup_logging()
    cli = HarnessCLI()
    # the harness's own `run` parser takes every option glmcore does not know
    ns = cli._parser.parse_args(["run", "--model", "glmcore", "--model_args", model_args, "--tasks", a.tasks, *rest])
    cli.execute(ns)
    return 0
