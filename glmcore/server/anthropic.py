"""Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens) on the chat path: content blocks
(text, tool_use, tool_result, thinking), `system`, tools and `thinking` become a ChatRequest that ChatCompletion
prepares, so templates, thinking budgets, tool grammars, stop strings and prefix reuse are the chat endpoint's; the
reply goes out as content blocks (thinking, text, tool_use), whole or as Anthropic's SSE events. Errors on these
routes have Anthropic's shape {"type": "error", "error": {"type", "message"}}."""
from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal, Union

from fastapi import Request
from pydantic import Field, field_validator

from ..events import FinishReason
from .exchange import ChatCompletion, Choice, State, read_body
from .blocks import Block, Blocks, Kind, Op, Step, reply_blocks
from .protocol import MAX_SCHEMA_DEPTH, MAX_STOPS, ApiError, ChatRequest, Strict, parse, value_depth

ANTHROPIC_PREFIX = "/v1/messages"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def anthropic_error(status: int, body: dict) -> dict:
    """OpenAI's error JSON (what ApiError and the app's handler make) in Anthropic's shape."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error" if status >= 500 else
                                                               "invalid_request_error"),
                                       "message": body["error"]["message"]}}


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: dict | None = None      # a caching hint: this server's prefix reuse needs none
    citations: list | None = None


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str = Field(min_length=1, max_length=256)
    input: dict
    cache_control: dict | None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict | None = None


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None           # this server signs nothing: what it returns is the thought as written


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
                         Field(discriminator="type")]


class MessageParam(Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolParam(Strict):
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict
    strict: bool | None = None
    cache_control: dict | None = None

    @field_validator("input_schema")
    @classmethod
    def _shallow(cls, v):
        if value_depth(v) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the schema is nested deeper than {MAX_SCHEMA_DEPTH} levels; flatten it")
        return v


class ToolChoiceParam(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, min_length=1, max_length=256)
    disable_parallel_tool_use: bool | None = None


class ThinkingParam(Strict):
    type: Literal["enabled", "adaptive", "disabled"]      # adaptive: the model's own thought, no budget named
    budget_tokens: int | None = Field(None, ge=0, le=2**31 - 1)
    display: Literal["summarized"] | None = None        # the thought is returned (whole: nothing here sums it up)


class CountTokensRequest(Strict):
    model: str
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None


class Metadata(Strict):
    user_id: str | None = None


class JsonOutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")

    _shallow = field_validator("schema_")(ToolParam._shallow.__func__)


class OutputConfig(Strict):
    """Structured output (`format`, what the SDK's messages.parse sends) through the chat path's response_format
    grammar. `effort` has no counterpart in a GLM (its thought is on or off, with a budget): not accepted."""
    format: JsonOutputFormat | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=2**31 - 1)
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=2**31 - 1)
    metadata: Metadata | None = None
    seed: int | None = Field(None, ge=0, le=2**64 - 1)     # glmcore's extension, as on the chat endpoint
    output_config: OutputConfig | None = None
    cache_control: dict | None = None      # a caching hint: this server's prefix reuse needs none


def _text(content: str | list[TextBlock] | None) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content or [])


def chat_messages(req: CountTokensRequest) -> list[dict]:
    """The conversation as chat messages: a user turn's tool_result blocks become tool messages (in order, before
    its text), an assistant turn's thinking its reasoning_content, its tool_use blocks its tool_calls."""
    out = [{"role": "system", "content": _text(req.system)}] if req.system else []
    for i, m in enumerate(req.messages):
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if m.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(b.text for b in blocks
                                                                         if isinstance(b, TextBlock))}
            thought = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
            if thought:
                msg["reasoning_content"] = thought
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                     for b in blocks if isinstance(b, ToolUseBlock)]
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        text = []
        for j, b in enumerate(blocks):
            if isinstance(b, ToolResultBlock):
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)})
            elif isinstance(b, TextBlock):
                text.append(b.text)
            else:
                raise ApiError(400, f"messages.{i}.content.{j}: a user message holds no {b.type} block; it belongs "
                               "in an assistant message", f"messages.{i}.content.{j}", "invalid_value")
        if text:
            out.append({"role": "user", "content": "".join(text)})
    return out


def chat_request(state: State, req: CountTokensRequest) -> ChatRequest:
    fmt = state.model.chat_format
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req), "stream": getattr(req, "stream", False)}
    if req.messages and req.messages[-1].role == "assistant":      # a prefill: the reply continues its text
        body.update(continue_final_message=True, add_generation_prompt=False)
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        if len(req.stop_sequences or []) > MAX_STOPS:
            raise ApiError(400, f"'stop_sequences' has {len(req.stop_sequences)} strings; at most {MAX_STOPS} are "
                           "allowed", "stop_sequences", "invalid_value")
        for name, value in (("temperature", req.temperature), ("top_p", req.top_p), ("top_k", req.top_k),
                            ("seed", req.seed), ("stop", req.stop_sequences),
                            ("user", req.metadata.user_id if req.metadata else None)):
            if value is not None:
                body[name] = value
        if req.output_config is not None and req.output_config.format is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": req.output_config.format.schema_}}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema} | (
            {"description": t.description} if t.description is not None else {}) | (
            {"strict": t.strict} if t.strict is not None else {})} for t in req.tools]
    tc = req.tool_choice
    if tc is not None:
        if tc.type == "tool" and not tc.name:
            raise ApiError(400, "tool_choice of type 'tool' needs the tool's 'name'", "tool_choice.name",
                           "missing_required_parameter")
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type) or {
            "type": "function", "function": {"name": tc.name}}
        if tc.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    th = req.thinking
    if th is not None and th.type != "disabled":
        if not fmt.thinking:
            raise ApiError(400, f"'thinking' is {th.type}, but this {fmt.family} checkpoint's template writes no "
                           "<think>; drop it or disable it", "thinking", "unsupported_value")
        if th.type == "enabled":
            if th.budget_tokens is None:
                raise ApiError(400, "'thinking.budget_tokens' is required when thinking is enabled",
                               "thinking.budget_tokens", "missing_required_parameter")
            if isinstance(req, MessagesRequest) and th.budget_tokens >= req.max_tokens:
                raise ApiError(400, f"'max_tokens' ({req.max_tokens}) must be greater than 'thinking.budget_tokens' "
                               f"({th.budget_tokens})", "max_tokens", "invalid_value")
            body["max_thinking_tokens"] = th.budget_tokens
        elif th.budget_tokens is not None:
            raise ApiError(400, "'thinking.budget_tokens' goes with type 'enabled'; adaptive thinking names none",
                           "thinking.budget_tokens", "invalid_value")
        if fmt.thinking_switch:
            body["chat_template_kwargs"] = {"enable_thinking": True}
    elif th is not None and fmt.thinking:          # disabled: the template's switch, else a thought closed at once
        if fmt.thinking_switch:
            body["chat_template_kwargs"] = {"enable_thinking": False}
        else:
            body["max_thinking_tokens"] = 0
    return parse(ChatRequest, json.dumps(body, ensure_ascii=False).encode())


def _sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class AnthropicMessage(ChatCompletion):
    """POST /v1/messages."""
    endpoint, param, id_prefix = "messages", "messages", "msg"
    request_type = MessagesRequest

    def prepare(self, body: bytes):
        self.api = parse(self.request_type, body)
        self.id = f"msg_{uuid.uuid4().hex}"
        self.blocks = Blocks()
        return self.prepare_chat(chat_request(self.state, self.api))

    @staticmethod
    def block(b: Block, done: bool = True) -> dict:
        if b.kind == Kind.REASONING:
            return {"type": "thinking", "thinking": b.text if done else "", "signature": ""}
        if b.kind == Kind.TEXT:
            return {"type": "text", "text": b.text if done else ""}
        try:
            arguments = json.loads(b.text) if done and b.text else {}
        except ValueError:            # a call cut off mid-arguments (max_tokens): what could be read of it
            arguments = {}
        return {"type": "tool_use", "id": b.call_id, "name": b.name, "input": arguments}

    def stop(self, choice: Choice) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence)."""
        reply = self.reply
        if reply.calls:
            return "tool_use", None
        if reply.stops.matched is not None:
            return "stop_sequence", reply.stops.matched
        return ("max_tokens" if choice.gen.finish_reason(reply) == FinishReason.LENGTH else "end_turn"), None

    def usage_json(self, choices: list[Choice]) -> dict:
        u = self.usage(choices)
        cached = u["prompt_tokens_details"]["cached_tokens"]
        # Anthropic counts the prompt in parts: input_tokens is what was not read from the cache
        return {"input_tokens": u["prompt_tokens"] - cached, "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0, "output_tokens": u["completion_tokens"]}

    def skeleton(self, content: list[dict], stop_reason=None, stop_sequence=None, usage=None) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.state.name, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": usage or {"input_tokens": len(self.sreq.prompt), "output_tokens": 0}}

    def final(self, choices: list[Choice]) -> dict:
        return self.skeleton([self.block(b) for b in reply_blocks(self.reply)], *self.stop(choices[0]),
                             self.usage_json(choices))

    # ---- the stream

    def sse_open(self, choices: list[Choice]) -> str:
        return _sse("message_start", {"message": self.skeleton([])}) + _sse("ping", {})

    def step(self, s: Step) -> str:
        b = s.block
        if s.op == Op.OPEN:
            return _sse("content_block_start", {"index": b.index, "content_block": self.block(b, False)})
        if s.op == Op.CLOSE:
            return _sse("content_block_stop", {"index": b.index})
        delta = ({"type": "thinking_delta", "thinking": s.delta} if b.kind == Kind.REASONING else
                 {"type": "text_delta", "text": s.delta} if b.kind == Kind.TEXT else
                 {"type": "input_json_delta", "partial_json": s.delta})
        return _sse("content_block_delta", {"index": b.index, "delta": delta})

    def sse_events(self, choice: Choice, events) -> str:
        return "".join(self.step(s) for e in events for s in self.blocks.push(e))

    def sse_finish(self, choice: Choice) -> str:
        return ""                           # the one choice ends with the message (sse_close)

    def sse_close(self, choices: list[Choice]) -> str:
        out = "".join(self.step(s) for s in self.blocks.close())
        reason, sequence = self.stop(choices[0])
        out += _sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": self.usage_json(choices)})
        return out + _sse("message_stop", {})

    def sse_error(self, e: ApiError) -> str:
        return _sse("error", {"error": anthropic_error(e.status, e.body())["error"]})

    stream_end = ""


class CountTokens(AnthropicMessage):
    """POST /v1/messages/count_tokens: the prompt the chat path would run, counted (forced openings included)."""
    request_type = CountTokensRequest


def add_anthropic_routes(router, state: State, route) -> None:
    router.add_api_route("/messages", route(AnthropicMessage), methods=["POST"])

    @router.post("/messages/count_tokens")
    async def count_tokens(request: Request):
        ex = await state.prepare(CountTokens, state, await read_body(request, state.max_body, state.read_timeout))
        return {"input_tokens": len(ex.sreq.prompt)}
