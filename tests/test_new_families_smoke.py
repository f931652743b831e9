"""glm4-0414 (GLM-4-0414/Z1) and glm-edge (GLM-Edge, -hf) through the commands people run: run (torch and
cpu_int4), bench (the roofline's bytes include the post norms and the tied output), eval --perplexity with the
cross-backend table, and serve through the openai client -- tiny synthetic checkpoints, tokenizer.json and the
checkpoints' own chat templates."""
import json
import re

import pytest

from glmcore.backend import LoadOptions
from glmcore.cli import main
from glmcore.model import load_model
from glmcore.pipeline import Pipeline
from glmcore.sampling import SamplingParams

FAMILIES = ["glm4-0414", "glm-edge"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", ["torch", "cpu_int4"])
def test_run(make_tiny, capsys, family, backend):
    d = make_tiny(family)
    assert main(["run", "--model", str(d), "--backend", backend, "--prompt", "你好", "--max-new-tokens", "4",
                 "--temperature", "0", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert re.search(rf"\[{backend}\] prompt \d+ tok, generated \d+ tok", err)


@pytest.mark.parametrize("family", FAMILIES)
def test_bench(make_tiny, capsys, family):
    from glmcore.config import ModelConfig
    d = make_tiny(family)
    assert main(["bench", "--backend", "torch", "--model", str(d), "--json", "--runs", "1", "--warmup", "0",
                 "--gen", "4", "--prompt-len", "8", "--threads", "1", "--no-llamacpp"]) == 0
    data = json.loads(capsys.readouterr().out)
    (r,) = data["results"]
    assert r["decode_tps"] > 0 and r["bytes_per_token"] > 0
    cfg = ModelConfig.from_dir(d)
    # what a decode step reads: every parameter (post norms included) but the embedding's unread rows -- a
    # tied embedding is the output layer, read whole for the logits
    unread = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
    assert r["bytes_per_token"] >= 4 * (cfg.num_params() - unread)


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_perplexity_table(make_tiny, tmp_path, capsys, family):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. 你好，世界！" * 8, encoding="utf-8")
    assert main(["eval", "--model", str(make_tiny(family)), "--perplexity", str(text), "--ctx", "32", "--chunks", "2",
                 "--threads", "1", "--backends", "torch,cpu_int4:g32"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    body = {r[0].strip(): [c.strip() for c in r[2:]] for r in rows[1:]}
    assert set(body) == {"torch", "cpu_int4"} and body["torch"][-1] == "100.00%"
    assert float(body["cpu_int4"][0].split()[0]) > 1


@pytest.mark.parametrize("family", FAMILIES)
def test_serve(make_tiny, family):
    openai = pytest.importorskip("openai", reason="the server tests need the dev extra (openai, httpx)")
    pytest.importorskip("uvicorn", reason='the server needs its extra: pip install "glmcore[server]"')
    from test_server import client, serving
    d = make_tiny(family)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "你好"}]
    want = Pipeline(d, backend="torch", options=LoadOptions(threads=1)).chat(
        messages, params=SamplingParams(temperature=0), max_new_tokens=6).content
    m = load_model(d, "torch", LoadOptions(threads=1), slots=2)
    try:
        with serving(m, family) as url:
            c = client(url)
            r = c.chat.completions.create(model=family, messages=messages, max_tokens=6, temperature=0)
            assert r.choices[0].message.content == want
            assert r.usage.completion_tokens <= 6 and r.choices[0].finish_reason in ("stop", "length")
            chunks = list(c.chat.completions.create(model=family, messages=messages, max_tokens=6, temperature=0,
                                                   stream=True))
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
            # neither template thinks: enable_thinking=false is satisfied as they are
            r = c.chat.completions.create(model=family, messages=messages, max_tokens=6, temperature=0,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            assert r.choices[0].message.content == want
            with pytest.raises(openai.BadRequestError, match="cannot set add_generation_prompt"):
                c.chat.completions.create(model=family, messages=messages, max_tokens=2,
                                          extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    finally:
        m.close()
