"""OpenAI's request shapes, checked, and its error JSON. A field the server does not know, or a value it
cannot honour (best_of, suffix), is a 400 that names it -- never silently ignored. Types are
strict (JSON's types, never coerced: "4" is not a number, true is not 1) and every string is checked to
be encodable text before any work is queued."""
from __future__ import annotations

import json
import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..parsers.base import MAX_ARGUMENT_DEPTH, json_depth

# Nesting a body may have: OpenAI's shapes need < 10 levels, tool schemas a few more. Checked before json.loads,
# so no request depends on the interpreter's recursion limit (or costs a pretty-printed 900-level schema).
MAX_DEPTH = 64
MAX_SCHEMA_DEPTH = MAX_ARGUMENT_DEPTH       # a tool's parameters schema, and a tool call's arguments
MAX_STOP_CHARS = 256        # one stop string
MAX_STOPS = 4               # stop strings of a request


class ApiError(Exception):
    """Becomes {"error": {"message", "type", "param", "code"}} with a 4xx status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False


def value_depth(value) -> int:
    """The nesting depth of a parsed JSON value (through its compact JSON: no recursion limit involved)."""
    try:
        return json_depth(json.dumps(value, ensure_ascii=False, separators=(",", ":")))
    except (RecursionError, ValueError):
        return 1 << 30              # too deep (or not JSON) even to print


def parse_arguments(arguments: str | dict, where: str) -> dict:
    """A tool call's arguments as a JSON object: an object, or a string holding one (OpenAI sends a string)."""
    if isinstance(arguments, str):
        if json_depth(arguments) > MAX_SCHEMA_DEPTH:
            raise ApiError(400, f"'{where}' is nested deeper than {MAX_SCHEMA_DEPTH} levels; flatten the arguments",
                           where, "invalid_value")
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise ApiError(400, f"'{where}' is not JSON ({str(e)[:60]}); send a JSON object string", where,
                           "invalid_value") from None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"'{where}' is a JSON {type(arguments).__name__}; tool call arguments are a JSON object",
                       where, "invalid_value")
    if value_depth(arguments) > MAX_SCHEMA_DEPTH:
        raise ApiError(400, f"'{where}' is nested deeper than {MAX_SCHEMA_DEPTH} levels; flatten the arguments",
                       where, "invalid_value")
    # a string's escapes can hold what the body could not: a lone surrogate, which the tokenizer cannot encode
    inner = _bad_text(json.dumps(arguments), arguments)
    if inner is not None:
        raise ApiError(400, f"'{where}' holds a lone UTF-16 surrogate (at '{inner}'), which is not text; send valid "
                       "Unicode", where, "invalid_value")
    return arguments


class FunctionCall(Strict):
    name: str = Field(min_length=1, max_length=256)
    arguments: str | dict = "{}"


class ToolCallIn(Strict):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionName(Strict):
    name: str = Field(min_length=1, max_length=256)


class ToolChoiceFunction(Strict):
    type: Literal["function"]
    function: FunctionName


class FunctionDef(Strict):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _shallow(cls, v):
        if v is not None and value_depth(v) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the schema is nested deeper than {MAX_SCHEMA_DEPTH} levels; flatten it")
        return v


class ToolDef(Strict):
    type: Literal["function"]
    function: FunctionDef


class MessageIn(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None                # a participant's name; the GLM formats have no place for it
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None   # a thinking model's reasoning as this server returned it (vLLM's name)


class JsonSchemaSpec(Strict):
    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputs(Strict):
    """vLLM's extension (glmcore.server.outputs): exactly one of these."""
    json_: dict | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None


# Parameters OpenAI defines that this server accepts only at the value that means "off" (or null), of its type.
_ONLY_DEFAULT = {"best_of": 1, "suffix": None}
MAX_TOP_LOGPROBS = 20       # chat's top_logprobs (OpenAI's bound)
MAX_LEGACY_LOGPROBS = 5     # /v1/completions' logprobs (OpenAI's legacy bound)
MAX_N = 128                 # choices of one request; the server also bounds n by its slots


def _is_default(value, default) -> bool:
    if value is None:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return value is default
    if isinstance(default, float):
        return isinstance(value, (int, float)) and value == default
    return type(value) is type(default) and value == default


class _Sampling(Strict):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, le=2**64 - 1)
    stop: str | list[str] | None = None
    user: str | None = None                # an end-user id for the caller's own records
    # extensions with vLLM's names (the sampler has them)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)     # -1 and 0: off (vLLM's -1, OpenAI clients' 0)
    # a penalty divides (or multiplies) logits: far from 1 it overflows float32 into inf/NaN probabilities
    repetition_penalty: float | None = Field(None, ge=0.01, le=100)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=2**31 - 1)
    # constrained decoding (glmcore.server.outputs)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None         # token id (as a string, as JSON keys are) -> [-100, 100]

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise ApiError(400, f"'stop' has {len(stops)} strings; at most {MAX_STOPS} are allowed", "stop")
        if any(not s for s in stops):
            raise ApiError(400, "'stop' holds an empty string; remove it", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ApiError(400, f"'stop' holds a string longer than {MAX_STOP_CHARS} characters; shorten it", "stop")
        return stops


class ChatRequest(_Sampling):
    messages: list[MessageIn]
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    # variables for the checkpoint's chat template (vLLM/SGLang's extension), e.g. {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None
    # thinking: OpenAI's effort (onto the template's enable_thinking switch), and a budget of thought tokens
    # (glmcore's name, and llama.cpp's per-request one; -1 there: no limit)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    max_thinking_tokens: int | None = Field(None, ge=0, le=2**31 - 1)
    thinking_budget_tokens: int | None = Field(None, ge=-1, le=2**31 - 1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM's: the reply continues the last message, an assistant's text (with add_generation_prompt false)
    continue_final_message: bool = False
    add_generation_prompt: bool = True


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(union_mode="left_to_right")
    max_tokens: int | None = Field(None, ge=0, le=2**31 - 1)     # 0: score the prompt only (with echo)
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LEGACY_LOGPROBS)    # the legacy shape: how many alternatives


# vLLM's tokenizer endpoints (glmcore.server.tokenize)
class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[MessageIn] | None = None
    # a prompt: with the model's [gMASK]sop prefix (as /v1/completions puts it before text); messages: the
    # chat template's own special tokens, always
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ToolDef] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
    tool_choice: ClassVar[None] = None        # what tool_setup reads; the template only lists the tools


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _bad_text(text: str, data) -> str | None:
    """The path of the first string (or key) that is not encodable text -- a lone surrogate such as
    "\\ud800", which JSON can carry but UTF-8, and so the tokenizer, cannot -- or None. UTF-8 input holds
    no surrogate, so only a body with a \\uD800-\\uDFFF escape is walked."""
    if not _SURROGATE_ESCAPE.search(text):
        return None
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
        return None                 # escapes of valid pairs only
    except UnicodeEncodeError:
        pass
    todo = [(data, "")]
    while todo:
        v, path = todo.pop()
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        for k, x in items:
            key = _shown(k) if isinstance(k, str) else str(k)     # part of the path the error message quotes
            here = f"{path}.{key}" if path else key
            for s in (k, x):
                if isinstance(s, str):
                    try:
                        s.encode("utf-8")
                    except UnicodeEncodeError:
                        return here
            if isinstance(x, (dict, list)):
                todo.append((x, here))
    return None


def _param(data, loc) -> str | None:
    """The dotted path of a validation error's location in the request, without pydantic's union member tags
    ("tool_choice.literal['auto',...]" is the client's "tool_choice")."""
    path, v = [], data
    for part in loc:
        if isinstance(v, dict) and isinstance(part, str) and part in v:
            v = v[part]
        elif isinstance(v, list) and isinstance(part, int) and 0 <= part < len(v):
            v = v[part]
        elif isinstance(part, str) and not path:
            path.append(part)           # a missing top-level field
            break
        else:
            continue                    # a union member's tag, not a place in the body
        path.append(_shown(str(part)))
    return ".".join(path) or None


def _shown(key: str) -> str:
    """A client's key as an error message shows it: lone surrogates and control characters escaped (the message
    stays one line of text), at most 40 characters."""
    key = key.encode("utf-8", "backslashreplace").decode("utf-8")[:40]
    return key if key.isprintable() else json.dumps(key, ensure_ascii=False)[1:-1]


def parse(cls: type[Strict], body: bytes) -> Strict:
    """The request, or an ApiError naming the first field that is wrong."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not UTF-8 (byte {e.start}); send UTF-8 JSON") from None
    if json_depth(text) > MAX_DEPTH:
        raise ApiError(400, f"the request body is nested deeper than {MAX_DEPTH} levels; flatten it")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({str(e)[:80]}); send a JSON object") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body is a JSON {type(data).__name__}; send a JSON object")
    bad = _bad_text(text, data)
    if bad is not None:
        raise ApiError(400, f"'{bad}' holds a lone UTF-16 surrogate, which is not text; send valid Unicode", bad,
                       "invalid_value")
    try:
        req = cls.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        err = errors[0]
        param = _param(data, err["loc"])
        if err["type"] == "extra_forbidden":
            raise ApiError(400, f"unsupported parameter '{param}': this server does not implement it; remove it",
                           param, "unsupported_parameter") from None
        if err["type"] == "missing":
            raise ApiError(400, f"missing required parameter '{param}'", param, "missing_required_parameter") \
                from None
        # a union field fails once per alternative: say what each alternative wanted
        top = (param or "").split(".")[0]
        msgs = list(dict.fromkeys((x["msg"] if p == param else f"{p}: {x['msg']}") for x in errors
                                  if (p := _param(data, x["loc"]) or "").split(".")[0] == top))
        raise ApiError(400, f"invalid value for '{param}': {'; or '.join(msgs)[:300]}", param, "invalid_value") \
            from None
    for name, default in _ONLY_DEFAULT.items():
        value = getattr(req, name, None)
        if not _is_default(value, default):
            raise ApiError(400, f"unsupported value for '{name}': {json.dumps(value)[:40]}; this server supports only "
                           f"{json.dumps(default)}", name, "unsupported_value")
    # as OpenAI and vLLM: never silently ignored
    if getattr(req, "stream_options", None) is not None and not req.stream:
        raise ApiError(400, "'stream_options' is only allowed with \"stream\": true; remove it or stream",
                       "stream_options", "invalid_value")
    return req
