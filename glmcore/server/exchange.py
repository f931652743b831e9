"""The OpenAI-compatible exchanges: requests become scheduler Requests, the scheduler's tokens become JSON
or server-sent events. Chat formats and tool-call parsing are glmcore.chat's; this module only moves
events between the scheduler's thread and the event loop and writes OpenAI's shapes (the Responses and
Messages APIs, glmcore.server.responses and .anthropic, frame the same exchanges their own way). The ASGI app
that routes to them is glmcore.server.app."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..chat import Message, ToolCall, ToolCallStream, as_message
from ..errors import ContextOverflow, GlmcoreError, TokenizerError
from ..events import ChatEvent, FinishReason, ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEvent, ToolCallStart
from ..pipeline import chat_request
from ..sampling import TokenLogprob
from ..scheduler import QueueFull, Request as SchedRequest
from ..structured import GrammarError
from ..tokenizer import StreamDecoder
from .outputs import constrain_chat, constrain_completion, load_test_fields, request_grammar
from .inputs import (check_model, continuing, max_new, n_choices, prompt_chars, prompt_ids, sampling,
                     thinking_setup, to_messages, tool_setup)
from .protocol import ApiError, ChatRequest, CompletionRequest, parse

log = logging.getLogger("glmcore.server")
MAX_BODY = 4 << 20            # bytes; a request body over it is a 413
READ_TIMEOUT = 30.0           # seconds a request's head, and then its body, may take to arrive (408 after)
PREPARING = 4                 # requests rendered and tokenized at once, in worker threads
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses",
             "/v1/messages": "messages"}
REPLY_IDS_KEPT = 4096         # assistant replies whose generated ids are remembered for prefix reuse


class Metrics:
    """The Prometheus series of /metrics, on the app's own registry."""

    def __init__(self, scheduler):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("glmcore_requests", "HTTP requests by endpoint and status (an HTTP status, or "
                                "'disconnected' for a client that went away before the reply ended)",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("glmcore_prompt_tokens", "prompt tokens of submitted requests", registry=r)
        self.cached_tokens = Counter("glmcore_prompt_cached_tokens", "prompt tokens reused from a slot's cache or the "
                                     "prompt cache",
                                     registry=r)
        self.generated = Counter("glmcore_generation_tokens", "generated tokens", registry=r)
        Gauge("glmcore_queue_length", "requests waiting for a slot", registry=r).set_function(
            lambda: scheduler.queue_len)
        Gauge("glmcore_busy_slots", "slots running a request", registry=r).set_function(lambda: scheduler.busy_slots)
        Gauge("glmcore_slots", "slots of the batch session", registry=r).set(scheduler.batch.n_slots)
        Gauge("glmcore_draft_tokens", "speculative decoding: drafted tokens so far", registry=r).set_function(
            lambda: scheduler.drafted)
        Gauge("glmcore_draft_accepted_tokens", "speculative decoding: drafted tokens the model confirmed so far",
              registry=r).set_function(lambda: scheduler.accepted)
        self.ttft = Histogram("glmcore_time_to_first_token_seconds", "submission to first generated token",
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.itl = Histogram("glmcore_inter_token_latency_seconds", "time between two tokens of one reply",
                             buckets=(.005, .01, .02, .04, .08, .15, .3, .6, 1.2, 2.5, 5), registry=r)
        self.e2e = Histogram("glmcore_e2e_request_latency_seconds", "submission to the end of a request's generation",
                             buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        table = scheduler.table
        total = table.batch.n_slots * table.capacity
        Gauge("glmcore_kv_cache_positions", "KV-cache positions the slots hold (running and kept for reuse)",
              registry=r).set_function(lambda: sum(len(s.tokens) for s in table.slots))
        Gauge("glmcore_kv_cache_usage_ratio", "KV-cache positions held / all positions of the slots",
              registry=r).set_function(lambda: sum(len(s.tokens) for s in table.slots) / total)
        if table.cache is not None:
            r.register(PromptCacheCollector(table.cache))


class PromptCacheCollector:
    """The prompt cache's counters (kept by the engine's thread), read when /metrics is scraped."""

    def __init__(self, cache):
        self.cache = cache

    def collect(self):
        c, st = self.cache, self.cache.stats
        yield CounterMetricFamily("glmcore_prompt_cache_hits", "placements restored from the prompt cache",
                                  value=st.hits)
        yield CounterMetricFamily("glmcore_prompt_cache_misses", "placements for which the prompt cache held no "
                                  "longer prefix than the slots", value=st.misses)
        yield CounterMetricFamily("glmcore_prompt_cache_restored_tokens", "prompt tokens restored from the "
                                  "prompt cache instead of prefilled", value=st.restored_tokens)
        yield CounterMetricFamily("glmcore_prompt_cache_evictions", "entries dropped to stay within --cache-ram",
                                  value=st.evicted)
        yield GaugeMetricFamily("glmcore_prompt_cache_bytes", "bytes of KV the prompt cache holds", value=c.nbytes)
        yield GaugeMetricFamily("glmcore_prompt_cache_budget_bytes", "--cache-ram in bytes", value=c.budget)
        yield GaugeMetricFamily("glmcore_prompt_cache_entries", "sequences the prompt cache holds", value=len(c))


class ReplyIds:
    """Generated ids of recent assistant replies, keyed by the message as the client sends it back. The
    next turn encodes that message with these ids, so the conversation a slot holds stays a prefix of the
    new prompt (re-encoding the text can give other ids) and only the new turn is prefilled."""

    def __init__(self, kept: int = REPLY_IDS_KEPT):
        self.kept, self.map = kept, OrderedDict()

    @staticmethod
    def key(m: Message) -> str:
        calls = [(c.name, json.dumps(c.arguments, sort_keys=True, ensure_ascii=False)) for c in m.tool_calls]
        return json.dumps([m.content or "", calls], ensure_ascii=False)

    def put(self, m: Message, ids: list[int]) -> None:
        k = self.key(m)
        self.map[k] = ids
        self.map.move_to_end(k)
        while len(self.map) > self.kept:
            self.map.popitem(last=False)

    def get(self, m: Message) -> list[int] | None:
        return self.map.get(self.key(m))


class StopStrings:
    """OpenAI's `stop`: text is held back while it could be the start of a stop string (so one split
    across tokens is still caught), and nothing from the first match on is ever emitted."""

    def __init__(self, stops: list[str]):
        self.stops, self.held = stops, ""
        self.matched: str | None = None     # the stop string that ended the text (Anthropic's stop_sequence)

    def push(self, text: str) -> tuple[str, bool]:
        """(text now certain, whether a stop string matched)."""
        if not self.stops:
            return text, False
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held, at = "", min(hits)
            self.matched = next(s for s in self.stops if buf.find(s) == at)
            return buf[:at], True
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(buf) + 1)) if buf.endswith(s[:k])),
                   default=0)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


class PlainText:
    """The parser of /v1/completions: decoded text, nothing else (no chat format, no tool calls)."""

    def __init__(self, tokenizer):
        self.decoder = StreamDecoder(tokenizer)

    def push(self, token: int) -> list[TextDelta]:
        text = self.decoder.push(token)
        return [TextDelta(text)] if text else []

    def close(self) -> list[TextDelta]:
        text = self.decoder.flush()
        return [TextDelta(text)] if text else []


class NoText:
    """The parser of a request that only scores its prompt (max_tokens 0): the token the engine draws is not shown."""

    def push(self, token: int) -> list:
        return []

    def close(self) -> list:
        return []


class Reply:
    """Parser events of one reply after stop strings and parallel_tool_calls=false are applied."""

    def __init__(self, parser, stops: list[str], one_call: bool = False):
        self.parser, self.stops, self.one_call = parser, StopStrings(stops), one_call
        self.text: list[str] = []
        self.thought: list[str] = []      # a thinking model's reasoning (stop strings apply to the answer only)
        self.calls: list[ToolCall] = []
        self.cut = False           # ended early by a stop string or the one allowed call

    def _take(self, events: list[ChatEvent]) -> list[ChatEvent]:
        out = []
        for event in events:
            if self.cut:
                break
            if isinstance(event, TextDelta):
                text, self.cut = self.stops.push(event.text)
                if text:
                    self.text.append(text)
                    out.append(TextDelta(text))
            elif isinstance(event, ReasoningDelta):
                self.thought.append(event.text)
                out.append(event)
            elif isinstance(event, ToolCallEvent):
                self.calls.append(event.call)
                out.append(event)
                self.cut = self.one_call
            else:                       # a call's name, a piece of its arguments
                out.append(event)
        return out

    def push(self, token: int) -> list[ChatEvent]:
        return self._take(self.parser.push(token))

    def close(self) -> list[ChatEvent]:
        out = self._take(self.parser.close())
        if not self.cut:
            tail = self.stops.flush()
            if tail:
                self.text.append(tail)
                out.append(TextDelta(tail))
        return out

    @property
    def content(self) -> str:
        return "".join(self.text)

    @property
    def reasoning(self) -> str:
        return "".join(self.thought)


class Generation:
    """One request on the scheduler; its tokens cross from the scheduler's thread to the event loop."""

    def __init__(self, state: "State", request: SchedRequest, param: str, leader: "Generation | None" = None):
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.request, self.metrics, self.param = request, state.metrics, param
        self._t0, self._last = time.perf_counter(), 0.0

        def on_token(_handle, token):        # the scheduler's thread
            now = time.perf_counter()
            if token is not None:
                (self.metrics.itl if self._last else self.metrics.ttft).observe(now - (self._last or self._t0))
                self._last = now
            else:
                self.metrics.e2e.observe(now - self._t0)
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, token)
            except RuntimeError:             # the loop is closed: the server is gone
                pass

        try:
            self.handle = state.scheduler.submit(request, on_token, leader.handle if leader else None)
        except QueueFull as e:
            raise ApiError(429, f"the server is busy: {e}", code="rate_limit_exceeded", type="rate_limit_error",
                           headers={"Retry-After": str(state.retry_after)}) from None
        except ContextOverflow as e:
            raise ApiError(400, f"'{param}': {e}", param, "context_length_exceeded") from None
        except GlmcoreError as e:
            raise ApiError(400, f"'{param}': {e}", param) from None
        self.metrics.prompt_tokens.inc(len(request.prompt))

    async def tokens(self) -> AsyncIterator[int]:
        while (token := await self.queue.get()) is not None:
            yield token
        h = self.handle
        self.metrics.cached_tokens.inc(h.timings.cached_tokens)
        self.metrics.generated.inc(len(h.tokens))
        if h.finish_reason == FinishReason.ERROR:
            if isinstance(h.error, GrammarError):       # the request's grammar allows no next token
                field = getattr(self.request.constraint, "field", None) or self.param
                raise ApiError(400, f"'{field}': {h.error}", field, "grammar_dead_end")
            if isinstance(h.error, ContextOverflow):
                raise ApiError(400, f"'{self.param}': {h.error}", self.param, "context_length_exceeded")
            raise ApiError(500, f"generation failed: {h.error}", type="server_error", code="backend_error")

    def cancel(self) -> None:
        self.handle.cancel()

    def finish_reason(self, reply: Reply) -> FinishReason:
        if not reply.cut and self.handle.finish_reason == FinishReason.LENGTH:
            return FinishReason.LENGTH
        return FinishReason.TOOL_CALLS if reply.calls else FinishReason.STOP


class State:
    def __init__(self, model, name: str, api_key: str | None, max_body: int, retry_after: int,
                 read_timeout: float = READ_TIMEOUT, thinking_budget: int | None = None):
        self.model, self.name, self.api_key, self.max_body = model, name, api_key, max_body
        self.thinking_budget = thinking_budget      # a thought's tokens when a request names no budget
        self.scheduler = model.scheduler
        self.retry_after, self.read_timeout = retry_after, read_timeout
        self.metrics = Metrics(self.scheduler)
        self.reply_ids = ReplyIds()
        self.created = int(time.time())
        # the longest token in bytes: a text of more characters than capacity * this cannot fit the context,
        # so such a prompt is refused before it is rendered or tokenized
        tok = model.tokenizer
        self.max_token_bytes = max(1, max(len(tok.token_bytes(i)) for i in range(tok.n_vocab)))
        self._preparing: asyncio.Semaphore | None = None

    async def prepare(self, fn, *args):
        """Run fn (parsing, template rendering, tokenization: CPU work that grows with the request) in a
        worker thread, a few at a time, so the event loop -- /health, streams, other clients -- never waits on it."""
        if self._preparing is None:
            self._preparing = asyncio.Semaphore(PREPARING)
        async with self._preparing:
            return await asyncio.to_thread(_as_exception, fn, *args)

    def token_text(self, token: int) -> bytes:
        """A token as logprobs and /tokenize show it: its bytes, a special token's name."""
        tok = self.model.tokenizer
        name = tok.special_names.get(token)
        return name.encode() if name is not None else tok.token_bytes(token)

    def check_size(self, chars: int, param: str) -> None:
        """Refuse, before any expansion, a prompt whose text alone is longer than the context could hold."""
        limit = self.scheduler.capacity * self.max_token_bytes
        if chars > limit:
            raise ApiError(400, f"'{param}' has {chars} characters, more than a context of {self.scheduler.capacity} "
                           f"tokens can hold (at most {self.max_token_bytes} characters a token); shorten it", param,
                           "context_length_exceeded")


def _as_exception(fn, *args):
    """fn(*args), with a BaseException that is not an Exception (pyo3's PanicException from a Rust library)
    raised as an Exception: the app's handler turns it into a counted 500 with OpenAI's error JSON."""
    try:
        return fn(*args)
    except (KeyboardInterrupt, SystemExit, Exception):
        raise
    except BaseException as e:
        raise RuntimeError(f"{type(e).__name__}: {str(e)[:200]}") from e


# ----------------------------------------------------------------------------- request -> scheduler

async def read_body(request: Request, limit: int, timeout: float = READ_TIMEOUT) -> bytes:
    """The body, JSON (415 otherwise), at most `limit` bytes, arrived within `timeout` seconds (a client dripping
    bytes holds a connection and a task; it gets a 408 and the connection is closed). JSON only: a browser sends
    a text/plain or form body to any origin without asking (a CORS "simple request"), application/json only
    after a preflight that this server answers only for --cors-origins."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise ApiError(415, f"the request body is {media or 'untyped'}; send JSON with the header "
                       "'Content-Type: application/json'", code="unsupported_media_type")
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise ApiError(413, f"the request body has {size} bytes; the limit is {limit}", code="request_too_large")
    body = bytearray()

    async def read():
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise ApiError(413, f"the request body exceeds the limit of {limit} bytes", code="request_too_large")
    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s; send it at once",
                       code="request_timeout", headers={"Connection": "close"}) from None
    return bytes(body)


# ----------------------------------------------------------------------------- responses

def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _call_json(call: ToolCall, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function",
           "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
    return out if index is None else {"index": index, **out}


MIN_LOGPROB = -9999.0          # what a masked token's -inf logprob is sent as (JSON has no -inf; vLLM's value)


@dataclass(eq=False)
class Choice:
    """One of a request's n sequences: its generation, its reply's parser, and the logprob entries of the
    tokens it has shown (`shown`) and not yet streamed (`pending`)."""
    index: int
    gen: "Generation"
    reply: Reply
    seen: int = 0                       # tokens received
    shown: list[TokenLogprob] = field(default_factory=list)
    pending: list[TokenLogprob] = field(default_factory=list)
    offset: int = 0                     # /v1/completions' text_offset of the next token

    def push(self, token: int) -> list[ChatEvent]:
        """The token's events; its logprob entry is kept when its request asks and the reply is not cut yet."""
        lps, self.seen = self.gen.handle.logprobs, self.seen + 1
        if self.seen <= len(lps) and not self.reply.cut:
            self.shown.append(lps[self.seen - 1])
            self.pending.append(lps[self.seen - 1])
        return self.reply.push(token)

    def ended(self) -> None:
        """The generation is over: the stop id that ended it has a logprob entry too (not after a stop string)."""
        if not self.reply.cut:
            extra = self.gen.handle.logprobs[self.seen:]
            self.shown += extra
            self.pending += extra

    def take_pending(self) -> list[TokenLogprob]:
        out, self.pending = self.pending, []
        return out


class Exchange:
    """One request to an endpoint: prepared (parsed, rendered, tokenized: CPU work, in a worker thread) when it
    is made, then its events as OpenAI chunks (`chunk`), or the whole response (`final`). `serve` drives it."""
    endpoint: str              # the label in /metrics
    param: str                 # the field a prompt error names
    id_prefix: str
    n = 1                      # choices
    logprobs: int | None = None     # alternatives per token when the request asks for logprobs

    def __init__(self, state: State, body: bytes):
        self.state = state
        self.id, self.created = f"{self.id_prefix}-{uuid.uuid4().hex}", int(time.time())
        self.req = self.prepare(body)
        self.include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)

    def prepare(self, body: bytes):
        """The parsed request; sets self.sreq (the scheduler Request), self.reply (its parser), self.n."""
        raise NotImplementedError

    def new_reply(self) -> Reply:
        """A fresh parser for another choice."""
        raise NotImplementedError

    def requests(self) -> list[SchedRequest]:
        """One scheduler Request per choice: choice i draws with seed + i (so it equals a request with that
        seed alone), or each with a fresh seed when the request gives none; only choice 0 scores the prompt."""
        p = self.sreq.params
        return [self.sreq] + [dataclasses.replace(
            self.sreq, prompt_logprobs=None,
            params=p if p.seed is None else dataclasses.replace(p, seed=p.seed + i)) for i in range(1, self.n)]

    def chunk(self, event, finish, choice: Choice | None = None,
              logprobs: list[TokenLogprob] | None = None) -> list[dict]:
        """The chunks of one event of a choice (None: choice 0), with the logprob entries of its tokens."""
        raise NotImplementedError

    def final(self, choices: list[Choice]) -> dict:
        raise NotImplementedError

    def finished(self, choice: Choice) -> None:
        """The response went out whole."""

    def echo_chunks(self, choice: Choice, first: Choice) -> list[dict]:
        """What a stream sends of a choice before its first token's (the echoed prompt; `first` scored it)."""
        return []

    def usage(self, choices: list[Choice]) -> dict:
        return usage(choices)

    def token_text(self, token: int) -> bytes:
        return self.state.token_text(token)

    # a stream's framing: OpenAI's chunks by default; the Responses and Messages APIs frame their own events
    stream_end = "data: [DONE]\n\n"      # the stream's last line

    def sse_open(self, choices: list[Choice]) -> str:
        return "".join(_sse(chunk) for c in choices for chunk in self.chunk(None, None, c))

    def sse_echo(self, choice: Choice, first: Choice) -> str:
        return "".join(map(_sse, self.echo_chunks(choice, first)))

    def sse_events(self, choice: Choice, events: list[ChatEvent]) -> str:
        """A choice's events as chunks; the logprobs of its tokens so far ride on the first one."""
        out = []
        for e in events:
            for chunk in self.chunk(e, None, choice, choice.pending or None):
                choice.pending = []
                out.append(_sse(chunk))
        return "".join(out)

    def sse_finish(self, choice: Choice) -> str:
        """A choice's last chunk: its finish reason (and the logprobs still pending)."""
        return "".join(map(_sse, self.chunk(None, choice.gen.finish_reason(choice.reply), choice,
                                            choice.take_pending() or None)))

    def sse_close(self, choices: list[Choice]) -> str:
        """After every choice finished: the usage chunk where the request asked for it."""
        return _sse({**self.chunk(None, None)[0], "choices": [], "usage": self.usage(choices)}) \
            if self.include_usage else ""

    def sse_error(self, e: ApiError) -> str:
        """A failure after the stream began, told in the stream."""
        return _sse(e.body())

    def _chunks(self, kind: str, choices: list[dict]) -> list[dict]:
        out = [{"id": self.id, "object": kind, "created": self.created, "model": self.state.name, "choices": [c]}
               for c in choices]
        return [{**o, "usage": None} for o in out] if self.include_usage else out


def usage(choices: list[Choice], reasoning_tokens: int | None = None) -> dict:
    """The prompt counted once (the choices share it), the generated tokens of every choice summed."""
    h = choices[0].gen.handle
    n_prompt, n_new = len(choices[0].gen.request.prompt), sum(len(c.gen.handle.tokens) for c in choices)
    out = {"prompt_tokens": n_prompt, "completion_tokens": n_new, "total_tokens": n_prompt + n_new,
           "prompt_tokens_details": {"cached_tokens": h.timings.cached_tokens}}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


class ChatCompletion(Exchange):
    """POST /v1/chat/completions."""
    endpoint, param, id_prefix = "chat", "messages", "chatcmpl"

    def prepare(self, body: bytes):
        return self.prepare_chat(parse(ChatRequest, body))

    def prepare_chat(self, req: ChatRequest) -> ChatRequest:
        """Everything after parsing: the Responses and Messages APIs translate their requests into a ChatRequest
        and come here, so templates, thinking, tool grammars, stop strings and prefix reuse are the chat path's."""
        state = self.state
        check_model(state, req.model)
        kwargs, budget = thinking_setup(state, state.model.chat_format, req)
        try:
            fmt = state.model.chat_format.configured(kwargs)
        except GlmcoreError as e:
            raise ApiError(400, str(e), "chat_template_kwargs", "invalid_value") from None
        if not req.add_generation_prompt and not req.continue_final_message:
            raise ApiError(400, "'add_generation_prompt' false is supported with \"continue_final_message\": true "
                           "(the reply continues the last assistant message); drop it", "add_generation_prompt",
                           "unsupported_value")
        fmt = self.fmt = continuing(fmt, req)
        messages = to_messages(state, req)
        tools, calls, must_call = tool_setup(fmt, req)
        if fmt.continue_final:
            budget = None           # the template closed the turn's thinking before the text it continues
            if must_call or request_grammar(req)[0] is not None:
                raise ApiError(400, "a reply that continues the last message is free text: it cannot also be forced "
                               "into a tool call or a response format; drop one", "continue_final_message",
                               "invalid_value")
            messages[-1].ids = None     # its text is continued as written, not a stored reply's ids
        params, stops = sampling(req, state.model), req.stops()
        state.check_size(prompt_chars(messages, tools), "messages")
        if len(messages) > state.scheduler.capacity:   # every message is at least its role token
            raise ApiError(400, f"'messages' holds {len(messages)} messages, more than a context of "
                           f"{state.scheduler.capacity} tokens can hold; send fewer", "messages",
                           "context_length_exceeded")
        try:
            sreq = self.sreq = chat_request(fmt, messages, tools, params)
        except TokenizerError as e:                 # the checkpoint's tokenizer, not the request, is broken
            raise ApiError(500, f"the model's tokenizer failed on this request: {e}", type="server_error",
                           code="tokenizer_error") from None
        except GlmcoreError as e:
            raise ApiError(400, str(e), "messages") from None
        except (ValueError, UnicodeError) as e:     # a tokenizer refusing text the protocol let through
            raise ApiError(400, f"'messages' cannot be tokenized ({str(e)[:80]}); send plain Unicode text",
                           "messages") from None
        # one function: its name line goes into the prompt; several, strict tools, response_format, a thinking
        # budget: a grammar in the format's own call syntax
        self.opening = constrain_chat(state.model, req, sreq, tools, must_call, calls, fmt, budget)
        sreq.max_new_tokens = max_new(state, req, len(sreq.prompt))
        load_test_fields(req, sreq)
        self.n = n_choices(state, req)
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "'top_logprobs' needs \"logprobs\": true; set it, or drop top_logprobs", "top_logprobs",
                           "invalid_value")
        self.logprobs = sreq.logprobs = (req.top_logprobs or 0) if req.logprobs else None
        self._reply = (tools, calls, stops, req.parallel_tool_calls is False)
        self.reply = self.new_reply()
        self.parser = self.reply.parser
        return req

    def new_reply(self) -> Reply:
        tools, calls, stops, one_call = self._reply
        parser = ToolCallStream(self.fmt, tools, calls=calls)
        for t in self.opening:     # the forced opening (a name line, an empty metadata line) goes to the parser too
            parser.push(t)
        return Reply(parser, stops, one_call=one_call)

    def message(self, reply: Reply) -> dict:
        msg = {"role": "assistant", "content": reply.content or (None if reply.calls else "")}
        if self.fmt.thinking:      # vLLM's reasoning-parser field: the thinking, null when there was none
            msg["reasoning_content"] = reply.reasoning or None
        if reply.calls:
            msg["tool_calls"] = [_call_json(c) for c in reply.calls]
        return msg

    def chunk(self, event, finish, choice: Choice | None = None,
              logprobs: list[TokenLogprob] | None = None) -> list[dict]:
        if event is None:
            delta = {} if finish else {"role": "assistant", "content": ""}
        elif isinstance(event, TextDelta):
            delta = {"content": event.text}
        elif isinstance(event, ReasoningDelta):
            delta = {"reasoning_content": event.text}
        elif isinstance(event, ToolCallStart):      # as OpenAI streams a call: index, id and name, then arguments
            delta = {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                     "function": {"name": event.name, "arguments": ""}}]}
        elif isinstance(event, ToolCallDelta):
            delta = {"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]}
        else:                      # ToolCallEvent: its name and arguments went out already
            return []
        return self._chunks("chat.completion.chunk", [{"index": choice.index if choice else 0, "delta": delta,
                                                       "logprobs": self.logprobs_json(logprobs),
                                                       "finish_reason": finish}])

    def logprobs_json(self, entries: list[TokenLogprob] | None) -> dict | None:
        """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs}]}, one entry per token."""
        if self.logprobs is None or entries is None:
            return None

        def one(token: int, logprob: float) -> dict:
            b = self.token_text(token)
            return {"token": b.decode("utf-8", "replace"), "logprob": _logprob(logprob), "bytes": list(b)}
        return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in entries]}

    def usage(self, choices):
        return usage(choices, sum(c.reply.parser.reasoning_tokens for c in choices) if self.fmt.thinking else None)

    def final(self, choices):
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.state.name,
                "choices": [{"index": c.index, "message": self.message(c.reply), "logprobs": self.logprobs_json(c.shown),
                             "finish_reason": c.gen.finish_reason(c.reply)} for c in choices],
                "usage": self.usage(choices)}

    def finished(self, choice):
        # only a reply sent back whole: one cut by a stop string has generated ids past its text
        reply, h = choice.reply, choice.gen.handle
        # (a continued message's reply is its end only: the conversation's turn is the client's text and it)
        if (not reply.cut and not reply.parser.errors and h.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
                and not self.fmt.continue_final):
            self.state.reply_ids.put(as_message(self.message(reply)), self.opening + list(h.tokens))


class TextCompletion(Exchange):
    """POST /v1/completions."""
    endpoint, param, id_prefix = "completions", "prompt", "cmpl"

    def prepare(self, body: bytes):
        state = self.state
        req = parse(CompletionRequest, body)
        check_model(state, req.model)
        ids = prompt_ids(state, req.prompt)
        self.score_only = req.max_tokens == 0
        if self.score_only and not req.echo:
            raise ApiError(400, "'max_tokens' 0 generates nothing: it only scores the prompt, with \"echo\": true; "
                           "set echo or ask for a token", "max_tokens", "invalid_value")
        self.sreq = SchedRequest(ids, sampling(req, state.model),
                                 1 if self.score_only else max_new(state, req, len(ids)), [state.model.tokenizer.eos_id])
        constrain_completion(state.model, req, self.sreq)
        load_test_fields(req, self.sreq)
        self.n = n_choices(state, req)
        self.logprobs = req.logprobs
        self.sreq.logprobs = None if self.score_only else req.logprobs
        self.echo = bool(req.echo)
        if self.echo:     # the prompt as sent (text), or its ids decoded; with logprobs, each prompt token's
            self.prompt_text = req.prompt if isinstance(req.prompt, str) else \
                req.prompt[0] if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str) \
                else state.model.tokenizer.decode(ids, skip_special=False)
            self.sreq.prompt_logprobs = req.logprobs
        self._stops = req.stops()
        self.reply = self.new_reply()
        return req

    def new_reply(self) -> Reply:
        return Reply(NoText() if self.score_only else PlainText(self.state.model.tokenizer), self._stops)

    def usage(self, choices):
        out = usage(choices)
        if self.score_only:          # the one token drawn is not part of the answer
            out.update(completion_tokens=0, total_tokens=out["prompt_tokens"])
        return out

    def chunk(self, event, finish, choice: Choice | None = None,
              logprobs: list[TokenLogprob] | None = None) -> list[dict]:
        return self._chunks("text_completion", [{"index": choice.index if choice else 0,
                                                 "text": event.text if event else "",
                                                 "logprobs": self.logprobs_json(choice, logprobs),
                                                 "finish_reason": finish}])

    def echoed(self, choice: Choice, first: Choice) -> tuple[str, dict | None]:
        """The echoed prompt's text and logprobs (its first token has none: nothing predicts it), which the first
        choice scored for all (the others copied its cache)."""
        if self.logprobs is None:
            return self.prompt_text, None
        entries, prompt = first.gen.handle.prompt_logprobs, first.gen.request.prompt
        full = [e if e is not None else TokenLogprob(prompt[0], float("nan")) for e in entries]
        lp = self.logprobs_json(choice, full)
        lp["token_logprobs"][0] = lp["top_logprobs"][0] = None
        return self.prompt_text, lp

    def echo_chunks(self, choice: Choice, first: Choice) -> list[dict]:
        if not self.echo:
            return []
        text, lp = self.echoed(choice, first)
        return self._chunks("text_completion", [{"index": choice.index, "text": text, "logprobs": lp,
                                                 "finish_reason": None}])

    def logprobs_json(self, choice: Choice | None, entries: list[TokenLogprob] | None) -> dict | None:
        """OpenAI's legacy shape: tokens, token_logprobs, top_logprobs ({token: logprob}, the sampled token
        included) and text_offset (each token's offset in the returned text)."""
        if self.logprobs is None or entries is None or choice is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            text = self.token_text(e.token).decode("utf-8", "replace")
            top = {self.token_text(t).decode("utf-8", "replace"): _logprob(lp) for t, lp in e.top}
            top.setdefault(text, _logprob(e.logprob))
            out["tokens"].append(text)
            out["token_logprobs"].append(_logprob(e.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(choice.offset)
            choice.offset += len(text)
        return out

    def final(self, choices):
        out = []
        for c in choices:
            text, lp = (self.echoed(c, choices[0]) if self.echo else ("", None))
            gen = self.logprobs_json(c, c.shown)
            if lp is not None and gen is not None:
                for k in lp:
                    lp[k] += gen[k]
            out.append({"index": c.index, "text": text + c.reply.content, "logprobs": lp if lp is not None else gen,
                        "finish_reason": c.gen.finish_reason(c.reply)})
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.state.name,
                "choices": out, "usage": self.usage(choices)}


ROUTES = {"/chat/completions": ChatCompletion, "/completions": TextCompletion}     # under /v1, POST


async def _cancel_on_disconnect(request: Request, choices: list[Choice]) -> None:
    """A non-streamed request whose client went away stops generating and frees its slots."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for c in choices:
        c.gen.cancel()


async def _tokens(choices: list[Choice]) -> AsyncIterator[tuple[Choice, int]]:
    """The tokens of every choice as they come, each with its choice; a failed choice's ApiError is raised."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice) -> None:
        try:
            async for token in c.gen.tokens():
                await merged.put((c, token))
            await merged.put((c, None))
        except ApiError as e:
            await merged.put((c, e))
    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        left = len(choices)
        while left:
            c, item = await merged.get()
            if isinstance(item, ApiError):
                raise item
            if item is None:
                left -= 1
            else:
                yield c, item
    finally:
        for t in tasks:
            t.cancel()


def _start(state: State, ex: Exchange) -> list[Choice]:
    """Queue the exchange's n choices: the first prefills the prompt, the others follow it and copy its cache."""
    choices: list[Choice] = []
    try:
        for i, sreq in enumerate(ex.requests()):
            gen = Generation(state, sreq, ex.param, choices[0].gen if choices else None)
            choices.append(Choice(i, gen, ex.reply if i == 0 else ex.new_reply()))
    except ApiError:
        for c in choices:
            c.gen.cancel()
        raise
    return choices


async def serve_exchange(state: State, request: Request, kind: type[Exchange]):
    """One request to an endpoint: its body read and prepared, queued (n choices), driven to a JSON response or
    an SSE stream; counted in /metrics."""
    metrics, endpoint = state.metrics, kind.endpoint
    try:
        body = await read_body(request, state.max_body, state.read_timeout)
        ex = await state.prepare(kind, state, body)
        choices = _start(state, ex)
    except ApiError as e:
        metrics.requests.labels(endpoint, str(e.status)).inc()
        raise
    if not ex.req.stream:
        watcher = asyncio.create_task(_cancel_on_disconnect(request, choices))
        try:
            async for c, token in _tokens(choices):
                c.push(token)
                if c.reply.cut:
                    c.gen.cancel()     # the rest of the stream is drained, so usage counts what was made
            for c in choices:
                c.reply.close()
                c.ended()
        except ApiError as e:
            metrics.requests.labels(endpoint, str(e.status)).inc()
            raise
        finally:
            watcher.cancel()
            for c in choices:
                if not c.gen.handle.done:
                    c.gen.cancel()
        if any(c.gen.handle.finish_reason == FinishReason.CANCELLED and not c.reply.cut for c in choices):
            metrics.requests.labels(endpoint, "disconnected").inc()
            return Response(status_code=499)
        metrics.requests.labels(endpoint, "200").inc()
        for c in choices:
            ex.finished(c)
        return JSONResponse(ex.final(choices))

    async def events():
        status = "disconnected"
        try:
            yield ex.sse_open(choices)
            echo = {c.index for c in choices}
            async for c, token in _tokens(choices):
                if c.index in echo:
                    echo.discard(c.index)
                    yield ex.sse_echo(c, choices[0])
                yield ex.sse_events(c, c.push(token))
                if c.reply.cut:
                    c.gen.cancel()     # the tokens still in flight are drained, never sent
            for c in choices:
                tail = ex.sse_echo(c, choices[0]) if c.index in echo else ""
                yield tail + ex.sse_events(c, c.reply.close())
                c.ended()
                yield ex.sse_finish(c)
            yield ex.sse_close(choices)
            status = "200"
            for c in choices:
                ex.finished(c)
        except ApiError as e:          # the generation failed after the stream began: say so in the stream
            status = str(e.status)
            yield ex.sse_error(e)
        except Exception as e:         # a bug after the stream began: the log has it, the client a 500 event
            log.exception("internal error")
            status = "500"
            yield ex.sse_error(ApiError(500, f"internal error ({type(e).__name__}); see the server log",
                                          type="server_error"))
        finally:
            for c in choices:
                if not c.gen.handle.done:
                    c.gen.cancel()
            metrics.requests.labels(endpoint, status).inc()
        if ex.stream_end:
            yield ex.stream_end

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
