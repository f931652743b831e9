"""Constrained decoding in the core: the token table built from glmcore's tokenizers, grammar compilation
errors, the scheduler's masking (batched with unconstrained requests, stop at the grammar's end, dead
ends), and replies that validate against their JSON Schema on the random-weight tiny models."""
import json

import jsonschema
import numpy as np
import pytest

from glmcore.backend import LoadOptions
from glmcore.chat import as_message, chat_format_for
from glmcore.model import load_model
from glmcore.pipeline import Pipeline
from glmcore.sampling import SamplingParams
from glmcore.scheduler import Request
from glmcore.structured import (Grammar, GrammarError, check_schema, compile_grammar, encode_plain, mask_rows,
                                reply_constraint, token_table)
from glmcore.tokenizer import load_tokenizer

pytest.importorskip("llguidance")

GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=1.0, top_p=1.0)

# What applications send (bounded strings: a random-weight model closes an unbounded string only by chance)
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                                  "role": {"enum": ["admin", "user", "guest"]}},
                 "required": ["id", "role"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3}},
     "required": ["user", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": -1, "maximum": 1,
                                                "multipleOf": 0.25},
                                      "ok": {"type": "boolean"}, "note": {"type": "string", "maxLength": 6}},
     "required": ["score", "ok"], "additionalProperties": False},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50},
                                                          "y": {"type": "integer", "minimum": -50, "maximum": 50}},
                         "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
     "required": ["start", "end"], "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10},
                                                          {"type": "string", "maxLength": 4}, {"type": "null"}]}},
     "required": ["value"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"enum": ["a", "b"]},
                                                                 "v": {"type": "integer", "minimum": 0,
                                                                       "maximum": 99}},
                                "required": ["k", "v"], "additionalProperties": False},
     "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"const": "XL"},
                                      "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 5}},
     "required": ["color", "size", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9},
                                                "minItems": 0, "maxItems": 5},
                                      "meta": {"type": "object", "properties": {"v": {"type": "boolean"}},
                                               "additionalProperties": False}},
     "required": ["items"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def glm4_tok(make_tiny):
    return load_tokenizer(make_tiny("glm4"), "glm4")


@pytest.fixture(scope="module")
def sp_tok(make_tiny):
    return load_tokenizer(make_tiny("chatglm3"), "chatglm3")


def allowed_ids(constraint_matcher, n_logits, stops=(), open_=True):
    row = np.zeros(n_logits, np.float32)
    out, alive = mask_rows([constraint_matcher], [row], [stops], [open_])
    return np.flatnonzero(np.isfinite(out[0])), alive[0]


@pytest.mark.parametrize("which", ["glm4_tok", "sp_tok"])
def test_token_table_never_allows_special_or_padded_ids(which, request):
    tok = request.getfixturevalue(which)
    n_logits = tok.n_vocab + 61                       # a padded output layer
    m = compile_grammar(tok, Grammar.regex(r"[\s\S]{0,40}"), n_logits).start()
    ids, alive = allowed_ids(m, n_logits)
    specials = [i for i in range(tok.n_vocab) if tok.is_special(i)]
    assert alive and len(ids) > tok.n_vocab // 2
    assert not set(ids) & set(specials), "a special token was allowed as text"
    assert ids.max() < tok.n_vocab, "a padded id was allowed"


def test_sentencepiece_dummy_prefix_at_the_first_step(sp_tok):
    """The first piece of a SentencePiece text carries "▁" (decoded away): a reply may open with "{" or
    "▁{", and encode() of the text (which adds the dummy prefix) is accepted whole."""
    c = compile_grammar(sp_tok, Grammar.json_object())
    ids, _ = allowed_ids(c.start(), sp_tok.n_vocab)
    firsts = {sp_tok.token_bytes(int(i)) for i in ids}
    assert b"{" in firsts and any(b.startswith(b" {") for b in firsts)
    m = c.start()
    for t in sp_tok.encode('{"a":1}'):
        assert m.advance(t) is None
    assert m.stopped


@pytest.mark.parametrize("grammar,fragment", [
    (Grammar.regex("a(b"), "unclosed group"),
    (Grammar.lark("start: missing_rule"), "missing_rule"),
    (Grammar.json_schema({"type": "strin"}), "strin"),
])
def test_a_grammar_that_cannot_compile_names_the_problem(glm4_tok, grammar, fragment):
    with pytest.raises(GrammarError, match="cannot be compiled") as e:
        compile_grammar(glm4_tok, grammar)
    assert fragment in str(e.value)


def test_unsupported_schema_keywords_are_named():
    with pytest.raises(GrammarError) as e:
        check_schema({"type": "object", "properties": {"a": {"type": "string", "contentEncoding": "base64"},
                                                       "b": {"not": {"type": "null"}}}})
    assert "#/properties/a: contentEncoding" in str(e.value) and "#/properties/b: not" in str(e.value)
    check_schema(SCHEMAS[3])
    with pytest.raises(GrammarError, match="list of strings"):
        Grammar.choice([])


def test_stop_ids_only_where_the_grammar_is_complete(glm4_tok):
    eos = glm4_tok.eos_id
    m = compile_grammar(glm4_tok, Grammar.regex("ab?")).start()
    for t in encode_plain(glm4_tok, "a"):
        m.advance(t)
    ids, _ = allowed_ids(m, glm4_tok.n_vocab, stops=[eos, 7])
    assert eos in ids and 7 in ids           # "a" is complete: a stop may end it
    ids, _ = allowed_ids(m, glm4_tok.n_vocab, stops=[eos], open_=False)
    assert eos not in ids                    # min_tokens not reached
    ids, _ = allowed_ids(m, glm4_tok.n_vocab, stops=[])
    assert eos not in ids                    # never the eos alone when it is not the request's stop


def _model(make_tiny, family, backend, slots):
    # one thread: torch's default (every core) only contends with itself at this size
    return load_model(make_tiny(family), backend, LoadOptions(threads=1), slots=slots)


def test_scheduler_masks_constrained_rows_and_leaves_the_others_alone(make_tiny):
    """A constrained request batched with unconstrained ones: it matches its choice and ends at the
    grammar's end (no stop token needed); the others equal their solo runs."""
    m = _model(make_tiny, "glm4", "torch", 3)
    tok = m.tokenizer
    prompt = [tok.special_ids["[gMASK]"], tok.special_ids["<sop>"]] + tok.encode("pick one")
    solo = m.scheduler.submit(Request(prompt, GREEDY, 12, [tok.eos_id]))
    m.scheduler.run()
    constraint = compile_grammar(tok, Grammar.choice(["alpha", "beta gamma"]), m.config.vocab_size)
    a = m.scheduler.submit(Request(prompt, GREEDY, 12, [tok.eos_id]))
    c = m.scheduler.submit(Request(prompt, SAMPLED, 12, [tok.eos_id], constraint=constraint))
    m.scheduler.run()
    assert tok.decode(c.tokens) in ("alpha", "beta gamma") and c.finish_reason == "stop"
    assert a.tokens == solo.tokens
    m.close()


def test_a_dead_ended_grammar_ends_the_request_with_a_clear_error(make_tiny):
    """Only a stop token can follow "a", and min_tokens keeps stops closed: the request ends (no hang)."""
    m = _model(make_tiny, "glm4", "torch", 1)
    tok = m.tokenizer
    user = tok.special_ids["<|user|>"]
    constraint = compile_grammar(tok, Grammar.lark('start: "a" <|user|>'), m.config.vocab_size)
    h = m.scheduler.submit(Request([tok.special_ids["[gMASK]"], 5], GREEDY, 8, [user], min_tokens=5,
                                   constraint=constraint))
    with pytest.raises(GrammarError, match="dead-ended after 1 tokens"):
        h.wait(timeout=60)
    assert h.finish_reason == "error"
    ok = m.scheduler.submit(Request([tok.special_ids["[gMASK]"], 5], GREEDY, 8, [user], constraint=constraint))
    ok.wait(timeout=60)
    assert ok.finish_reason == "stop" and tok.decode(ok.tokens) == "a"
    m.close()


def test_min_tokens_holds_stop_ids_back(make_tiny):
    m = _model(make_tiny, "glm4", "torch", 1)
    tok = m.tokenizer
    prompt = [tok.special_ids["[gMASK]"], 5, 6]
    free = m.scheduler.submit(Request(prompt, GREEDY, 1, [tok.eos_id]))
    m.scheduler.run()
    stop = free.tokens[0]                   # the greedy first token, made a stop id
    h = m.scheduler.submit(Request(prompt, GREEDY, 6, [stop], min_tokens=4))
    m.scheduler.run()
    assert len(h.tokens) >= 4 and stop not in h.tokens[:4]
    with pytest.raises(Exception, match="invalid min-tokens"):
        m.scheduler.submit(Request(prompt, GREEDY, 3, [stop], min_tokens=4))
    m.close()


def test_strict_tool_arguments_and_tool_choice_are_grammars(make_tiny):
    """tool_choice among several tools (once a token trie) and strict tools' arguments are the same
    mechanism: a Lark grammar over the reply's name line and its JSON arguments."""
    m = _model(make_tiny, "glm4", "torch", 2)
    fmt = m.chat_format
    params = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["city", "days"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "weather", "strict": True, "parameters": params}},
             {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    pipe = Pipeline(loaded=m)
    for seed in range(3):
        prompt = pipe.model.chat_format.encode_messages([as_message({"role": "user", "content": f"go {seed}"})],
                                                        tools=tools)
        opening, constraint = reply_constraint(fmt, m.config.vocab_size, None, tools, must_call=["weather"])
        h = m.scheduler.submit(Request(prompt + opening, SamplingParams(temperature=1.0, seed=seed), 64,
                                       fmt.stop_ids, constraint=constraint))
        h.wait(timeout=60)
        reply = fmt.decode_reply(opening + h.tokens, tools)
        assert reply.tool_calls and reply.tool_calls[0].name == "weather"
        jsonschema.validate(reply.tool_calls[0].arguments, params)
        opening, constraint = reply_constraint(fmt, m.config.vocab_size, None, tools, must_call=["weather", "search"])
        assert opening == []
        h = m.scheduler.submit(Request(prompt, SamplingParams(temperature=1.0, seed=seed), 48, fmt.stop_ids,
                                       constraint=constraint))
        h.wait(timeout=60)
        text = m.tokenizer.decode(h.tokens)
        assert text.startswith(("weather\n", "search\n")), text
        if text.startswith("weather\n") and h.finish_reason == "stop":
            jsonschema.validate(json.loads(text.split("\n", 1)[1]), params)
    m.close()
    sp = chat_format_for(load_tokenizer(make_tiny("chatglm3"), "chatglm3"))
    with pytest.raises(GrammarError, match="writes tool calls as Python"):
        reply_constraint(sp, None, None, tools)


def test_pipeline_takes_a_grammar(make_tiny):
    m = _model(make_tiny, "chatglm3", "torch", 1)
    pipe = Pipeline(loaded=m)
    reply = pipe.chat([{"role": "user", "content": "hi"}], params=GREEDY, max_new_tokens=80,
                      grammar=Grammar.json_schema(SCHEMAS[0]))
    jsonschema.validate(json.loads(reply.content), SCHEMAS[0])
    reply = pipe.chat([{"role": "user", "content": "hi"}, reply, {"role": "user", "content": "again"}],
                      params=GREEDY, max_new_tokens=20, grammar=Grammar.regex("(yes|no)!"))
    assert reply.content in ("yes!", "no!")
    m.close()


@pytest.mark.parametrize("backend", ["torch", "cpu_int4"])
@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_replies_validate_against_their_schemas(make_tiny, backend, family):
    """The done-when check at test size: 100 requests per backend and tokenizer kind over the schemas above (nested
    objects, arrays with min/max items, enums, number ranges, optional fields, $ref, anyOf), greedy
    and sampled, one at a time and 8 at once: every reply parses and validates."""
    m = _model(make_tiny, family, backend, 8)
    pipe = Pipeline(loaded=m)
    n = 0
    for together in (1, 8):
        for sampled in (False, True):
            handles = []
            for i in range(25):
                schema = SCHEMAS[i % len(SCHEMAS)]
                params = SamplingParams(temperature=1.0, top_p=0.95, seed=i) if sampled else GREEDY
                msgs = [as_message({"role": "user", "content": f"request {i} {sampled}"})]
                req, opening = pipe._request(msgs, None, params, 160, Grammar.json_schema(schema))
                handles.append((schema, opening, m.scheduler.submit(req)))
                if len(handles) % together == 0:
                    m.scheduler.run()
            m.scheduler.run()
            for schema, opening, h in handles:
                reply = m.chat_format.decode_reply(opening + h.tokens)
                assert h.finish_reason == "stop", (h.finish_reason, reply.content)
                jsonschema.validate(json.loads(reply.content), schema)
                n += 1
    assert n == 100
    m.close()


def test_cli_run_takes_a_json_schema_or_a_grammar_file(make_tiny, tmp_path, capsys):
    from glmcore.cli import main
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMAS[6]))
    model = str(make_tiny("glm4"))
    assert main(["run", "--model", model, "--backend", "cpu_int4", "--prompt", "hi", "--json-schema", str(schema),
                 "--temperature", "0"]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), SCHEMAS[6])
    lark, prompts = tmp_path / "g.lark", tmp_path / "p.txt"
    lark.write_text('start: "id-" /[0-9]{3}/\n')
    prompts.write_text("one\ntwo\n")
    assert main(["run", "--model", model, "--backend", "cpu_int4", "--prompts", str(prompts), "--grammar",
                 str(lark)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if not line.startswith("---")] and all(
        __import__("re").fullmatch(r"id-[0-9]{3}", line) for line in out if not line.startswith("---"))
    assert main(["run", "--model", model, "--prompt", "x", "--json-schema", str(lark)]) != 0
    assert "is not JSON" in capsys.readouterr().err
