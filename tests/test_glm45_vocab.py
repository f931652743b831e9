"""GLM-4.5's tokenizer at its real size: GLM-4's 151,329 BPE ranks (shared/models/glm-4-9b-chat) with GLM-4.5's
special tokens from id 151329 and the GLM-4.6 template, on a random-weight glm4-moe checkpoint of 151,552 logits
(`make-model --family glm4-moe --tokenizer-from DIR`); constrained XML tool calls through the server at that
vocabulary, where the grammar's mask costs most; the grammar's masks computed during the model's step."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import pytest

from glmcore import structured
from glmcore.backend import LoadOptions
from glmcore.errors import GlmcoreError
from glmcore.synth import make_model
from glmcore.tokenizer import load_tokenizer
from glmcore.weights import read_safetensors

# Pinned against GLM-4.6's own tokenizer.json (tokenizers 0.22.2), as a public project's golden test records them.
GLM46_IDS = {
    "Hello, world!": [9703, 11, 1879, 0], " hello": [23745], "hello": [14978], "\n\n": [271],
    "[gMASK]<sop>": [151331, 151333], "<|system|>": [151335],
    "<|assistant|>\n<think></think>\n": [151337, 198, 151350, 151351, 198], "あ": [29380], "日本語": [99799, 131513],
}
# GLM-4.5/4.6's added tokens in id order from 151329 (their tokenizer_config.json; GLM-4.6V's lists them alike)
TAG_IDS = {"<|endoftext|>": 151329, "[gMASK]": 151331, "<|user|>": 151336, "<|observation|>": 151338,
           "<think>": 151350, "<tool_call>": 151352, "</tool_call>": 151353, "<tool_response>": 151354,
           "<arg_key>": 151356, "</arg_key>": 151357, "<arg_value>": 151358, "</arg_value>": 151359,
           "/nothink": 151360, "<|video|>": 151364}


@pytest.fixture(scope="module")
def glm45(shared_models, tmp_path_factory):
    if not (shared_models / "glm-4-9b-chat" / "tokenizer.model").is_file():
        pytest.skip("GLM-4's tokenizer.model is not in shared/models")
    out = tmp_path_factory.mktemp("glm45") / "m"
    make_model("glm4-moe", "tiny", out, tokenizer_from=shared_models / "glm-4-9b-chat")
    return out


def test_tokenizer_is_glm46s_id_for_id(glm45):
    tok = load_tokenizer(glm45, "glm4-moe")
    assert tok.n_vocab == 151365
    for text, ids in GLM46_IDS.items():     # tags are special ids in rendered text, plain text in a user's
        assert tok.encode_rendered(text) == ids, text
    assert tok.encode("<think>") == [13699, 766, 29]        # "<th" "ink" ">"
    assert {t: tok.special_ids[t] for t in TAG_IDS} == TAG_IDS
    config = json.loads((glm45 / "config.json").read_text())
    assert config["vocab_size"] == 151552 and config["eos_token_id"] == [151329, 151336, 151338]
    stored = {}
    for f in glm45.glob("*.safetensors"):
        stored.update(read_safetensors(f))
    assert stored["model.embed_tokens.weight"].shape[0] == stored["lm_head.weight"].shape[0] == 151552


def test_tokenizer_from_refuses_what_is_not_glm4s_ranks(tmp_path, make_tiny):
    src = make_tiny("glm4")          # a synthetic GLM-4 tokenizer.model: 2048 ranks, not GLM-4's
    with pytest.raises(GlmcoreError, match="not GLM-4's 151329"):
        make_model("glm4-moe", "tiny", tmp_path / "a", tokenizer_from=src)
    with pytest.raises(GlmcoreError, match="tokenizer.model not found"):
        make_model("glm4-moe", "tiny", tmp_path / "b", tokenizer_from=tmp_path)
    with pytest.raises(GlmcoreError, match="vocabulary of its own"):
        make_model("glm4-moe-lite", "tiny", tmp_path / "c", tokenizer_from=src)


STRICT = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "strict": True, "parameters": STRICT}}]


@pytest.mark.slow          # ~45 s on 2 shared cores (the 151,552-row model and its token table)
def test_required_strict_xml_calls_at_the_full_vocabulary(glm45):
    """Four requests at once, tool_choice "required" with a strict tool: each reply is a call in GLM-4.5's XML
    form (its tags as their special ids) whose arguments validate, streamed and not."""
    pytest.importorskip("openai", reason="the server tests need the dev extra (openai, httpx)")
    pytest.importorskip("uvicorn", reason='the server needs its extra: pip install "glmcore[server]"')
    from test_server import client, serving

    from glmcore.model import load_model
    m = load_model(glm45, "torch", LoadOptions(threads=1), slots=4, token_budget=256)
    try:
        with serving(m, "glm45") as url:
            c = client(url)

            def ask(seed, stream=False):
                return c.chat.completions.create(
                    model="glm45", messages=[{"role": "user", "content": f"weather in city {seed}?"}], tools=TOOLS,
                    tool_choice="required", max_tokens=96, temperature=1.0, seed=seed, parallel_tool_calls=False,
                    stream=stream, extra_body={"chat_template_kwargs": {"enable_thinking": False}})

            with ThreadPoolExecutor(4) as pool:
                replies = list(pool.map(ask, range(4)))
            for r in replies:
                choice = r.choices[0]
                assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
                call = choice.message.tool_calls[0]
                assert call.function.name == "weather"
                jsonschema.validate(json.loads(call.function.arguments), STRICT)
            chunks = list(ask(0, stream=True))
            args = "".join(d.function.arguments or "" for ch in chunks if ch.choices
                           for d in ch.choices[0].delta.tool_calls or [])
            assert args == replies[0].choices[0].message.tool_calls[0].function.arguments
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
    finally:
        m.close()


def test_prefetched_masks_are_the_synchronous_ones(make_tiny):
    """The masks computed on the background thread are the matchers' own; a matcher that was not prefetched
    gets its mask computed then and there, beside the prefetched ones (only it)."""
    tok = load_tokenizer(make_tiny("glm4-moe"), "glm4-moe")
    c = structured.compile_grammar(tok, structured.Grammar.json_schema(STRICT), None, leading_space=False)
    matchers = [c.start() for _ in range(3)]
    for m, text in zip(matchers, ['{"city":"P', '{"ci', '{"city":"Paris","days":']):
        for t in tok.encode(text):
            assert m.advance(t) is None
    want = structured.compute_masks(matchers)
    assert len({w.tobytes() for w in want}) == 3        # three different states
    prefetched = structured.PrefetchedMasks(matchers[:2], structured.executor())
    got = np.zeros_like(want)
    assert prefetched.take(matchers[::-1], got) == [0]          # the third (first here) was not prefetched
    assert np.array_equal(got[1:], want[:2][::-1]) and not got[0].any()
    rows = [np.zeros(c.table.n_logits, np.float32)] * 3
    computed = []
    real = structured.compute_masks
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(structured, "compute_masks", lambda ms, ex=None: computed.append(len(ms)) or real(ms, ex))
        masked, alive = structured.mask_rows(matchers, rows, [[tok.eos_id]] * 3, [True] * 3, None, prefetched)
    assert computed == [1]
    assert alive == [True] * 3
    allowed = np.unpackbits(want.view(np.uint8), axis=1, bitorder="little")[:, :c.table.n_logits].astype(bool)
    allowed[:, tok.eos_id] = False                       # none of these states is complete
    assert np.array_equal(np.isfinite(masked), allowed)


def test_engine_masks_during_the_step_as_it_would_after_it(make_tiny, monkeypatch):
    """Constrained requests decoded together give the same tokens whether the masks come from the background
    thread during the step or are computed after it."""
    from glmcore.model import load_model
    from glmcore.sampling import SamplingParams
    from glmcore.scheduler import Request
    m = load_model(make_tiny("glm4-moe"), "torch", LoadOptions(threads=1), slots=4, token_budget=64)
    try:
        tok = m.tokenizer
        c = structured.compile_grammar(tok, structured.Grammar.json_schema(STRICT), m.config.vocab_size)
        prompt = [tok.special_ids["[gMASK]"], tok.special_ids["<sop>"]] + tok.encode("weather:")

        def run():
            handles = [m.scheduler.submit(Request(prompt, SamplingParams(temperature=1.0, seed=s), 40, (),
                                                  constraint=c)) for s in range(4)]
            m.scheduler.run()
            return [list(h.tokens) for h in handles]

        used = []
        real = structured.PrefetchedMasks.take
        monkeypatch.setattr(structured.PrefetchedMasks, "take",
                            lambda self, ms, bits: used.append(1) or real(self, ms, bits))
        during = run()
        assert used
        # none taken: every mask computed after the step
        monkeypatch.setattr(structured.PrefetchedMasks, "take", lambda self, ms, bits: self.wait() or range(len(ms)))
        after = run()
        assert during == after
        for tokens in during:
            jsonschema.validate(json.loads(tok.decode(tokens)), STRICT)
    finally:
        m.close()


def test_greedy_requests_ask_their_grammar_about_the_argmax_before_any_mask(make_tiny, monkeypatch):
    """A greedy request's argmax that its grammar allows is its token with no mask computed (exact: the masked
    row's argmax is the same id); a refused one is masked as before. Same tokens either way."""
    from glmcore.engine import step
    from glmcore.model import load_model
    from glmcore.sampling import SamplingParams
    from glmcore.scheduler import Request
    schema = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"],
              "additionalProperties": False}
    m = load_model(make_tiny("glm4-moe"), "torch", LoadOptions(threads=1), slots=4, token_budget=64)
    try:
        tok = m.tokenizer
        c = structured.compile_grammar(tok, structured.Grammar.json_schema(schema), m.config.vocab_size)

        def run():
            handles = [m.scheduler.submit(Request([tok.special_ids["[gMASK]"], tok.special_ids["<sop>"]]
                                                  + tok.encode(f"note {i}:"), SamplingParams(temperature=0), 24,
                                                  (), constraint=c)) for i in range(3)]
            m.scheduler.run()
            return [list(h.tokens) for h in handles]

        answers = []
        real = step.argmax_allowed
        monkeypatch.setattr(step, "argmax_allowed", lambda s, row: answers.append(real(s, row)) or answers[-1])
        first = run()
        assert True in answers and False in answers       # both ways taken: the string's text, its syntax
        monkeypatch.setattr(step, "argmax_allowed", lambda s, row: False)
        assert run() == first
        for tokens in first:
            assert tok.decode(tokens).startswith('{"note":"')
    finally:
        m.close()
