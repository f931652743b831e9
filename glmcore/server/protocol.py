"""OpenAI's request shapes, checked, and its error JSON. A field the server does not know, or a value it
cannot honour (n > 1, logprobs, penalties), is a 400 that names it -- never silently ignored."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class FunctionCall(_Strict):
    name: str
    arguments: str | dict = "{}"


class ToolCallIn(_Strict):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class MessageIn(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None                # a participant's name; the GLM formats have no place for it
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


# Parameters OpenAI defines that this server accepts only at the value that means "off".
_ONLY_DEFAULT = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "logprobs": False, "top_logprobs": None,
                 "logit_bias": None, "best_of": 1, "echo": False, "suffix": None, "response_format": None}


class _Sampling(_Strict):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    user: str | None = None                # an end-user id for the caller's own records
    # extensions with vLLM's names (the sampler has them)
    top_k: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, gt=0)
    # only at their defaults (see _ONLY_DEFAULT)
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise ApiError(400, f"'stop' has {len(stops)} strings; at most 4 are allowed", "stop")
        if any(not s for s in stops):
            raise ApiError(400, "'stop' holds an empty string; remove it", "stop")
        return stops


class ChatRequest(_Sampling):
    messages: list[MessageIn]
    tools: list[dict] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: Any = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None


def parse(cls: type[_Sampling], body: bytes) -> _Sampling:
    """The request, or an ApiError naming the first field that is wrong."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({str(e)[:80]}); send a JSON object") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body is a JSON {type(data).__name__}; send a JSON object")
    try:
        req = cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if err["type"] == "extra_forbidden":
            raise ApiError(400, f"unsupported parameter '{param}': this server does not implement it; remove it",
                           param, "unsupported_parameter") from None
        if err["type"] == "missing":
            raise ApiError(400, f"missing required parameter '{param}'", param, "missing_required_parameter") \
                from None
        raise ApiError(400, f"invalid value for '{param}': {err['msg']}", param, "invalid_value") from None
    for name, default in _ONLY_DEFAULT.items():
        value = getattr(req, name, None)
        if value not in (None, default, {}) and not (name == "response_format" and value == {"type": "text"}):
            raise ApiError(400, f"unsupported value for '{name}': {json.dumps(value)[:40]}; this server supports only "
                           f"{json.dumps(default)}", name, "unsupported_value")
    return req
