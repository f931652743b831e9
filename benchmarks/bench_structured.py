"""What constrained decoding costs: the masking cost per token per request at GLM-4's 151,552 ids, and the
aggregate decode speed of 16 constrained requests beside 16 unconstrained ones on one backend.

    python benchmarks/bench_structured.py [--backend cpu_int4] [--size 1b] [--threads 16] [--gen 64]
    python benchmarks/bench_structured.py --size tiny --threads 1          # CI smoke size
    python benchmarks/bench_structured.py --tool-call --vocab glm45 --size tiny --backend torch

1. Masking: a JSON Schema with nested objects, bounded strings, enums, integer ranges and arrays, walked by
   seeded random generation (random logits, masked, sampled); each step times what the scheduler does per
   constrained request -- the grammar's bitmask (llguidance), its expansion and the masked copy of the
   logits row (numpy) -- alone and for a batch of 16 (llguidance's executor). The tokenizer is GLM-4's real
   one when shared/models/glm-4-9b-chat is present (--tokenizer DIR), else the model's own padded to 151,552.
2. Throughput: 16 greedy requests of `--gen` tokens each through the scheduler, all constrained (an array
   of objects that cannot close within --gen tokens, so both sides generate the same number of tokens) or
   none, alternating round by round on one loaded model; medians and their ratio are printed.
   --tool-call: tool_choice "required" with a strict tool, in a glm4-moe checkpoint's XML call format;
   --vocab glm45 gives that checkpoint GLM-4.5's real tokenizer (GLM-4's 151,329 ranks from
   shared/models/glm-4-9b-chat + GLM-4.5's specials, 151,552 logits), where the grammar's mask costs most.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from glmcore import structured
from glmcore.backend import LoadOptions
from glmcore.model import load_model
from glmcore.sampling import Sampler, SamplingParams
from glmcore.scheduler import Request
from glmcore.chat import as_message
from glmcore.structured import Grammar, compile_grammar, mask_rows, reply_constraint, token_table
from glmcore.synth import cached_model
from glmcore.tokenizer import load_tokenizer
from glmcore_conformance.bench import model_dir_for

GLM4_LOGITS = 151552
REAL_GLM4 = Path(__file__).resolve().parents[2] / "shared" / "models" / "glm-4-9b-chat"
ITEM = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "kind": {"enum": ["person", "robot", "animal"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
    "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                              "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
             "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "kind", "tags", "home"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": ITEM, "minItems": 1, "maxItems": 4}},
          "required": ["items"], "additionalProperties": False}
# greedy: the figures compare the model's steps with and without masking, not the sampler's nucleus over a
# random-weight model's flat distribution (which masking shrinks, flattering the constrained side)
GREEDY = SamplingParams(temperature=0)
ENDLESS = {"type": "array", "items": ITEM, "minItems": 5000}     # never complete within --gen tokens (under the
# server's repetition limit, glmcore.structured.MAX_REPEAT)


def masking(tokenizer, n_logits: int, steps: int, batch: int, seed: int = 0) -> tuple[list[float], list[float]]:
    """Per request-token seconds of mask_rows: one request at a time, and a batch (per request)."""
    constraint = compile_grammar(tokenizer, Grammar.json_schema(SCHEMA), n_logits, leading_space=False)
    rng = np.random.default_rng(seed)
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=1.0, seed=seed), tokenizer.n_vocab)
    stops = [tokenizer.eos_id]
    executor = structured.executor()

    def walk(matchers, timings, per):
        for _ in range(steps):
            live = [m for m in matchers if not m.stopped]
            if not live:
                return
            rows = [(rng.standard_normal(n_logits) * 4).astype(np.float32) for _ in live]
            t = time.perf_counter()
            masked, alive = mask_rows(live, rows, [stops] * len(live), [True] * len(live), executor)
            timings.append((time.perf_counter() - t) / per(len(live)))
            for m, row, ok in zip(live, masked, alive):
                token = sampler(row) if ok else tokenizer.eos_id
                if token == tokenizer.eos_id or m.advance(token) is not None:
                    m.ll.consume_token(tokenizer.eos_id)      # done: stop this walk

    alone: list[float] = []
    while len(alone) < steps:
        walk([constraint.start()], alone, lambda n: 1)
    together: list[float] = []
    while len(together) < max(8, steps // batch):
        walk([constraint.start() for _ in range(batch)], together, lambda n: n)
    return alone, together


# --tool-call: tool_choice "required" with a strict tool whose argument is the endless array, so the reply is a
# call in the checkpoint's own format (GLM-4.5+'s XML) that cannot close within --gen tokens either
TOOLS = [{"type": "function", "function": {"name": "record", "strict": True, "parameters": {
    "type": "object", "properties": {"items": ENDLESS}, "required": ["items"]}}}]


@dataclass
class Speed:
    """Aggregate generated tok/s of one round: overall (prefills included), and while every request decodes
    (from the last request's first token on: the steps the grammar's mask is paid in, without the prompts'
    prefill, which is the same work on both sides)."""
    overall: float
    decoding: float


def throughput(model, n: int, gen: int, constrained: bool, tool_call: bool = False) -> Speed:
    """n requests of gen tokens each, all constrained or none."""
    sched, tok = model.scheduler, model.tokenizer
    sched.forget()
    if tool_call:
        fmt = model.chat_format
        opening, constraint = reply_constraint(fmt, model.config.vocab_size, None, TOOLS, must_call=["record"])
        if not constrained:       # the same prompt, no grammar at all (a strict tool alone would constrain)
            opening, constraint = [], None
        prompts = [fmt.encode_messages([as_message({"role": "user", "content": f"record {i}"})], TOOLS) + opening
                   for i in range(n)]
    else:
        constraint = (compile_grammar(tok, Grammar.json_schema(ENDLESS), model.config.vocab_size)
                      if constrained else None)
        prefix = [tok.special_ids["[gMASK]"], tok.special_ids.get("<sop>", tok.special_ids.get("sop"))]
        prompts = [prefix + tok.encode(f"record {i}:") for i in range(n)]
    times: dict[int, list[float]] = {}       # request -> when each of its tokens came

    def seen(handle, token) -> None:
        if token is not None:
            times.setdefault(id(handle), []).append(time.perf_counter())

    start = time.perf_counter()
    handles = [sched.submit(Request(p, GREEDY, gen, (), constraint=constraint), seen) for p in prompts]
    sched.run()
    end = time.perf_counter()
    bad = [h for h in handles if h.error is not None]
    if bad:
        raise SystemExit(f"a request failed: {bad[0].error}")
    made = sum(len(h.tokens) for h in handles)
    all_decoding = max(ts[0] for ts in times.values())
    after = sum(t > all_decoding for ts in times.values() for t in ts)
    return Speed(made / (end - start), after / (end - all_decoding) if end > all_decoding else 0.0)


def compare_libraries(steps: int) -> None:
    """llguidance beside xgrammar on both tokenizer kinds (SentencePiece with byte fallback: ChatGLM3; tiktoken:
    GLM-4): grammar compile time, and mask time over the same kind of seeded random walk (--compare)."""
    try:
        import xgrammar as xgr      # its bitmasks are torch tensors: it needs torch too
    except ImportError:
        raise SystemExit("--compare needs xgrammar and torch: pip install xgrammar") from None
    import json
    shared = REAL_GLM4.parent
    for family, name, n_logits in (("chatglm3", "chatglm3-6b", 65024), ("glm4", "glm-4-9b-chat", GLM4_LOGITS)):
        if not (shared / name / "tokenizer.model").is_file():
            print(f"{family}: {shared / name} not found, skipped")
            continue
        tok = load_tokenizer(shared / name, family)
        t = time.perf_counter()
        token_table(tok, n_logits)            # once per tokenizer (as xgrammar's TokenizerInfo): timed apart
        table_s = time.perf_counter() - t
        t = time.perf_counter()
        constraint = compile_grammar(tok, Grammar.json_schema(SCHEMA), n_logits, leading_space=False)
        compile_s = time.perf_counter() - t
        llg_times: list[float] = []
        xgr_times: list[float] = []
        # xgrammar reads a RAW byte vocabulary: special tokens and padded ids must be blanked or it treats
        # "[gMASK]", "<|user|>" as literal text
        vocab = [b"" if tok.is_special(i) else tok.token_bytes(i) for i in range(tok.n_vocab)]
        vocab += [b""] * (n_logits - len(vocab))
        t = time.perf_counter()
        info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=n_logits, stop_token_ids=[tok.eos_id])
        compiler = xgr.GrammarCompiler(info)
        info_s = time.perf_counter() - t
        t = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        xgr_compile_s = time.perf_counter() - t
        for seed in range(20):
            for lib, times in (("llg", llg_times), ("xgr", xgr_times)):
                rng = np.random.default_rng(seed)
                m = constraint.start() if lib == "llg" else xgr.GrammarMatcher(compiled)
                words = (np.zeros(constraint.table.words, np.int32) if lib == "llg"
                         else xgr.allocate_token_bitmask(1, n_logits))
                for _ in range(steps // 20):
                    if (m.stopped if lib == "llg" else m.is_terminated()):
                        break
                    t = time.perf_counter()
                    m.fill(words) if lib == "llg" else m.fill_next_token_bitmask(words)
                    times.append(time.perf_counter() - t)
                    raw = words if lib == "llg" else words.numpy()[0]
                    ok = np.flatnonzero(np.unpackbits(raw.view(np.uint8), bitorder="little")[:n_logits])
                    ok = ok[ok != tok.eos_id] if (ok != tok.eos_id).any() else ok
                    token = int(rng.choice(ok))
                    m.advance(token) if lib == "llg" else m.accept_token(token)
        print(f"{family} ({tok.n_vocab} ids, {n_logits} logits): llguidance table {table_s * 1e3:.0f} ms, compile "
              f"{compile_s * 1e3:.1f} ms, mask median {ms(llg_times, 50):.3f} ms p99 {ms(llg_times, 99):.2f} ms | "
              f"xgrammar tokenizer info {info_s * 1e3:.0f} ms, compile {xgr_compile_s * 1e3:.0f} ms, "
              f"mask median {ms(xgr_times, 50):.3f} ms p99 {ms(xgr_times, 99):.2f} ms")


def ms(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1e3


def glm45_model(a):
    """The glm4-moe checkpoint of a.size with GLM-4.5's tokenizer (made once, in the cache), and that tokenizer."""
    if a.model or a.tokenizer:
        raise SystemExit("--vocab glm45 makes its own checkpoint and tokenizer: drop --model/--tokenizer")
    if a.size not in ("tiny", "small"):
        raise SystemExit(f"--vocab glm45 makes a glm4-moe of --size tiny or small, not {a.size}")
    if not (REAL_GLM4 / "tokenizer.model").is_file():
        raise SystemExit(f"--vocab glm45 needs GLM-4's tokenizer.model in {REAL_GLM4} (its BPE ranks are "
                         "GLM-4.5's)")
    model_dir = cached_model("glm4-moe", a.size, 0, "bench", tokenizer_from=REAL_GLM4)
    return model_dir, load_tokenizer(model_dir, "glm4-moe")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu_int4")
    ap.add_argument("--model", help="a checkpoint directory (default: the synthetic glm4 of --size)")
    ap.add_argument("--size", default="1b", choices=["tiny", "small", "1b", "6b"])
    ap.add_argument("--tokenizer", help="a GLM-4 checkpoint directory whose tokenizer the masking part uses")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--gen", type=int, help="tokens per request (default 64; --size tiny: 8)")
    ap.add_argument("--steps", type=int, help="masking steps timed (default 2000; --size tiny: 200)")
    ap.add_argument("--rounds", type=int, help="rounds of each kind (default 3; --size tiny: 1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tool-call", action="store_true", help="throughput of tool_choice \"required\" with a strict "
                    "tool, in the checkpoint's own call format (default family: glm4-moe, XML calls)")
    ap.add_argument("--vocab", choices=["synthetic", "glm45"], default="synthetic", help="glm45: the model is a "
                    "glm4-moe of --size (tiny, small) with GLM-4.5's tokenizer built from the shared GLM-4 "
                    "tokenizer.model (151,552 logits); its tokenizer is the masking part's too")
    ap.add_argument("--compare", action="store_true", help="only compare llguidance with xgrammar (the library "
                    "choice) on the shared ChatGLM3 and GLM-4 tokenizers")
    a = ap.parse_args(argv)
    smoke = a.size == "tiny"          # CI's smoke size: short, unless asked for more
    a.gen, a.rounds = a.gen or (8 if smoke else 64), a.rounds or (1 if smoke else 3)
    a.steps = a.steps or (200 if smoke else 2000)
    if a.compare:
        return compare_libraries(a.steps)
    if a.vocab == "glm45":
        model_dir, tok = glm45_model(a)
        which = f"GLM-4.5's tokenizer ({tok.n_vocab} ids)"
    else:
        model_dir, _ = model_dir_for(a.model, a.size, family="glm4-moe" if a.tool_call else "glm4")
        tok_dir = Path(a.tokenizer) if a.tokenizer else REAL_GLM4 if (REAL_GLM4 / "tokenizer.model").is_file() else None
        tok = load_tokenizer(tok_dir or model_dir, "glm4")
        which = f"{tok_dir.name if tok_dir else 'the model'}'s tokenizer ({tok.n_vocab} ids)"
    alone, together = masking(tok, GLM4_LOGITS, a.steps, a.requests)
    print(f"masking, {which} at {GLM4_LOGITS} logits, JSON Schema of nested objects/arrays/enums/ranges:")
    print(f"| requests per step | steps | median ms/token/request | p99 ms/token/request |\n|---|---:|---:|---:|\n"
          f"| 1 | {len(alone)} | {ms(alone, 50):.3f} | {ms(alone, 99):.3f} |\n"
          f"| {a.requests} | {len(together)} | {ms(together, 50):.3f} | {ms(together, 99):.3f} |")

    model = load_model(model_dir, a.backend, LoadOptions(threads=a.threads, capacity=(1024 if a.tool_call else 64) + a.gen),
                       slots=a.requests, token_budget=max(256, 16 * a.requests))
    free, con = [], []
    throughput(model, a.requests, min(a.gen, 4), False, a.tool_call)       # warm-up (kernels, caches)
    for _ in range(a.rounds):
        free.append(throughput(model, a.requests, a.gen, False, a.tool_call))
        con.append(throughput(model, a.requests, a.gen, True, a.tool_call))
    model.close()
    kind = "required strict tool call" if a.tool_call else "JSON Schema"
    print(f"\n{a.backend}, {model.config.family} {a.size if not a.model else a.model} ({model.config.vocab_size} "
          f"logits, {model.tokenizer.n_vocab}-id tokenizer), {a.requests} requests x {a.gen} tokens, {a.threads} "
          f"threads, median of {a.rounds}:")
    print("| requests | aggregate tok/s | while all decode |\n|---|---:|---:|")
    medians = {}
    for name, speeds in ((f"{a.requests} unconstrained", free), (f"{a.requests} constrained ({kind})", con)):
        medians[name] = [statistics.median(getattr(s, k) for s in speeds) for k in ("overall", "decoding")]
        print(f"| {name} | {medians[name][0]:.1f} | {medians[name][1]:.1f} |")
    (f, fd), (c, cd) = medians.values()
    print(f"constrained / unconstrained: {c / f:.2f}x overall, {cd / fd:.2f}x while all decode")


if __name__ == "__main__":
    main()
