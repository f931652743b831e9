"""glmcore eval: perplexity as llama-perplexity computes it, the cross-backend KL/top-1 table, and the
lm-evaluation-harness model "glmcore" run end to end on local tasks (no download, no network)."""
from __future__ import annotations

import math
import os
import re
import socket
from pathlib import Path

import numpy as np
import pytest

# The harness and `datasets` read these at import: local files only, caches in a temporary place.
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

from glmcore.backend import LoadOptions, registry            # noqa: E402
from glmcore.cli import main                                 # noqa: E402
from glmcore.config import ModelConfig                       # noqa: E402
from glmcore.evaluate import Spec, measure, ppl_and_error, windows   # noqa: E402
from glmcore.errors import GlmcoreError                      # noqa: E402
from glmcore.weights import load_weights                     # noqa: E402

DATA = Path(__file__).parent / "data" / "eval"
TEXT = (Path(__file__).resolve().parents[1] / "glmcore" / "data" / "corpus.txt").read_text(encoding="utf-8")[:6000]
F32 = 1e-2     # conformance/tolerances.py's f32 max|d| on logits: log-probs move by at most twice that


@pytest.fixture(autouse=True)
def no_network(monkeypatch, tmp_path):
    """Nothing here may contact the network: every connect fails loudly."""
    def refuse(*a, **k):
        raise AssertionError(f"network access attempted: {a[1:] if len(a) > 1 else a}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))


@pytest.fixture(scope="module")
def tiny(make_tiny):
    return make_tiny("chatglm3")


def reference_logprobs(model_dir, ids: list[int], backend: str = "torch", **extra) -> np.ndarray:
    """Log-probabilities [len(ids), vocab] from one plain single-sequence Session: the direct computation."""
    cfg = ModelConfig.from_dir(model_dir)
    b = registry().get(backend)
    s = b.load(cfg, load_weights(model_dir, cfg), b.resolve(LoadOptions(capacity=max(len(ids), 16), threads=1,
                                                                         extra=extra)))
    logits = np.asarray(s.prefill(ids, all_logits=True), dtype=np.float64)
    s.close()
    return logits - logits.max(-1, keepdims=True) - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                                                                                                  keepdims=True))


# ---------------------------------------------------------------------------------------------- perplexity


def test_windows_as_llama_perplexity():
    # chunks of ctx tokens, n_tokens // ctx of them, scored from ctx/2
    assert windows(1000, 100) == [(i * 100, 50) for i in range(10)]
    assert windows(1000, 100, chunks=3) == [(0, 50), (100, 50), (200, 50)]
    # sliding: (n - ctx + stride - 1) // stride windows, the last `stride` positions scored
    assert windows(10, 4, stride=1, n_prefix=1) == [(i, 2) for i in range(6)]
    assert windows(1000, 100, stride=30) == [(i * 30, 69) for i in range((1000 - 100 + 29) // 30)]
    with pytest.raises(GlmcoreError, match="at least 200"):
        windows(150, 100)
    with pytest.raises(GlmcoreError, match="--stride"):
        windows(1000, 100, stride=98)
    with pytest.raises(GlmcoreError, match="too small"):
        windows(1000, 4)


def test_error_estimate_is_llama_cpp_formula():
    nll = np.array([1.0, 2.0, 4.0, 3.0])
    ppl, err = ppl_and_error(nll)
    mean = nll.mean()
    assert ppl == pytest.approx(math.exp(mean))
    assert err == pytest.approx(ppl * math.sqrt(((nll ** 2).mean() - mean ** 2) / 3))


@pytest.mark.parametrize("stride", [None, 5])
def test_perplexity_equals_reference_by_hand(tiny, stride):
    from glmcore.chat import chat_format_for
    from glmcore.tokenizer import load_tokenizer
    ctx = 24
    result, _ = measure(tiny, Spec("torch"), TEXT, ctx=ctx, stride=stride, chunks=7, slots=3, threads=1,
                        show_progress=False)
    tok = load_tokenizer(tiny, "chatglm3")
    tokens, prefix = tok.encode(TEXT), chat_format_for(tok).prefix
    nll = []
    for i in range(7):       # by hand: each window in its own session, the prefix in place of its first tokens
        start = i * (stride or ctx)
        w = prefix + tokens[start + 2:start + ctx]
        lp = reference_logprobs(tiny, w[:-1])
        first = ctx - stride - 1 if stride else ctx // 2
        nll += [-lp[j, w[j + 1]] for j in range(first, ctx - 1)]
    nll = np.array(nll)
    assert len(result.nll) == len(nll) == 7 * (stride or ctx - 1 - ctx // 2)
    np.testing.assert_allclose(result.nll, nll, atol=2 * F32)
    ppl, err = result.ppl
    assert ppl == pytest.approx(math.exp(nll.mean()), rel=2 * F32)
    assert err == pytest.approx(ppl_and_error(nll)[1], rel=0.05)


def test_kl_and_top1_zero_between_torch_and_itself(tiny):
    common = dict(ctx=32, chunks=6, slots=2, threads=1, show_progress=False)
    ref, store = measure(tiny, Spec("torch"), TEXT, keep=True, **common)
    try:
        again, _ = measure(tiny, Spec("torch"), TEXT, reference=store, **common)     # a second, separate load
        int4, _ = measure(tiny, Spec.parse("cpu_int4:g32"), TEXT, reference=store, **common)
    finally:
        store.close()
    for r in (ref, again):
        assert len(r.kl) == len(r.nll) == 6 * 15
        assert np.abs(r.kl).max() < 1e-9 and r.top1.all()
    np.testing.assert_allclose(again.nll, ref.nll, atol=1e-5)
    # the same columns do see quantization: int4 on these sensitive models is visibly lossy
    assert int4.kl.mean() > 1e-3 and not int4.top1.all() and int4.top1.mean() > 0.1


def test_spec_variants():
    assert Spec.parse("cpu_int4:g128") == Spec("cpu_int4", extra={"group_size": 128})
    assert Spec.parse("openvino_amx:int4:f32") == Spec("openvino_amx", "f32", "int4")
    assert Spec.parse("tpu_bm1684x:f16").format(64) == "f16/f16"
    assert Spec.parse("cpu_int4:g128").format() == "f32/int4 g128"
    with pytest.raises(GlmcoreError, match="unknown variant 'int9'"):
        Spec.parse("cpu_int4:int9")


def test_cli_perplexity_and_table(tiny, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    args = ["eval", "--model", str(tiny), "--perplexity", str(text), "--ctx", "32", "--chunks", "4", "--threads", "1"]
    assert main(args + ["--backend", "torch"]) == 0
    out, err = capsys.readouterr()
    assert re.search(r"Final estimate: PPL = [\d.]+ \+/- [\d.]+ over 60 tokens \(torch f32/f32, ctx 32", out)
    assert "4/4 chunks" in err and "PPL" in err          # the progress bar with the running estimate
    assert main(args + ["--backends", "torch,cpu_int4:g32,cpu_int4:g128"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [c.strip() for c in rows[0]] == ["backend", "format", "perplexity", "Δ vs torch", "KL mean", "KL p99",
                                            "top-1 agreement"]
    body = {(r[0].strip(), r[1].strip()): [c.strip() for c in r[2:]] for r in rows[1:]}
    assert list(body) == [("torch", "f32/f32"), ("cpu_int4", "f32/int4 g32"), ("cpu_int4", "f32/int4 g128")]
    assert body[("torch", "f32/f32")][1:] == ["+0.0000 (+0.00%)", "0.000000", "0.000000", "100.00%"]
    assert " ± " in body[("cpu_int4", "f32/int4 g128")][0]


@pytest.mark.parametrize("extra, message", [
    (["--backends", "torch", "--weights", "int4"], "give each backend's variant in the list"),
    (["--backends", "cpu_int4:int9"], "unknown variant"),
    (["--backend", "torch", "--ctx", "4096"], "needs at least 8192"),
    (["--backend", "torch", "--stride", "40"], "--stride 40"),
    (["--backend", "torch", "--tp", "2"], "drop --tp"),
    (["--backend", "torch", "--slots", "0"], "invalid --slots 0"),
])
def test_cli_errors(tiny, tmp_path, capsys, extra, message):
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    assert main(["eval", "--model", str(tiny), "--perplexity", str(text), "--ctx", "32", *extra]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last and "Traceback" not in err


# ---------------------------------------------------------------------------------------------- harness


def test_importing_registers_the_harness_model():
    import glmcore.evaluate  # noqa: F401
    from lm_eval.api.registry import get_model

    from glmcore.evaluate.harness import GlmcoreLM
    assert get_model("glmcore") is GlmcoreLM


@pytest.mark.parametrize("family", ["chatglm2", "chatglm3", "glm4", "glm4-0414", "glm-edge"])
def test_chat_text_encodes_to_the_chat_format_ids(make_tiny, family):
    from glmcore.chat import chat_format_for
    from glmcore.evaluate.harness import ChatText
    from glmcore.tokenizer import load_tokenizer
    tok = load_tokenizer(make_tiny(family), family)
    fmt = chat_format_for(tok)
    text = ChatText(tok, fmt)
    conversations = [
        [{"role": "user", "content": "Question: 2+2?\nAnswer:"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"},
         {"role": "assistant", "content": "hello"}, {"role": "user", "content": "one\ntwo"}],
    ]
    for msgs in conversations:
        assert text.encode(text.render(msgs)) == fmt.encode_messages(msgs)
    # a harness gen_prefix: the assistant turn is open and the continuation extends it
    msgs = conversations[0] + [{"role": "assistant", "content": "Answer:"}]
    assert text.encode(text.render(msgs, add_generation_prompt=False)) == fmt.encode_messages(
        msgs, add_generation_prompt=False)
    # plain text gets the model's prefix, and only a rendered chat is read for role tokens
    assert text.encode("a <|user|> b") == fmt.prefix + tok.encode("a <|user|> b")
    assert text.encode("ab", prefix=False) == tok.encode("ab")


def _evaluate(model, tasks, monkeypatch, **kw):
    import lm_eval
    from lm_eval.tasks import TaskManager
    monkeypatch.chdir(DATA)          # the task YAMLs name their JSONL files relative to this directory
    return lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=TaskManager(include_path=str(DATA)),
                                   log_samples=True, **kw)


def _direct_loglikelihood(model_dir, context: str, continuation: str, backend="torch", **extra):
    """log p(continuation | context) through a plain Session, the pair encoded as the harness does."""
    from glmcore.chat import chat_format_for
    from glmcore.tokenizer import load_tokenizer
    tok = load_tokenizer(model_dir, ModelConfig.from_dir(model_dir).family)
    prefix = chat_format_for(tok).prefix
    whole, ctx = prefix + tok.encode(context + continuation), prefix + tok.encode(context)
    lp = reference_logprobs(model_dir, whole, backend, **extra)
    cont = whole[len(ctx):]
    rows = lp[len(ctx) - 1:len(whole) - 1]
    return rows[np.arange(len(cont)), cont].sum(), bool((rows.argmax(-1) == cont).all())


def _check_mc(results, model_dir, tol, backend="torch", **extra):
    samples = results["samples"]["glmcore_tiny_mc"]
    assert len(samples) == 8
    correct = []
    for s in samples:
        direct = [_direct_loglikelihood(model_dir, c, x, backend, **extra) for c, x in s["arguments"]]
        got = [r[0] for r in s["resps"]]
        n_tokens = max(len(x) for _, x in s["arguments"])     # loose upper bound of tokens per continuation
        np.testing.assert_allclose([g[0] for g in got], [d[0] for d in direct], atol=tol * n_tokens)
        assert [bool(g[1]) for g in got] == [d[1] for d in direct]
        correct.append(int(np.argmax([d[0] for d in direct])) == s["target"])
    assert results["results"]["glmcore_tiny_mc"]["acc,none"] == pytest.approx(np.mean(correct))


def test_harness_multiple_choice_by_name_on_torch(tiny, monkeypatch):
    r = _evaluate("glmcore", ["glmcore_tiny_mc"], monkeypatch, model_args=f"model={tiny},backend=torch,threads=1,slots=3")
    _check_mc(r, tiny, 2 * F32)


def test_harness_multiple_choice_on_cpu_int4_with_prefix_reuse(tiny, monkeypatch):
    from glmcore.evaluate.harness import GlmcoreLM
    lm = GlmcoreLM(model=str(tiny), backend="cpu_int4", threads=1, slots=3, group_size=32)
    batch = lm.m.scheduler.batch
    fed, step = [], batch.step
    monkeypatch.setattr(batch, "step", lambda entries, all_logits=False: fed.extend(
        len(ids) for _, ids in entries) or step(entries, all_logits))
    r = _evaluate(lm, ["glmcore_tiny_mc"], monkeypatch)
    # against cpu_int4's own plain Session: batching and prefix copies change nothing beyond f32 rounding
    _check_mc(r, tiny, 2 * F32, backend="cpu_int4", group_size=32)
    # each context was prefilled once, not once per choice
    whole = sum(len(lm.tok_encode(c + x)) - 1 for s in r["samples"]["glmcore_tiny_mc"] for c, x in s["arguments"])
    assert lm.m.scheduler.native and sum(fed) < 0.7 * whole
    lm.close()


def _greedy(model_dir, prompt_ids, max_new, stop_ids, n_vocab):
    """Greedy generation through a plain Session (ids past the tokenizer's are never picked, as the core samples)."""
    cfg = ModelConfig.from_dir(model_dir)
    b = registry().get("torch")
    s = b.load(cfg, load_weights(model_dir, cfg), b.resolve(LoadOptions(capacity=256, threads=1)))
    out, logits = [], s.prefill(prompt_ids)
    while len(out) < max_new:
        t = int(np.argmax(logits[:n_vocab]))
        if t in stop_ids:
            break
        out.append(t)
        logits = s.decode(t)
    s.close()
    return out


def test_harness_generation_and_rolling_on_torch(tiny, monkeypatch):
    from glmcore.chat import chat_format_for
    from glmcore.tokenizer import load_tokenizer
    r = _evaluate("glmcore", ["glmcore_tiny_gen", "glmcore_tiny_rolling"], monkeypatch,
                  model_args=f"model={tiny},backend=torch,threads=1,slots=2,ctx=40")
    tok = load_tokenizer(tiny, "chatglm3")
    fmt = chat_format_for(tok)
    gen = r["samples"]["glmcore_tiny_gen"]
    assert len(gen) == 4
    for s in gen:
        (context, kwargs), = s["arguments"]
        ids = _greedy(tiny, fmt.prefix + tok.encode(context), kwargs["max_gen_toks"], fmt.stop_ids, tok.n_vocab)
        assert s["resps"][0][0] == tok.decode(ids).split("\n")[0]
    assert "exact_match,none" in r["results"]["glmcore_tiny_gen"]
    # rolling: with ctx 40 the texts need several windows; every token is predicted exactly once
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
    for s in r["samples"]["glmcore_tiny_rolling"]:
        (text,), = s["arguments"]
        tokens = tok.encode(text)
        pieces = list(map(make_disjoint_window, get_rolling_token_windows(tokens, -1, 40 - 1, 1)))
        assert len(pieces) > 1
        total = 0.0
        for ctx, cont in pieces:
            ids = (fmt.prefix + ctx[1:] if ctx[0] == -1 else ctx) + cont
            lp = reference_logprobs(tiny, ids)
            n = len(ids) - len(cont)
            total += sum(lp[n - 1 + j, t] for j, t in enumerate(cont))
        assert s["resps"][0][0] == pytest.approx(total, abs=2 * F32 * len(tokens))


def test_harness_chat_template_generation(tiny, monkeypatch):
    """--apply_chat_template: the prompt is the family's chat format, generation stops on its stop ids."""
    from glmcore.chat import chat_format_for
    from glmcore.tokenizer import load_tokenizer
    r = _evaluate("glmcore", ["glmcore_tiny_gen"], monkeypatch, limit=2, apply_chat_template=True,
                  model_args=f"model={tiny},backend=torch,threads=1,slots=2")
    tok = load_tokenizer(tiny, "chatglm3")
    fmt = chat_format_for(tok)
    for s in r["samples"]["glmcore_tiny_gen"]:
        (context, kwargs), = s["arguments"]
        assert context.startswith("[gMASK]sop<|user|>") and context.endswith("<|assistant|>")
        doc = s["doc"]
        ids = fmt.encode_messages([{"role": "user", "content": doc["prompt"]}])
        out = _greedy(tiny, ids, kwargs["max_gen_toks"], fmt.stop_ids, tok.n_vocab)
        assert s["resps"][0][0] == tok.decode(out).split("\n")[0]


def test_cli_tasks_pass_harness_options_through(tiny, monkeypatch, capsys):
    monkeypatch.chdir(DATA)
    assert main(["eval", "--model", str(tiny), "--backend", "torch", "--threads", "1", "--tasks", "glmcore_tiny_mc",
                 "--include_path", str(DATA), "--limit", "3"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "glmcore_tiny_mc" in line)
    assert "acc" in row and "limit: 3.0" in out
