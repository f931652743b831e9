"""Structured outputs on the HTTP API: OpenAI's `response_format` (json_object, json_schema with strict) and
vLLM's `structured_outputs` extension (json, regex, grammar, choice) become a glmcore.structured.Grammar;
vLLM's `ignore_eos` and `min_tokens` become the scheduler Request's stop ids and min_tokens. The core
does the constraining; this module only translates and turns GrammarErrors into 400s naming the field."""
from __future__ import annotations

import json

from ..structured import Grammar, GrammarError, check_schema, compile_grammar, reply_constraint
from .protocol import ApiError


def request_grammar(req) -> tuple[Grammar | None, str | None]:
    """(the Grammar a request's reply must match, the parameter it came from), or (None, None)."""
    rf, so = getattr(req, "response_format", None), getattr(req, "structured_outputs", None)
    grammar, param = None, None
    if rf is not None and rf.type != "text":
        param = "response_format"
        if rf.type == "json_object":
            grammar = Grammar.json_object()
        else:
            if rf.json_schema is None:
                raise ApiError(400, "response_format of type json_schema needs 'json_schema': {\"name\", \"schema\"}",
                               "response_format.json_schema", "missing_required_parameter")
            # strict or not, the schema is enforced: what cannot be enforced is refused, never ignored
            grammar = _schema(rf.json_schema.schema_, "response_format.json_schema.schema")
    if so is not None:
        given = [k for k, v in (("json", so.json_), ("regex", so.regex), ("grammar", so.grammar),
                                ("choice", so.choice)) if v is not None]
        if len(given) != 1:
            raise ApiError(400, f"structured_outputs takes exactly one of json, regex, grammar, choice (got "
                           f"{', '.join(given) or 'none'})", "structured_outputs", "invalid_value")
        if grammar is not None:
            raise ApiError(400, "send either response_format or structured_outputs, not both", "structured_outputs",
                           "invalid_value")
        param = f"structured_outputs.{given[0]}"
        try:
            if so.json_ is not None:
                spec = so.json_
                if isinstance(spec, str):
                    try:
                        spec = json.loads(spec)
                    except ValueError as e:
                        raise GrammarError(f"the JSON Schema is not JSON ({e})") from None
                grammar = _schema(spec, param)
            elif so.regex is not None:
                grammar = Grammar.regex(so.regex)
            elif so.grammar is not None:
                grammar = Grammar.lark(so.grammar)
            else:
                grammar = Grammar.choice(so.choice)
        except GrammarError as e:
            raise ApiError(400, f"'{param}': {e}", param, "invalid_value") from None
    return grammar, param


def _schema(schema, param: str) -> Grammar:
    try:
        check_schema(schema)
        return Grammar.json_schema(schema)
    except GrammarError as e:
        raise ApiError(400, f"'{param}': {e}", param, "invalid_value") from None


def constrain_chat(model, req, sreq, tools, must_call: list[str], calls: bool, fmt=None,
                   thinking_budget: int | None = None) -> list[int]:
    """Set a chat request's constraint (response_format / structured_outputs, strict tools, tool_choice, a
    thinking budget) on the scheduler Request, in the reply format of `fmt` (the request's configured chat
    format); returns the ids forced at the start of the reply (a named function's name line, or the empty
    metadata line of a text reply), already appended to its prompt."""
    grammar, param = request_grammar(req)
    where = param or ("tool_choice" if must_call else "tools" if tools else "max_thinking_tokens")
    try:
        opening, sreq.constraint = reply_constraint(fmt or model.chat_format, model.config.vocab_size, grammar, tools,
                                                    must_call, calls, thinking_budget,
                                                    parallel=getattr(req, "parallel_tool_calls", None) is not False)
    except GrammarError as e:
        raise ApiError(400, f"'{where}': {e}", where, "invalid_value") from None
    if sreq.constraint is not None:
        sreq.constraint.field = where
    sreq.prompt = list(sreq.prompt) + opening
    return opening


def constrain_completion(model, req, sreq) -> None:
    """The same for /v1/completions: the grammar covers the whole generated text."""
    grammar, param = request_grammar(req)
    if grammar is not None:
        try:
            sreq.constraint = compile_grammar(model.tokenizer, grammar, model.config.vocab_size)
        except GrammarError as e:
            raise ApiError(400, f"'{param}': {e}", param, "invalid_value") from None
        sreq.constraint.field = param


def load_test_fields(req, sreq) -> None:
    """vLLM's ignore_eos (generate past the stop tokens) and min_tokens (no stop before that many tokens),
    which load-test harnesses send; after max_new_tokens is set."""
    if getattr(req, "ignore_eos", False):
        sreq.stop_ids = []
    min_tokens = getattr(req, "min_tokens", None) or 0
    if min_tokens > sreq.max_new_tokens:
        raise ApiError(400, f"'min_tokens' ({min_tokens}) exceeds the most tokens this reply may have "
                       f"({sreq.max_new_tokens}); lower it or raise max_tokens", "min_tokens", "invalid_value")
    sreq.min_tokens = min_tokens
