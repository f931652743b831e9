"""OpenAI's Responses API (POST /v1/responses, GET /v1/responses/{id}) on the chat path: a request's `input` items,
`instructions` and tools become a ChatRequest that ChatCompletion prepares (templates, thinking, tool grammars, stop
ids, prefix reuse all as on /v1/chat/completions); the reply goes out as output items -- reasoning, message,
function_call -- whole or as Responses' typed SSE events. `previous_response_id` continues a conversation the server
keeps (a bounded LRU of recent responses; `store: false` keeps none)."""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, Literal

from pydantic import Field, field_validator

from ..events import FinishReason
from .exchange import ChatCompletion, Choice, State
from .blocks import Block, Blocks, Kind, Op, Step, reply_blocks
from .protocol import ApiError, ChatRequest, FunctionDef, StructuredOutputs, Strict, parse

RESPONSES_KEPT = 128        # stored responses (each holds its whole conversation): the oldest go first ...
RESPONSES_CHARS = 64 << 20  # ... and while they hold more characters of JSON than this together


class ReasoningSpec(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None     # the thought is returned whole, not summed up
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextSpec(Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None      # only the default: nothing here could make a reply terser


class FunctionTool(Strict):
    """Responses' flat function tool: {"type": "function", "name", "description", "parameters", "strict"} (the
    type first: a built-in tool, {"type": "web_search"}, is refused for its type)."""
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    _shallow = field_validator("parameters")(FunctionDef._shallow.__func__)


class ToolChoiceFunctionFlat(Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)


class ResponsesRequest(Strict):
    model: str
    input: str | list[dict]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceFunctionFlat | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    reasoning: ReasoningSpec | None = None
    text: TextSpec | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None        # an end-user id for the caller's records, as `user`
    prompt_cache_key: str | None = None         # a caching hint: this server's prefix reuse needs none
    truncation: Literal["disabled"] | None = None       # "auto" (dropping old turns to fit) is not done
    # what Codex-style clients ask for to send a thought back next turn: the reasoning items here carry it in
    # clear text (nothing is encrypted), and sent back they restore it, so there is nothing more to include
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    # extensions the chat endpoint has (vLLM's and glmcore's names)
    seed: int | None = Field(None, ge=0, le=2**64 - 1)
    top_k: int | None = Field(None, ge=0, le=2**31 - 1)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=2**31 - 1)
    structured_outputs: StructuredOutputs | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    max_thinking_tokens: int | None = Field(None, ge=0, le=2**31 - 1)


class ResponseStore:
    """Recent responses by id, each with its conversation as chat messages (instructions excluded: a continued
    response does not inherit them), for previous_response_id and GET /v1/responses/{id}. An LRU bounded by a
    count and by characters; read from the preparing threads, written from the event loop: locked."""

    def __init__(self, kept: int = RESPONSES_KEPT, chars: int = RESPONSES_CHARS):
        self.kept, self.chars, self.size = kept, chars, 0
        self.map: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()
        self.lock = threading.Lock()

    def put(self, response: dict, messages: list[dict]) -> None:
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(messages, ensure_ascii=False))
        with self.lock:
            self.map[response["id"]] = (response, messages, size)
            self.size += size
            while len(self.map) > self.kept or self.size > self.chars:
                self.size -= self.map.popitem(last=False)[1][2]

    def get(self, response_id: str, param: str = "previous_response_id") -> tuple[dict, list[dict]]:
        with self.lock:
            if response_id not in self.map:
                raise ApiError(404, f"no stored response has the id {response_id[:60]!r} (this server keeps the last "
                               f"{self.kept} responses made with store true); send the whole conversation in 'input'",
                               param, "response_not_found")
            self.map.move_to_end(response_id)
            return self.map[response_id][:2]

    def delete(self, response_id: str) -> None:
        self.get(response_id, "response_id")         # a 404 for an id not held
        with self.lock:
            entry = self.map.pop(response_id, None)
            self.size -= entry[2] if entry else 0


def _part_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"'{where}' is neither a string nor a list of content parts", where, "invalid_value")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "summary_text", "reasoning_text") \
                or not isinstance(part.get("text"), str):
            raise ApiError(400, f"'{where}.{j}': content part type {kind!r} is not supported: this model reads text "
                           "parts only ({\"type\": \"input_text\", \"text\": ...})", f"{where}.{j}",
                           "unsupported_value")
        out.append(part["text"])
    return "".join(out)


def _field(item: dict, name: str, where: str, kind=str):
    value = item.get(name)
    if not isinstance(value, kind):
        raise ApiError(400, f"'{where}.{name}' is {'missing' if value is None else 'not a ' + kind.__name__}",
                       f"{where}.{name}", "invalid_value")
    return value


def input_messages(items: str | list[dict]) -> list[dict]:
    """Responses input items as chat messages: a function_call joins the assistant turn before it, a reasoning
    item becomes the next assistant turn's reasoning_content, a function_call_output a tool message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    thought: str | None = None

    def assistant() -> dict:
        nonlocal thought
        if not out or out[-1]["role"] != "assistant" or thought is not None:
            out.append({"role": "assistant", "content": None})
        if thought is not None:
            out[-1]["reasoning_content"], thought = thought, None
        return out[-1]

    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise ApiError(400, f"'{where}' is not an object; send input items", where, "invalid_value")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ApiError(400, f"'{where}.role' is {role!r}; use user, system, developer or assistant",
                               f"{where}.role", "invalid_value")
            text = _part_text(item.get("content"), f"{where}.content")
            if role == "assistant":
                msg = assistant()
                msg["content"] = (msg["content"] or "") + text
            else:
                out.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}}
            msg = assistant()
            msg.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                        "content": _part_text(output, f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            thought = (thought or "") + _part_text(parts, f"{where}.content")
        else:
            raise ApiError(400, f"'{where}': input item type {kind!r} is not supported (message, function_call, "
                           "function_call_output and reasoning are)", f"{where}.type", "unsupported_value")
    return out


def chat_request(store: ResponseStore, req: ResponsesRequest) -> tuple[ChatRequest, list[dict]]:
    """The ChatRequest for a Responses request, and the conversation to store (without the instructions)."""
    history = list(store.get(req.previous_response_id)[1]) if req.previous_response_id else []
    new = input_messages(req.input)
    if not new:
        raise ApiError(400, "'input' is empty; send a string or at least one item", "input", "invalid_value")
    history += new
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    for name in ("temperature", "top_p", "parallel_tool_calls", "user", "seed", "top_k", "repetition_penalty",
                 "ignore_eos", "min_tokens", "chat_template_kwargs", "max_thinking_tokens"):
        if name in req.model_fields_set:
            body[name] = getattr(req, name)
    if req.structured_outputs is not None:
        body["structured_outputs"] = req.structured_outputs.model_dump(by_alias=True, exclude_none=True)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude_unset=True, exclude={"type"})}
                         for t in req.tools]
    if req.tool_choice is not None:
        tc = req.tool_choice
        body["tool_choice"] = tc if isinstance(tc, str) else {"type": "function", "function": {"name": tc.name}}
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        rf: dict[str, Any] = {"type": fmt.type}
        if fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise ApiError(400, "text.format of type json_schema needs 'schema'", "text.format.schema",
                               "missing_required_parameter")
            rf["json_schema"] = {k: v for k, v in (("name", fmt.name or "response"), ("schema", fmt.schema_),
                                                   ("description", fmt.description), ("strict", fmt.strict))
                                 if v is not None}
        body["response_format"] = rf
    return parse(ChatRequest, json.dumps(body, ensure_ascii=False).encode()), history


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class CreateResponse(ChatCompletion):
    """POST /v1/responses."""
    endpoint, param, id_prefix = "responses", "input", "resp"

    def prepare(self, body: bytes):
        self.api = parse(ResponsesRequest, body)
        self.id = f"resp_{uuid.uuid4().hex}"
        chat, self.history = chat_request(self.state.responses, self.api)
        self.blocks, self.seq, self.response = Blocks(), 0, None
        return self.prepare_chat(chat)

    # ---- the response object and its items

    def item(self, block: Block, done: bool) -> dict:
        status = "completed" if done else "in_progress"
        if block.kind == Kind.CALL:
            return {"id": block.id, "type": "function_call", "call_id": block.call_id, "name": block.name,
                    "arguments": block.text if done else "", "status": status}
        if block.kind == Kind.REASONING:
            return {"id": block.id, "type": "reasoning", "summary": [],
                    "content": [self.part(block, done)] if done else [], "status": status}
        return {"id": block.id, "type": "message", "role": "assistant", "status": status,
                "content": [self.part(block, done)] if done else []}

    @staticmethod
    def part(block: Block, done: bool) -> dict:
        text = block.text if done else ""
        if block.kind == Kind.REASONING:
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def name_block(self, block: Block) -> Block:
        prefix = {Kind.CALL: "fc", Kind.REASONING: "rs", Kind.TEXT: "msg"}[block.kind]
        block.id = f"{prefix}_{uuid.uuid4().hex}"
        return block

    def body(self, status: str, blocks: list[Block], choices: list[Choice] | None) -> dict:
        api = self.api
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "model": self.state.name, "output": [self.item(b, True) for b in blocks], "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": api.instructions, "metadata": api.metadata or {},
               "previous_response_id": api.previous_response_id, "store": api.store,
               "parallel_tool_calls": api.parallel_tool_calls is not False,
               "tools": [t.model_dump(exclude_unset=True) for t in api.tools or []],
               "tool_choice": (api.tool_choice if isinstance(api.tool_choice, str) else
                               api.tool_choice.model_dump() if api.tool_choice else "auto"),
               "temperature": api.temperature, "top_p": api.top_p, "max_output_tokens": api.max_output_tokens,
               "reasoning": api.reasoning.model_dump() if api.reasoning else None,
               "text": {"format": {"type": "text"}}, "truncation": "disabled", "user": api.user, "usage": None}
        if api.text is not None:
            out["text"] = api.text.model_dump(by_alias=True, exclude_none=True)
        if choices is not None:
            out["completed_at"] = int(time.time())
            u = self.usage(choices)
            out["usage"] = {"input_tokens": u["prompt_tokens"],
                            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                            "output_tokens": u["completion_tokens"],
                            "output_tokens_details": {"reasoning_tokens": u.get("completion_tokens_details", {})
                                                      .get("reasoning_tokens", 0)},
                            "total_tokens": u["total_tokens"]}
        return out

    def status(self, choice: Choice) -> str:
        return "incomplete" if choice.gen.finish_reason(self.reply) == FinishReason.LENGTH else "completed"

    def final(self, choices: list[Choice]) -> dict:
        if self.response is None:            # sent whole: the reply's blocks, named now
            blocks = [self.name_block(b) for b in reply_blocks(self.reply)]
            self.response = self.body(self.status(choices[0]), blocks, choices)
        return self.response

    def finished(self, choice: Choice) -> None:
        super().finished(choice)
        if self.api.store:
            reply = {k: v for k, v in self.message(self.reply).items() if v is not None}
            self.state.responses.put(self.final([choice]), self.history + [reply])

    # ---- the stream

    def emit(self, kind: str, **data) -> str:
        self.seq += 1
        return _event(kind, {**data, "sequence_number": self.seq - 1})

    def sse_open(self, choices: list[Choice]) -> str:
        skeleton = self.body("in_progress", [], None)
        return self.emit("response.created", response=skeleton) + self.emit("response.in_progress", response=skeleton)

    def step(self, s: Step) -> str:
        b = s.block
        at = {"item_id": b.id, "output_index": b.index}
        if s.op == Op.OPEN:
            self.name_block(b)
            at["item_id"] = b.id
            out = self.emit("response.output_item.added", output_index=b.index, item=self.item(b, False))
            if b.kind != Kind.CALL:
                out += self.emit("response.content_part.added", **at, content_index=0, part=self.part(b, False))
            return out
        if s.op == Op.DELTA:
            if b.kind == Kind.CALL:
                return self.emit("response.function_call_arguments.delta", **at, delta=s.delta)
            if b.kind == Kind.REASONING:
                return self.emit("response.reasoning_text.delta", **at, content_index=0, delta=s.delta)
            return self.emit("response.output_text.delta", **at, content_index=0, delta=s.delta, logprobs=[])
        if b.kind == Kind.CALL:
            out = self.emit("response.function_call_arguments.done", **at, name=b.name, arguments=b.text)
        else:
            kind = "response.reasoning_text.done" if b.kind == Kind.REASONING else "response.output_text.done"
            extra = {} if b.kind == Kind.REASONING else {"logprobs": []}
            out = self.emit(kind, **at, content_index=0, text=b.text, **extra)
            out += self.emit("response.content_part.done", **at, content_index=0, part=self.part(b, True))
        return out + self.emit("response.output_item.done", output_index=b.index, item=self.item(b, True))

    def sse_events(self, choice: Choice, events) -> str:
        return "".join(self.step(s) for e in events for s in self.blocks.push(e))

    def sse_finish(self, choice: Choice) -> str:
        return ""                           # the one choice ends with the response (sse_close)

    def sse_close(self, choices: list[Choice]) -> str:
        out = "".join(self.step(s) for s in self.blocks.close())
        status = self.status(choices[0])
        self.response = self.body(status, self.blocks.blocks, choices)
        return out + self.emit(f"response.{status}", response=self.response)

    def sse_error(self, e: ApiError) -> str:
        return self.emit("error", code=e.code or e.type, message=e.message, param=e.param)

    stream_end = ""


def add_responses_routes(router, state: State, route) -> None:
    state.responses = ResponseStore()
    router.add_api_route("/responses", route(CreateResponse), methods=["POST"])

    @router.get("/responses/{response_id}")
    async def get_response(response_id: str):
        return state.responses.get(response_id, "response_id")[0]

    @router.delete("/responses/{response_id}")
    async def delete_response(response_id: str):
        state.responses.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}
