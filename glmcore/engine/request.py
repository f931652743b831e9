"""A request and its state in the engine: what was asked (Request), where it stands (RequestState, one
dataclass with a Status), and what a consumer holds (Handle: iterate the tokens, cancel)."""
from __future__ import annotations

import enum
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ..errors import ContextOverflow, GlmcoreError
from ..events import FinishReason
from ..sampling import Sampler, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from ..structured import Constraint, Matcher

OVERFLOW_POLICIES = ("error", "window")


@dataclass
class WindowPolicy:
    """What to do when a sequence fills its slot. `error`: the request ends with finish reason
    "length" (feeding more by hand raises ContextOverflow). `window` is StreamingLLM: keep the first
    n_keep tokens as attention sinks and discard n_discard after them (default: half of the rest, as
    llama.cpp)."""
    policy: str = "error"
    n_keep: int = 4
    n_discard: int | None = None

    def __post_init__(self):
        if self.policy not in OVERFLOW_POLICIES:
            raise GlmcoreError(f"unknown overflow policy {self.policy!r}; choose error or window")
        if self.n_keep < 0 or (self.n_discard is not None and self.n_discard < 1):
            raise GlmcoreError("n_keep must be >= 0 and n_discard >= 1")


@dataclass
class Timings:
    prompt_tokens: int = 0       # prompt tokens prefilled (the cached prefix is not counted)
    new_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    shifts: int = 0
    cached_tokens: int = 0       # prompt tokens a slot already held (prefix reuse)
    drafted: int = 0             # speculative decoding: tokens a drafter proposed
    accepted: int = 0            # ... and the target model confirmed

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        # the first new token comes from the prefill logits; decode steps made the rest
        return (self.new_tokens - 1) / self.decode_s if self.decode_s and self.new_tokens > 1 else 0.0

    def line(self) -> str:
        return (f"prompt {self.prompt_tokens} tok, generated {self.new_tokens} tok | "
                f"time to first token {self.ttft_s * 1000:.1f} ms | prefill {self.prefill_tps:.1f} tok/s | "
                f"decode {self.decode_tps:.1f} tok/s" + (f" | window shifts {self.shifts}" if self.shifts else "")
                + (f" | reused {self.cached_tokens} cached tok" if self.cached_tokens else "")
                + (f" | drafted {self.drafted}, accepted {self.accepted}" if self.drafted else ""))


@dataclass
class Request:
    prompt: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 256
    stop_ids: Sequence[int] = ()
    window: WindowPolicy = field(default_factory=WindowPolicy)
    turn_starts: Sequence[int] = ()      # chat turn starts in prompt: the window discards whole turns
    n_pinned: int | None = None          # how many prompt tokens the window never discards (prefix + system turn)
    # constrained decoding (glmcore.structured): each token is masked to what the grammar allows next, and
    # the request ends when the grammar is complete
    constraint: "Constraint | None" = None
    min_tokens: int = 0                  # stop ids are masked until this many tokens are generated
    # log-probabilities (glmcore.sampling.token_logprob) of each generated token with this many alternatives
    # (None: none computed); prompt_logprobs: of each prompt token after the first (the whole prompt is
    # prefilled for them, no cached prefix). Both from the row the token was drawn from after the grammar
    # mask, before logit_bias, penalties and temperature: vLLM's default ("raw") logprobs.
    logprobs: int | None = None
    prompt_logprobs: int | None = None


def check_request(request: Request, capacity: int) -> None:
    """Refuse at once what can never run: an empty prompt, a bad max_new_tokens or min_tokens, a prompt
    longer than the context (error policy, or a window that cannot slide)."""
    n = len(request.prompt)
    if n == 0:
        raise GlmcoreError("nothing to generate from: the prompt encodes to zero tokens")
    if request.max_new_tokens < 1:
        raise GlmcoreError(f"invalid max-new-tokens {request.max_new_tokens}: use a positive integer")
    if not 0 <= request.min_tokens <= request.max_new_tokens:
        raise GlmcoreError(f"invalid min-tokens {request.min_tokens}: use 0..max-new-tokens "
                           f"({request.max_new_tokens})")
    keep = request.n_pinned if request.n_pinned is not None else request.window.n_keep
    if n > capacity and (request.window.policy == "error" or keep >= capacity):
        raise ContextOverflow(f"the prompt has {n} tokens, which exceed the context of {capacity}; shorten "
                              "the prompt or raise --ctx")


class Status(enum.Enum):
    WAITING = "waiting"        # queued, no slot yet
    PREFILL = "prefill"        # in a slot, prompt ids still to feed (`todo`)
    DECODE = "decode"          # the last sampled token (`pending`) is fed with the next step
    FINISHED = "finished"      # finish_reason says why; the slot is free


_ids = itertools.count()


@dataclass(eq=False)
class RequestState:
    """Everything the engine knows about one request; only the engine's thread writes it."""
    request: Request
    sampler: Sampler
    matcher: "Matcher | None" = None
    handle: "Handle | None" = None                      # its consumer's view (set by Handle)
    id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    slot: "Slot | None" = None
    todo: list[int] = field(default_factory=list)       # prompt ids not yet fed
    pending: int | None = None                          # last sampled token, fed with the next step
    history: list[int] = field(default_factory=list)    # prompt + generated, for the repetition penalty and drafts
    tokens: list[int] = field(default_factory=list)     # generated (stop ids are never included)
    logprobs: list[TokenLogprob] = field(default_factory=list)   # of tokens (and a stop id), when asked
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # of the prompt (None for the first)
    leader: "RequestState | None" = None                # n > 1: waits for the leader's prefill, then copies it
    finish_reason: FinishReason | None = None
    error: GlmcoreError | None = None
    context_full: bool = False                          # finish reason "length" because the slot was full
    cancelled: bool = False                             # asked by the consumer; reaped at the next step
    timings: Timings = field(default_factory=Timings)
    shifts0: int = 0
    t_submit: float = field(default_factory=time.perf_counter)
    t_placed: float = 0.0
    t_first: float = 0.0

    @classmethod
    def new(cls, request: Request, n_vocab: int | None) -> "RequestState":
        return cls(request, Sampler(request.params, n_vocab),
                   request.constraint.start() if request.constraint is not None else None)

    @property
    def ready(self) -> bool:
        """Whether it may take a slot: a follower waits until its leader's prompt is in the leader's slot."""
        lead = self.leader
        return lead is None or lead.status is Status.FINISHED or (lead.status is not Status.WAITING and not lead.todo)

    def place(self, slot: "Slot", n_cached: int) -> None:
        """Running in slot, whose first n_cached ids are this prompt's."""
        prompt = list(self.request.prompt)
        self.slot, self.status = slot, Status.PREFILL
        self.todo, self.history = prompt[n_cached:], prompt
        self.prompt_logprobs = [None] if self.request.prompt_logprobs is not None else []
        self.timings.cached_tokens, self.timings.prompt_tokens = n_cached, len(prompt) - n_cached
        self.shifts0, self.t_placed = slot.shifts, time.perf_counter()

    def finish(self, reason: FinishReason, error: GlmcoreError | None = None) -> bool:
        """End the request and free its slot (which keeps its cache). False if it had ended already."""
        if self.status is Status.FINISHED:
            return False
        self.status, self.finish_reason = Status.FINISHED, reason
        if error is not None:
            self.error = error
        now = time.perf_counter()
        if self.t_first:
            self.timings.decode_s = now - self.t_first
        if self.slot is not None:
            self.timings.shifts = self.slot.shifts - self.shifts0
            self.slot.state = None
            self.slot.last_used = now
        self.pending, self.todo = None, []
        return True


class Slot:
    """What one slot of the BatchSession holds: its ids in cache order, and the window bookkeeping.

    `fed` is every id fed since the slot last held nothing, the ones a window slide discarded included: the
    conversation the slot continues. A slot that never slid holds all of it (`tokens == fed`); after a slide
    only the last `fresh` ids of `tokens` are known to be the last ids of `fed` (fed since the slide)."""

    def __init__(self, index: int):
        self.index = index
        self.tokens: list[int] = []
        self.fed: list[int] = []
        self.fresh = 0
        self.turn_starts: list[int] = []
        self.n_pinned: int | None = None
        self.shifts = 0
        self.state: "RequestState | None" = None      # the running request, None when free
        self.last_used = 0.0

    @property
    def slid(self) -> bool:
        return len(self.fed) != len(self.tokens)

    def hold(self, ids: Sequence[int]) -> None:
        """The cache now holds exactly ids, as if fed from empty."""
        self.tokens, self.fed, self.fresh = list(ids), list(ids), len(ids)

    def extend(self, ids: Sequence[int]) -> None:
        self.tokens.extend(ids)
        self.fed.extend(ids)
        self.fresh += len(ids)

    def slide(self, n_keep: int, n_discard: int) -> None:
        """The window slid: n_discard ids after the first n_keep left the cache (turn starts follow)."""
        self.tokens = self.tokens[:n_keep] + self.tokens[n_keep + n_discard:]
        self.fresh = min(self.fresh, len(self.tokens) - n_keep)
        self.turn_starts = [s if s < n_keep else s - n_discard for s in self.turn_starts
                            if not n_keep <= s < n_keep + n_discard]
        self.shifts += 1

    def cut(self, n: int) -> None:
        """Only the first n ids stay. Cutting ids fed since the last slide (rejected drafts) keeps the
        conversation it continues; cutting deeper leaves a plain prefix."""
        gone = len(self.tokens) - n
        if gone <= self.fresh:
            del self.fed[len(self.fed) - gone:]
            self.tokens, self.fresh = self.tokens[:n], self.fresh - gone
        else:
            self.hold(self.tokens[:n])

    def continued_by(self, ids: Sequence[int]) -> bool:
        """A slid slot whose whole conversation starts ids: its window goes on with the rest of them."""
        return self.slid and len(ids) >= len(self.fed) and list(ids[:len(self.fed)]) == self.fed


class Engine(Protocol):
    """What a Handle asks of the scheduler that made it (glmcore.engine.scheduler.Scheduler)."""
    threaded: bool

    def wake(self) -> None: ...

    def step(self) -> bool: ...


class Handle:
    """A submitted request as its consumer sees it. Iterate it for the generated token ids as they come
    (stop ids are never yielded); `finish_reason` is then a FinishReason. Safe to consume from another
    thread; iterating it steps the scheduler when no background thread does (the CLI, the Pipeline)."""

    def __init__(self, state: RequestState, scheduler: Engine,
                 on_token: Callable[["Handle", int | None], None] | None):
        self.state, self.scheduler, self.on_token = state, scheduler, on_token
        state.handle = self
        self._queue: queue.Queue = queue.Queue()
        self._done = threading.Event()

    id = property(lambda self: self.state.id)
    request = property(lambda self: self.state.request)
    tokens = property(lambda self: self.state.tokens)
    # logprobs[i] is tokens[i]'s once it is yielded; one more at the end when a stop id ended the request
    logprobs = property(lambda self: self.state.logprobs)
    prompt_logprobs = property(lambda self: self.state.prompt_logprobs)
    finish_reason = property(lambda self: self.state.finish_reason)
    error = property(lambda self: self.state.error)
    timings = property(lambda self: self.state.timings)
    slot = property(lambda self: self.state.slot)
    context_full = property(lambda self: self.state.context_full)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop generating; the request ends with finish reason "cancelled" at the next step."""
        self.state.cancelled = True
        self.scheduler.wake()

    def wait(self, timeout: float | None = None) -> "Handle":
        for _ in self._drain(timeout):
            pass
        return self

    def __iter__(self) -> Iterator[int]:
        return self._drain(None)

    def _drain(self, timeout: float | None) -> Iterator[int]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                if not self.scheduler.threaded:
                    if not self.scheduler.step() and self._queue.empty():
                        raise GlmcoreError(f"internal error: request {self.id} is neither queued nor running; "
                                           "please report")
                    continue
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"request {self.id} did not finish in {timeout} s")
                try:
                    item = self._queue.get(timeout=left if left is not None else 1.0)
                except queue.Empty:
                    continue
            if item is None:
                if self.error is not None:
                    raise self.error
                return
            yield item

    def deliver(self, token: int | None) -> None:
        """A new token, or None: the request has ended (called by the engine's thread only)."""
        self._queue.put(token)
        if self.on_token is not None:
            try:
                self.on_token(self, token)
            except Exception:       # a consumer's callback must not stop the engine: drop its request
                self.state.cancelled = True
        if token is None:
            self._done.set()
