"""The sampling fields agents and eval harnesses send: presence/frequency penalties and logit_bias (the core's
sampler, held to a plain numpy reference on every ready backend), logprobs (log_softmax of the backend's own
logits, speculative decoding included), n choices (equal to separately seeded runs, the prompt prefilled
once), echo, and the tokenizer endpoints, through the official openai client against a live server."""
import json

import httpx
import numpy as np
import pytest

from glmcore.backend import LoadOptions, registry
from glmcore.config import ModelConfig
from glmcore.engine import Request, Scheduler, Speculation
from glmcore.errors import SamplingError
from glmcore.model import load_model
from glmcore.sampling import Sampler, SamplingParams, token_logprob

openai = pytest.importorskip("openai", reason="the server tests need the dev extra (openai, httpx)")
pytest.importorskip("uvicorn", reason='the server needs its extra: pip install "glmcore[server]"')
from test_server import client, serving  # noqa: E402
from test_speculative import Scripted  # noqa: E402

READY = registry().ready()


def reference_logits(row, params: SamplingParams, prompt, generated):
    """The textbook definitions, in float64: logit_bias added, transformers' repetition penalty over prompt
    and output, then OpenAI's logit - frequency * count - presence * (count > 0) over the output only."""
    x = np.array(row, dtype=np.float64)
    for t, b in params.logit_bias.items():
        x[t] += b
    for t in set(prompt) | set(generated):
        x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t in set(generated):
        c = generated.count(t)
        x[t] -= params.frequency_penalty * c + params.presence_penalty
    return x


def ref_log_softmax(row):
    x = np.array(row, dtype=np.float64)
    m = x[np.isfinite(x)].max()
    return x - m - np.log(np.exp(x - m).sum())


# ----------------------------------------------------------------------------- the sampler alone

def test_penalties_and_bias_equal_the_reference_and_never_unmask():
    g = np.random.default_rng(0)
    row = g.normal(size=50).astype(np.float32)
    row[[3, 7]] = -np.inf                       # masked by a grammar
    params = SamplingParams(temperature=0, presence_penalty=-1.5, frequency_penalty=0.75, repetition_penalty=1.2,
                            logit_bias={3: 100.0, 7: 50.0, 11: -100.0, 12: 2.5})
    prompt, generated = [1, 2, 12], [5, 5, 9, 12, 5]
    got = Sampler(params).adjusted(row, prompt + generated, generated)
    want = reference_logits(row, params, prompt, generated)
    assert np.isneginf(got[[3, 7]]).all()      # no bias or negative penalty unmasks a masked token
    np.testing.assert_allclose(got, want.astype(np.float32), rtol=1e-6)
    for _ in range(5):
        assert Sampler(params)(row, prompt + generated, generated) == int(np.argmax(want))
    # sampled: only unmasked ids, drawn from softmax(adjusted / T)
    s = Sampler(SamplingParams(temperature=1.0, top_p=1.0, seed=1, logit_bias={3: 100.0, 4: 3.0}))
    draws = [s(row) for _ in range(2000)]
    assert 3 not in draws and 7 not in draws
    p = np.exp(ref_log_softmax(reference_logits(row, SamplingParams(logit_bias={3: 100.0, 4: 3.0}), [], [])))
    assert abs(draws.count(4) / 2000 - p[4]) < 0.03


@pytest.mark.parametrize("kw,match", [
    ({"presence_penalty": 2.5}, "presence penalty"), ({"frequency_penalty": -3}, "frequency penalty"),
    ({"logit_bias": {5: 101}}, "logit bias"), ({"logit_bias": {-1: 1}}, "logit bias token id"),
])
def test_invalid_fields_refused(kw, match):
    with pytest.raises(SamplingError, match=match):
        SamplingParams(**kw)


def test_a_bias_outside_the_vocabulary_is_refused():
    with pytest.raises(SamplingError, match="logit bias token id 50"):
        Sampler(SamplingParams(logit_bias={50: 1.0}), n_vocab=50)


def test_token_logprob_is_log_softmax_with_the_likeliest_first():
    row = np.array([1.0, 3.0, 3.0, -np.inf, 0.5], dtype=np.float32)
    e = token_logprob(row, 4, 3)
    want = ref_log_softmax(row)
    assert e.token == 4 and e.logprob == pytest.approx(want[4], abs=1e-6)
    assert [t for t, _ in e.top] == [1, 2, 0]       # ties in id order
    np.testing.assert_allclose([lp for _, lp in e.top], want[[1, 2, 0]], atol=1e-6)
    assert token_logprob(row, 3, 0).logprob == -np.inf and token_logprob(row, 3, 0).top == ()


# ----------------------------------------------------------------------------- every backend

def run_reference(batch, slot, prompt, params, n_new, n_vocab):
    """Greedy decoding by hand on the backend's batch session: (tokens, log_softmax rows of their logits)."""
    batch.reset(slot)
    row = batch.step([(slot, list(prompt))])[0]
    out, lps = [], []
    for _ in range(n_new):
        t = int(np.argmax(reference_logits(row[:n_vocab], params, list(prompt), out)))
        out.append(t)
        lps.append(ref_log_softmax(row))        # normalized over the whole row, padding ids included
        row = batch.step([(slot, [t])])[0]
    return out, lps


@pytest.mark.parametrize("backend", READY)
def test_penalties_bias_and_logprobs_equal_the_reference_on_each_backend(make_tiny, backend):
    d = make_tiny("glm4")
    why = registry().get(backend).supports(ModelConfig.from_dir(d))
    if why is not None:
        pytest.skip(f"{backend} does not run this checkpoint: {why}")
    # f32: in bf16 (openvino_amx's default on AVX-512 BF16) the scheduler's steps and these hand-made ones round
    # the logits differently (up to 0.1 in a logprob, the same tokens); the conformance suite bounds bf16 itself
    m = load_model(d, backend, LoadOptions(threads=1, capacity=96, precision="f32"), slots=2)
    try:
        V, batch = m.tokenizer.n_vocab, m.scheduler.batch
        prompt = np.random.default_rng(3).integers(5, V, 12).tolist()
        plain = m.scheduler.submit(Request(prompt, SamplingParams(temperature=0), 16)).wait().tokens
        params = SamplingParams(temperature=0, presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.1,
                                logit_bias={plain[0]: -100.0, plain[1]: 1.5})
        h = m.scheduler.submit(Request(prompt, params, 16, logprobs=4)).wait()
        assert h.tokens != plain and plain[0] not in h.tokens
        ref, rows = run_reference(batch, 1, prompt, params, 16, V)
        assert h.tokens == ref
        assert len(h.logprobs) == len(h.tokens)
        for e, t, lp in zip(h.logprobs, h.tokens, rows):
            assert e.token == t and e.logprob == pytest.approx(lp[t], abs=2e-4)
            np.testing.assert_allclose([x for _, x in e.top], np.sort(lp[:V])[::-1][:4], atol=2e-4)
    finally:
        m.close()


def test_speculative_decoding_gives_the_same_tokens_and_logprobs(make_tiny):
    """Drafted positions are verified on their own rows: penalties count the tokens accepted in the same
    step, and the logprobs are those plain decoding computes."""
    m = load_model(make_tiny("glm4"), "torch", LoadOptions(threads=1, capacity=128), slots=1)
    try:
        V, caps, batch = m.tokenizer.n_vocab, m.backend.capabilities(), m.scheduler.batch
        prompt = np.random.default_rng(1).integers(5, V, 26).tolist()
        params = SamplingParams(temperature=0, frequency_penalty=0.3, logit_bias={prompt[3]: 0.7})
        plain = m.scheduler.submit(Request(prompt, params, 40, logprobs=2)).wait()
        m.scheduler.forget()
        spec = Scheduler(batch, caps, n_vocab=V, speculation=Speculation("ngram", 4))
        spec.drafter = Scripted({tuple(prompt): list(plain.tokens)}, 2)     # right twice, then wrong, per step
        h = spec.submit(Request(prompt, params, 40, logprobs=2)).wait()
        assert 0 < spec.accepted < spec.drafted
        assert h.tokens == plain.tokens
        for a, b in zip(h.logprobs, plain.logprobs):
            assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    finally:
        m.close()


def test_logit_bias_never_unmasks_what_the_grammar_forbids(make_tiny):
    pytest.importorskip("llguidance")
    from glmcore.structured import Grammar, compile_grammar
    m = load_model(make_tiny("glm4"), "torch", LoadOptions(threads=1, capacity=128), slots=1)
    try:
        tok = m.tokenizer
        prompt = [tok.special_ids["[gMASK]"], tok.special_ids["<sop>"]] + tok.encode("answer")
        forbidden = tok.encode("zeta")[0]
        params = SamplingParams(temperature=0, logit_bias={forbidden: 100.0}, presence_penalty=-2.0)
        free = m.scheduler.submit(Request(prompt, params, 3, [tok.eos_id])).wait()
        assert free.tokens[0] == forbidden                   # the bias decides where nothing is masked
        constraint = compile_grammar(tok, Grammar.regex(r"(yes|no)"), m.config.vocab_size)
        h = m.scheduler.submit(Request(prompt, params, 10, [tok.eos_id], constraint=constraint, logprobs=1)).wait()
        assert tok.decode(h.tokens) in ("yes", "no") and forbidden not in h.tokens
    finally:
        m.close()


def test_followers_copy_the_leaders_prompt_and_equal_separate_seeded_runs(make_tiny):
    m = load_model(make_tiny("glm4"), "torch", LoadOptions(threads=1, capacity=96), slots=4)
    try:
        sched, V = m.scheduler, m.tokenizer.n_vocab
        prompt = np.random.default_rng(5).integers(5, V, 30).tolist()
        params = [SamplingParams(temperature=1.0, top_p=1.0, seed=7 + i) for i in range(4)]
        lead = sched.submit(Request(prompt, params[0], 12))
        rest = [sched.submit(Request(prompt, p, 12), leader=lead) for p in params[1:]]
        for h in [lead] + rest:
            h.wait()
        assert lead.timings.prompt_tokens == 30
        assert [h.timings.prompt_tokens for h in rest] == [1, 1, 1]      # the prompt was prefilled once
        alone = []
        for p in params:
            sched.forget()
            alone.append(sched.submit(Request(prompt, p, 12)).wait().tokens)
        assert [h.tokens for h in [lead] + rest] == alone
        assert len({tuple(t) for t in alone}) > 1
    finally:
        m.close()


# ----------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def models(make_tiny):
    """The served model and a second copy of it whose logits the tests read directly."""
    d = make_tiny("chatglm3")
    served = load_model(d, "torch", LoadOptions(threads=1), slots=4, token_budget=64)
    ref = load_model(d, "torch", LoadOptions(threads=1), slots=1)
    yield served, ref
    served.close()
    ref.close()


@pytest.fixture(scope="module")
def url(models):
    with serving(models[0]) as u:
        yield u


def model_log_softmax(ref, ids):
    """log_softmax of the model's logits after each prefix of ids: row j predicts ids[j + 1]."""
    batch = ref.scheduler.batch
    batch.reset(0)
    rows = batch.step([(0, list(ids))], all_logits=True)[0]
    ref.scheduler.forget()          # the slot table did not see this step: the slot starts empty again
    return np.stack([ref_log_softmax(r) for r in rows])


def ref_token(ref, t):
    tok = ref.tokenizer
    return tok.special_names[t] if t in tok.special_names else tok.token_bytes(t).decode("utf-8", "replace")


def chat_ids(ref, messages):
    return ref.chat_format.encode_messages(messages)


MSGS = [{"role": "user", "content": "tell me about the weather"}]


def test_chat_logprobs_are_the_models_log_softmax_streamed_or_not(url, models):
    served, ref = models
    c = client(url)
    r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=12, temperature=0, logprobs=True,
                                  top_logprobs=5, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 12
    prompt, V = chat_ids(ref, MSGS), ref.tokenizer.n_vocab
    gen = ref.scheduler.submit(Request(prompt, SamplingParams(temperature=0), 12)).wait().tokens
    lp = model_log_softmax(ref, prompt + gen)[len(prompt) - 1:-1]          # the rows the tokens were drawn from
    assert [e.token for e in content] == [ref_token(ref, t) for t in gen]
    np.testing.assert_allclose([e.logprob for e in content], [row[t] for row, t in zip(lp, gen)], atol=1e-4)
    np.testing.assert_allclose([[t.logprob for t in e.top_logprobs] for e in content],
                               [np.sort(row[:V])[::-1][:5] for row in lp], atol=1e-4)
    assert all(bytes(e.bytes).decode("utf-8", "replace") == e.token for e in content)
    chunks = list(c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=12, temperature=0, logprobs=True,
                                            top_logprobs=5, stream=True, extra_body={"ignore_eos": True}))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content
    # no logprobs asked: none computed, none sent
    plain = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_and_echo_score_the_prompt(url, models):
    served, ref = models
    tok = ref.tokenizer
    ids = list(ref.chat_format.prefix) + tok.encode("the weather in Beijing is")
    r = client(url).completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0, logprobs=2,
                                       echo=True, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    n = len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = model_log_softmax(ref, ids)
    np.testing.assert_allclose(lp.token_logprobs[1:n], [want[j, ids[j + 1]] for j in range(n - 1)], atol=1e-4)
    assert lp.token_logprobs[n] == pytest.approx(want[-1, :tok.n_vocab].max(), abs=1e-4)
    assert all(len(t) >= 2 and max(t.values()) >= v - 1e-6 for t, v in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
    assert lp.text_offset == sorted(lp.text_offset)
    assert r.choices[0].text.startswith(tok.decode(ids, skip_special=False))
    # without echo: the generated tokens only; the same numbers
    r2 = client(url).completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0, logprobs=2,
                                        extra_body={"ignore_eos": True})
    assert r2.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[n:], abs=1e-5)
    assert r2.choices[0].logprobs.text_offset[0] == 0
    # streamed with echo: the prompt first, then the tokens
    chunks = list(client(url).completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0, logprobs=2,
                                                 echo=True, stream=True, extra_body={"ignore_eos": True}))
    got = [v for ch in chunks if ch.choices and ch.choices[0].logprobs for v in ch.choices[0].logprobs.token_logprobs]
    assert got[0] is None and got[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text


def test_max_tokens_0_with_echo_scores_the_prompt_only_and_a_stop_id_has_its_logprob(url, models):
    served, ref = models
    tok = ref.tokenizer
    ids = list(ref.chat_format.prefix) + tok.encode("the weather in Beijing is")
    c = client(url)
    full = c.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    only = c.completions.create(model="tiny", prompt=ids, max_tokens=0, temperature=0, logprobs=1, echo=True)
    assert only.choices[0].logprobs.token_logprobs == full.choices[0].logprobs.token_logprobs[:len(ids)]
    assert only.usage.completion_tokens == 0 and only.choices[0].text == tok.decode(ids, skip_special=False)
    # the end-of-text id is drawn first: no text, and still its logprob, so echo's scores stay aligned (lm-eval)
    eos = c.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0, logprobs=1, echo=True,
                               logit_bias={str(tok.eos_id): 100})
    lp = eos.choices[0].logprobs
    assert eos.choices[0].finish_reason == "stop" and eos.usage.completion_tokens == 0
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[-1] == pytest.approx(
        model_log_softmax(ref, ids)[-1, tok.eos_id], abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.completions.create(model="tiny", prompt=ids, max_tokens=0)


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_equal_separately_seeded_runs(url, stream):
    c = client(url)
    kw = dict(model="tiny", messages=MSGS, max_tokens=10, temperature=1.0, top_p=1.0)

    def text(seed=None, n=1):
        if not stream:
            r = c.chat.completions.create(seed=seed, n=n, **kw)
            return [ch.message.content for ch in sorted(r.choices, key=lambda ch: ch.index)], r.usage
        out, usage = [""] * n, None
        for ch in c.chat.completions.create(seed=seed, n=n, stream=True, stream_options={"include_usage": True}, **kw):
            for choice in ch.choices:
                out[choice.index] += choice.delta.content or ""
            usage = ch.usage or usage
        return out, usage
    many, usage = text(seed=11, n=4)
    alone = [text(seed=11 + i)[0][0] for i in range(4)]
    assert many == alone and len(set(many)) > 1
    singles = [text(seed=11 + i)[1].completion_tokens for i in range(4)]
    assert usage.completion_tokens == sum(singles) and usage.prompt_tokens == text(seed=11)[1].prompt_tokens


@pytest.mark.parametrize("echo", [False, True])
def test_n_choices_on_completions_and_logprobs_per_choice(url, echo):
    kw = dict(model="tiny", prompt="the weather", max_tokens=6, temperature=1.0, top_p=1.0, logprobs=1, echo=echo)
    r = client(url).completions.create(seed=3, n=3, **kw)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    for ch in r.choices:
        alone = client(url).completions.create(seed=3 + ch.index, **kw)
        assert ch.text == alone.choices[0].text
        assert ch.logprobs.token_logprobs[echo:] == pytest.approx(alone.choices[0].logprobs.token_logprobs[echo:],
                                                                   abs=1e-4)
        assert ch.logprobs.tokens == alone.choices[0].logprobs.tokens
    streamed = ["", "", ""]
    for chunk in client(url).completions.create(seed=3, n=3, stream=True, **kw):
        for ch in chunk.choices:
            streamed[ch.index] += ch.text
    assert streamed == [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]


def test_penalties_and_bias_through_the_server_equal_the_engine(url, models):
    served, ref = models
    tok = ref.tokenizer
    ids = list(ref.chat_format.prefix) + tok.encode("rain rain rain")
    params = SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=0.5,
                            logit_bias={tok.encode("rain")[-1]: -100.0, 40: 3.0})
    want = ref.scheduler.submit(Request(ids, params, 12, [tok.eos_id])).wait()
    r = client(url).completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0, presence_penalty=1.0,
                                       frequency_penalty=0.5,
                                       logit_bias={str(k): v for k, v in params.logit_bias.items()})
    assert r.choices[0].text == tok.decode(want.tokens)
    forced = client(url).completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0,
                                            logit_bias={"40": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == tok.decode([40] * 5)


def test_tokenize_and_detokenize_round_trip(url, models):
    served, ref = models
    text = "the weather in Beijing"
    r = httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": text}).json()
    assert r["tokens"] == list(ref.chat_format.prefix) + ref.tokenizer.encode(text)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == served.scheduler.capacity
    bare = httpx.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert httpx.post(f"{url}/detokenize", json={"tokens": bare}).json() == {"prompt": text}
    # ids from /tokenize are the prompt the text is
    c = client(url)
    a = c.completions.create(model="tiny", prompt=text, max_tokens=5, temperature=0)
    b = c.completions.create(model="tiny", prompt=r["tokens"], max_tokens=5, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    # messages: the chat template applied, as the chat endpoint does
    chat = httpx.post(f"{url}/tokenize", json={"model": "tiny", "messages": MSGS}).json()
    assert chat["tokens"] == ref.chat_format.encode_messages(MSGS)
    assert chat["count"] == c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1).usage.prompt_tokens
    no_gen = httpx.post(f"{url}/tokenize", json={"messages": MSGS, "add_generation_prompt": False}).json()
    assert no_gen["tokens"] == ref.chat_format.encode_messages(MSGS, add_generation_prompt=False)
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert "eos_token" in info and info["model_max_length"] == served.scheduler.capacity


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": "x", "messages": MSGS}, "prompt"),
    ("/tokenize", {"model": "nope", "prompt": "x"}, "model"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens.1"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 5}, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSGS, "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSGS, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSGS, "logit_bias": {"123456789": 1}}, "logit_bias"),
])
def test_bad_fields_are_400s_naming_them(url, path, body, param):
    r = httpx.post(f"{url}{path}", content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split(".")[0] in err["message"], err
