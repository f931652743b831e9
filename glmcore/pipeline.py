"""The chat API: messages in, a message (text or tool calls) out, streaming, with the KV cache of
earlier turns reused so that a new turn prefills only its own tokens."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from .backend import LoadOptions
from .chat import Message, ToolCallStream, as_message
from .events import ChatEvent, FinishReason
from .model import LoadedModel, load_model
from .sampling import SamplingParams
from .scheduler import Request, Slot, Speculation, Timings, WindowPolicy
from .structured import Grammar, reply_constraint


class Pipeline:
    """Pipeline(model_dir, backend=...).chat(messages, stream=True) in the spirit of OpenVINO GenAI.

    `messages` is the whole conversation each time (OpenAI style), and the whole conversation is what the
    scheduler gets, as from the server: the slot that ran the last reply holds a prefix of it (its replies are
    encoded with the ids they were generated as), so only the new messages are prefilled; a slot whose window
    slid goes on from what it kept (SlotTable.go_on).
    """

    def __init__(self, model: str | Path | None = None, backend: str | None = None,
                 options: LoadOptions | None = None, window: WindowPolicy | None = None,
                 loaded: LoadedModel | None = None, speculation: Speculation | None = None):
        self.model = loaded or load_model(model, backend, options, speculation=speculation)
        self.window = window or WindowPolicy()
        self.cached: list[Message] = []      # the last conversation, its replies with their generated ids
        self.slot: Slot | None = None        # where the scheduler ran the last reply
        self.timings = Timings()
        self.finish_reason: FinishReason | None = None   # why the last reply ended
        self.context_full = False            # it ended because the context was full

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def reset(self) -> None:
        self.cached, self.slot = [], None

    def _known(self, messages: list[Message]) -> list[Message]:
        """messages, with the earlier replies as they were generated where the conversation goes on from the last
        one (Message equality leaves out ids: the caller's copies of the replies match)."""
        n = len(self.cached)
        return self.cached + messages[n:] if n and messages[:n] == self.cached else messages

    def _request(self, messages: list[Message], tools, params: SamplingParams, max_new_tokens: int,
                 grammar: Grammar | None = None, fmt=None,
                 max_thinking_tokens: int | None = None) -> tuple[Request, list[int]]:
        """The scheduler Request for the whole conversation, and the ids forced at the start of the reply (the
        end of its prompt)."""
        fmt = fmt or self.model.chat_format
        opening, constraint = reply_constraint(fmt, self.model.config.vocab_size, grammar, tools,
                                               thinking_budget=max_thinking_tokens)
        request = chat_request(fmt, messages, tools, params, max_new_tokens, self.window)
        request.prompt, request.constraint = list(request.prompt) + opening, constraint
        return request, opening

    def chat(self, messages, tools: list[dict] | None = None, stream: bool = False,
             params: SamplingParams | None = None, max_new_tokens: int = 256, grammar: Grammar | None = None,
             template_kwargs: dict | None = None, max_thinking_tokens: int | None = None):
        """Returns the assistant Message, or with stream=True an iterator of ChatEvents (TextDelta,
        ToolCallEvent); the Message is then in self.cached[-1]. `grammar` (glmcore.structured.Grammar): what
        the reply's text must match (a JSON Schema, a regex, ...), enforced token by token; tools marked
        "strict": true get arguments that match their parameters schema. `template_kwargs`: variables for the
        checkpoint's chat template (vLLM's chat_template_kwargs, e.g. {"enable_thinking": False} where the template
        has that switch). A thinking model's reply streams ReasoningDelta before its answer; Message.reasoning;
        `max_thinking_tokens` ends its thought after that many tokens with the template's </think>."""
        events = self._events([as_message(m) for m in messages], tools, params or self.model.sampling, max_new_tokens,
                              grammar, template_kwargs, max_thinking_tokens)
        if stream:
            return events
        for _ in events:
            pass
        return self.cached[-1]

    def _events(self, messages: list[Message], tools, params: SamplingParams,
                max_new_tokens: int, grammar: Grammar | None = None, template_kwargs: dict | None = None,
                max_thinking_tokens: int | None = None) -> Iterator[ChatEvent]:
        m = self.model
        fmt = m.chat_format.configured(template_kwargs)
        messages = self._known(messages)
        request, opening = self._request(messages, tools, params, max_new_tokens, grammar, fmt, max_thinking_tokens)
        self.finish_reason, self.context_full = None, False
        handle = m.scheduler.submit(request)
        # Token ids, not text, go to the parser: ChatGLM3 may put <|assistant|> between a text
        # segment and a tool call inside one reply, and decoded text drops that special token.
        parser, shown = ToolCallStream(fmt, tools), list(opening)
        for token in opening:           # the forced opening (an empty metadata line) is part of the reply
            parser.push(token)
        try:
            for token in handle:
                shown.append(token)
                yield from parser.push(token)
        finally:
            if not handle.done:         # the consumer stopped early: the slot is freed at the next step
                handle.cancel()
                handle.wait()
            self.timings = handle.timings
            self.slot, self.finish_reason, self.context_full = handle.slot, handle.finish_reason, handle.context_full
        yield from parser.close()
        reply = parser.message
        reply.ids = shown               # the next turn encodes the reply as these ids: the slot's cache stays a prefix
        self.cached = messages + [reply]


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
                   turn_starts=starts[1:], n_pinned=starts[1] if pin else None)


