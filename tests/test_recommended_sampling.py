"""The sampling a checkpoint recommends (generation_config.json's temperature/top_p/top_k/repetition_penalty, a
GGUF's general.sampling.*) is what a request, a Pipeline call or a `glmcore run` that sets none samples with, as
vLLM (--generation-config auto) and llama-server do; what the caller sets still wins; a bad value is one line."""
from __future__ import annotations

import json
import shutil

import pytest

from glmcore.backend import LoadOptions
from glmcore.errors import GlmcoreError
from glmcore.model import load_model
from glmcore.pipeline import Pipeline
from glmcore.sampling import SamplingParams

# greedy (temperature 0), so that a reply sampled with the recommendation is the same under any seed
RECOMMENDED = {"temperature": 0.0, "top_p": 0.95, "top_k": 40, "repetition_penalty": 1.05}
WANT = SamplingParams(0.0, 0.95, 40, 1.05)
MESSAGES = [{"role": "user", "content": "你好 hello"}]


def _with_generation_config(src, dst, **keys):
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    gen = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**gen, **keys}))
    return dst


@pytest.fixture(scope="module")
def recommending(make_tiny, tmp_path_factory):
    return _with_generation_config(make_tiny("glm4-0414"), tmp_path_factory.mktemp("rec") / "m", **RECOMMENDED)


@pytest.fixture(scope="module")
def loaded(recommending):
    m = load_model(recommending, "torch", LoadOptions(threads=1), slots=2)
    yield m
    m.close()


def test_a_pipeline_call_without_params_samples_as_the_checkpoint_recommends(loaded, make_tiny):
    assert loaded.sampling == WANT
    plain = load_model(make_tiny("glm4-0414"), "torch", LoadOptions(threads=1))
    try:
        assert plain.sampling == SamplingParams()     # no recommendation: glmcore's defaults
    finally:
        plain.close()
    p = Pipeline(loaded=loaded)
    greedy = p.chat(MESSAGES, params=WANT, max_new_tokens=8).content
    p.reset()
    assert p.chat(MESSAGES, max_new_tokens=8).content == greedy


def test_a_request_without_sampling_fields_takes_the_recommendation(loaded):
    from test_server import client, serving
    pytest.importorskip("uvicorn", reason='the server needs its extra: pip install "glmcore[server]"')
    with serving(loaded) as url:
        c = client(url)
        want = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, top_p=0.95,
                                         extra_body={"top_k": 40, "repetition_penalty": 1.05}).choices[0].message
        for seed in (1, 2, 3):
            r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, seed=seed)
            assert r.choices[0].message.content == want.content
        # what the request sets wins; top_k -1 is vLLM's "off"
        r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=1.0, seed=4,
                                      extra_body={"top_k": -1})
        assert r.choices[0].finish_reason in ("length", "stop")


def test_glmcore_run_flags_left_out_are_the_checkpoints(recommending, capsys):
    from glmcore.cli import main
    base = ["run", "--model", str(recommending), "--backend", "torch", "--threads", "1", "--prompt", "你好",
            "--max-new-tokens", "8"]
    outs = []
    for extra in (["--seed", "1"], ["--seed", "2"], ["--temperature", "0", "--top-p", "0.95", "--top-k", "40",
                                                     "--repetition-penalty", "1.05"]):
        assert main(base + extra) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] == outs[2] and outs[0].strip()


def test_a_gguf_recommends_through_general_sampling(recommending, make_tiny, tmp_path):
    from gguf_kit import write_gguf
    from types import SimpleNamespace

    from glmcore.gguf import GGUFMetadata
    from glmcore.model import Checkpoint
    # a key of the wrong type or out of range is one line, as every other metadata key's
    for values, match in (({"general.sampling.temp": "hot"}, r"metadata general\.sampling\.temp is a str, not float"),
                          ({"general.sampling.top_p": 1.5}, r"\(general\.sampling\.\*\): invalid top-p 1\.5")):
        meta = GGUFMetadata({"general.architecture": "glm4", **values}, "x.gguf")
        with pytest.raises(GlmcoreError, match=match) as e:
            Checkpoint(tmp_path / "x.gguf", None, tmp_path, SimpleNamespace(meta=meta)).sampling()
        assert "\n" not in str(e.value)
    m = load_model(write_gguf(recommending, tmp_path / "rec.gguf"), "torch", LoadOptions(threads=1))
    try:
        assert m.sampling == WANT
    finally:
        m.close()
    m = load_model(write_gguf(make_tiny("glm4-0414"), tmp_path / "plain.gguf"), "torch", LoadOptions(threads=1))
    try:
        assert m.sampling == SamplingParams()
    finally:
        m.close()


@pytest.mark.parametrize("keys, match", [
    ({"temperature": "hot"}, r"generation_config\.json: temperature is 'hot', not a number; fix the value or delete "
                             r"the key$"),
    ({"top_p": 2}, r"generation_config\.json: invalid top-p 2\.0: use a value in \(0, 1\]; or delete the key$"),
    ({"top_k": 2.5}, r"generation_config\.json: top_k is 2\.5, not an integer"),
    ({"temperature": 10 ** 400}, r"temperature is 1000000000000000000000000000000000000000, not a"),
])
def test_a_bad_recommendation_is_one_line(make_tiny, tmp_path, keys, match):
    d = _with_generation_config(make_tiny("glm4-0414"), tmp_path / "m", **keys)
    with pytest.raises(GlmcoreError, match=match) as e:
        load_model(d, "torch", LoadOptions(threads=1))
    assert "\n" not in str(e.value)


def test_a_generation_config_that_is_not_json_is_one_line(make_tiny, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(make_tiny("glm4-0414"), d)
    (d / "generation_config.json").write_text('{"temperature": 0.6,')
    with pytest.raises(GlmcoreError, match=r"generation_config\.json is not valid JSON .*; fix it, or delete it to "
                                           r"sample with glmcore's defaults$"):
        load_model(d, "torch", LoadOptions(threads=1))
    (d / "generation_config.json").write_text("[0.6]")
    with pytest.raises(GlmcoreError, match=r"generation_config\.json is not a JSON object; fix it, or delete it"):
        load_model(d, "torch", LoadOptions(threads=1))
    (d / "generation_config.json").unlink()
    (d / "generation_config.json").mkdir()
    with pytest.raises(GlmcoreError, match=r"generation_config\.json '.*' is a directory; fix it, or delete it"):
        load_model(d, "torch", LoadOptions(threads=1))
    (d / "generation_config.json").rmdir()
    # top_k <= 0 is "off", as vLLM (-1) and llama.cpp (0) write it
    (d / "generation_config.json").write_text('{"top_k": -1}')
    m = load_model(d, "torch", LoadOptions(threads=1))
    try:
        assert m.sampling.top_k == 0
    finally:
        m.close()


def test_any_json_value_is_taken_or_refused_in_one_line():
    """generation_config.json is untrusted: whatever JSON its sampling keys hold gives SamplingParams or one
    SamplingError line, never another exception."""
    from hypothesis import example, given, settings, strategies as st

    from glmcore.errors import SamplingError
    from glmcore.sampling import RECOMMENDED_KEYS, recommended
    json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                               lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                           max_size=3), max_leaves=6)

    @settings(max_examples=300, deadline=None)
    @given(st.dictionaries(st.sampled_from(sorted(RECOMMENDED_KEYS)), json_values))
    @example({"repetition_penalty": -2 ** 63 - 1})     # past int64: numpy's isfinite raised TypeError on it
    @example({"top_k": 2 ** 64, "temperature": 10 ** 400})
    def check(values):
        try:
            p = recommended(values, "generation_config.json")
        except SamplingError as e:
            assert "\n" not in str(e) and str(e).startswith("generation_config.json: ")
        else:
            assert isinstance(p, SamplingParams)

    check()


def test_serve_says_what_it_samples_with(recommending):
    """`glmcore serve` prints the defaults it took, and whose they are."""
    import subprocess
    import sys
    import time
    proc = subprocess.Popen([sys.executable, "-m", "glmcore.cli", "serve", "--model", str(recommending), "--backend",
                             "torch", "--threads", "1", "--port", "0", "--grace", "0"], stderr=subprocess.PIPE,
                            text=True, env={**__import__("os").environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines, deadline = [], time.monotonic() + 120
        while not any("sample with" in x for x in lines) and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, ("the server exited", lines)
            lines.append(line)
        assert ("glmcore serve: requests that leave them out sample with temperature 0, top_p 0.95, top_k 40, "
                "repetition_penalty 1.05 (the checkpoint's recommendation)\n") in lines, lines
        # a SIGTERM as soon as it has said so stops it cleanly (uvicorn may not have taken the signals over yet)
        proc.terminate()
        assert proc.wait(timeout=60) == 0
        assert "glmcore serve: stopped" in proc.stderr.read()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
