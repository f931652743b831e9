"""lm-evaluation-harness's own API models against a live glmcore server on loopback: `local-completions` runs a
loglikelihood task (echo + logprobs, lm-eval's remote tokenizer on /tokenize) and `local-chat-completions` a
generate_until one, and both agree with `glmcore eval`'s harness model. Local task files only, no download.
lm-eval has no loglikelihood on chat completions (LocalChatCompletion.loglikelihood raises
NotImplementedError), so only generation goes through the chat endpoint."""
from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import pytest

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

lm_eval = pytest.importorskip("lm_eval", reason="needs lm-evaluation-harness (the eval extra)")
pytest.importorskip("uvicorn", reason='the server needs its extra: pip install "glmcore[server]"')

from glmcore.backend import LoadOptions  # noqa: E402
from glmcore.model import load_model  # noqa: E402
from test_server import serving  # noqa: E402

DATA = Path(__file__).parent / "data" / "eval"
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch, tmp_path):
    """Only the server on 127.0.0.1 may be reached: any other connect fails loudly."""
    connect = socket.socket.connect

    def guarded(self, address):
        if not (isinstance(address, tuple) and address[0] in ("127.0.0.1", "localhost", "::1")):
            raise AssertionError(f"network access attempted: {address}")
        return connect(self, address)
    monkeypatch.setattr(socket.socket, "connect", guarded)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.chdir(DATA)          # the task YAMLs name their JSONL files relative to this directory


@pytest.fixture(scope="module")
def served(make_tiny):
    d = make_tiny("chatglm3")
    m = load_model(d, "torch", LoadOptions(threads=1), slots=2, token_budget=64)
    with serving(m) as url:
        yield d, url
    m.close()


def evaluate(model, tasks, **kw):
    from lm_eval.tasks import TaskManager
    return lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=TaskManager(include_path=str(DATA)),
                                   log_samples=True, **kw)


def test_local_completions_loglikelihood_agrees_with_the_glmcore_harness(served):
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from glmcore.evaluate.harness import GlmcoreLM
    model_dir, url = served
    api = LocalCompletionsAPI(model="tiny", base_url=f"{url}/v1/completions", tokenizer_backend="remote",
                                         max_retries=1, num_concurrent=1)
    got = evaluate(api, ["glmcore_tiny_mc"])
    own = GlmcoreLM(model=str(model_dir), backend="torch", threads=1, slots=2)
    try:
        ref = evaluate(own, ["glmcore_tiny_mc"])
        samples = got["samples"]["glmcore_tiny_mc"]
        assert len(samples) == 8
        for s in samples:
            # lm-eval's remote tokenizer encodes without special tokens and sends ids: the server's echoed
            # logprobs score them as glmcore's own scorer scores the same ids
            pairs = [api._encode_pair(c, x) for c, x in s["arguments"]]
            want = own._loglikelihood_tokens([(None, c, x) for c, x in pairs], disable_tqdm=True)
            np.testing.assert_allclose([r[0][0] for r in s["resps"]], [w[0] for w in want], atol=1e-3)
            assert [bool(r[0][1]) for r in s["resps"]] == [w[1] for w in want]
        # the task's accuracy, over contexts that differ only by the [gMASK]sop prefix the served ids lack,
        # within the noise of 8 questions
        a, b = got["results"]["glmcore_tiny_mc"], ref["results"]["glmcore_tiny_mc"]
        noise = 2 * max(a["acc_stderr,none"], b["acc_stderr,none"], 1 / 8)
        assert abs(a["acc,none"] - b["acc,none"]) <= noise
    finally:
        own.close()


def test_local_chat_completions_generate_until_equals_the_glmcore_harness(served):
    from glmcore.evaluate.harness import GlmcoreLM
    model_dir, url = served
    from lm_eval.models.openai_completions import LocalChatCompletion
    api = LocalChatCompletion(model="tiny", base_url=f"{url}/v1/chat/completions", max_retries=1)
    got = evaluate(api, ["glmcore_tiny_gen"], apply_chat_template=True)
    own = GlmcoreLM(model=str(model_dir), backend="torch", threads=1, slots=2)
    try:
        ref = evaluate(own, ["glmcore_tiny_gen"], apply_chat_template=True)
    finally:
        own.close()
    mine = {s["doc_id"]: s["resps"][0][0] for s in got["samples"]["glmcore_tiny_gen"]}
    theirs = {s["doc_id"]: s["resps"][0][0] for s in ref["samples"]["glmcore_tiny_gen"]}
    assert len(mine) == 4 and mine == theirs
    assert got["results"]["glmcore_tiny_gen"]["exact_match,none"] == ref["results"]["glmcore_tiny_gen"][
        "exact_match,none"]
