"""The chat API: messages in, a message (text or tool calls) out, streaming, with the KV cache of
earlier turns reused so that a new turn prefills only its own tokens."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from .backend import LoadOptions
from .chat import Message, ToolCallStream, as_message
from .engine import Timings, WindowPolicy
from .scheduler import Request
from .model import LoadedModel, load_model
from .sampling import SamplingParams


class Pipeline:
    """Pipeline(model_dir, backend=...).chat(messages, stream=True) in the spirit of OpenVINO GenAI.

    `messages` is the whole conversation each time (OpenAI style). When it extends the conversation
    already in the cache, only the new messages are encoded and prefilled; otherwise the cache is reset.
    """

    def __init__(self, model: str | Path | None = None, backend: str | None = None,
                 options: LoadOptions | None = None, window: WindowPolicy | None = None,
                 loaded: LoadedModel | None = None):
        self.model = loaded or load_model(model, backend, options, window)
        self.cached: list[Message] = []      # the conversation the KV cache holds
        self.cached_tools = None
        self.timings = Timings()

    @property
    def context_full(self) -> bool:
        """The last reply stopped because the context was full (finish reason "length")."""
        return self.model.engine.context_full

    @property
    def finish_reason(self) -> str | None:
        """stop, length or cancelled: why the last reply ended."""
        return self.model.engine.finish_reason

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def reset(self) -> None:
        self.model.engine.reset()
        self.cached, self.cached_tools = [], None

    def _prompt_ids(self, messages: list[Message], tools) -> list[int]:
        fmt, engine = self.model.chat_format, self.model.engine
        n = len(self.cached)
        if n and tools == self.cached_tools and messages[:n] == self.cached and len(messages) > n:
            pending = engine.take_pending()     # the reply's last token, when it stopped on length
            if pending:
                engine.feed(pending)
            engine.mark_turn()
            return fmt.encode_continuation(messages[n:], sum(m.role == "user" for m in self.cached))
        self.reset()
        request = chat_request(fmt, messages, tools)
        engine.pinned = request.pinned
        engine.turn_starts = list(request.turn_starts)
        return list(request.prompt)

    def chat(self, messages, tools: list[dict] | None = None, stream: bool = False,
             params: SamplingParams | None = None, max_new_tokens: int = 256):
        """Returns the assistant Message, or with stream=True an iterator of ("text", str) and
        ("tool_call", ToolCall) events (the Message is then in self.cached[-1])."""
        events = self._events([as_message(m) for m in messages], tools, params or SamplingParams(), max_new_tokens)
        if stream:
            return events
        for _ in events:
            pass
        return self.cached[-1]

    def _events(self, messages: list[Message], tools, params: SamplingParams, max_new_tokens: int) -> Iterator:
        m = self.model
        ids = self._prompt_ids(messages, tools)
        self.timings = Timings()
        tokens = m.engine.generate(ids, params, max_new_tokens, stop_ids=m.chat_format.stop_ids,
                                   n_vocab=m.tokenizer.n_vocab, timings=self.timings)
        # Token ids, not text, go to the parser: ChatGLM3 may put <|assistant|> between a text
        # segment and a tool call inside one reply, and decoded text drops that special token.
        parser = ToolCallStream(m.chat_format, tools)
        for token in tokens:
            yield from parser.push(token)
        yield from parser.close()
        self.cached = messages + [parser.message]
        self.cached_tools = tools


def chat_request(chat_format, messages: list[Message], tools=None, params: SamplingParams | None = None,
                 max_new_tokens: int = 256, window: WindowPolicy | None = None) -> Request:
    """A whole conversation as one scheduler Request: its ids with the generation prompt, the chat's
    stop ids, and the turn marks the window needs. The [gMASK]sop prefix and a system/tools turn stay
    when the window slides; later turns are discarded whole (turn_spans' first span holds the prefix
    and the system turn, if any)."""
    ids = chat_format.encode_messages(messages, tools=tools)
    starts = [s for s, _ in chat_format.turn_spans(messages, tools=tools)]
    pin = len(starts) > 1 and (messages[0].role == "system" or bool(tools))
    return Request(ids, params or SamplingParams(), max_new_tokens, chat_format.stop_ids, window or WindowPolicy(),
                   turn_starts=starts[1:], pinned=starts[1] if pin else None)


def reply_message(chat_format, tokens, tools=None) -> Message:
    """The assistant Message (text and tool calls) of generated ids, parsed as the stream parses them."""
    parser = ToolCallStream(chat_format, tools)
    for t in tokens:
        parser.push(t)
    parser.close()
    return parser.message
