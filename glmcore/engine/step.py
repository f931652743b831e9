"""One step of the engine, in pieces the scheduler chains: `schedule` plans what the step feeds (decode
tokens with their drafts, prefill chunks under the token budget), the BatchSession runs it, then for
each position of the drafted runs (one round without speculation) `constrain` masks the rows,
`sample` draws, and `update` applies the tokens to the requests and returns the events to deliver."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .. import structured
from ..errors import ContextOverflow, GlmcoreError
from ..events import FinishReason
from ..sampling import TokenLogprob, sample_batch, token_logprob
from ..structured import GrammarError
from .request import RequestState, Status
from .slots import SlotTable


@dataclass(frozen=True)
class Event:
    """A token for a request's consumer, or None: the request has ended."""
    state: RequestState
    token: int | None


@dataclass(eq=False)
class PlanEntry:
    """One slot's part of a step: ids fed after the slot's kv_before positions; the last len(draft) of
    them are drafted tokens the step verifies. `sample`: the entry's logits are sampled."""
    state: RequestState
    ids: list[int]
    sample: bool
    kv_before: int
    draft: list[int] = field(default_factory=list)
    row: int = 0                 # its place in the step's entries (and logits)
    rounds: int = 0              # rows consumed so far (one per verified position, plus the last)
    accepted: int = 0            # drafted tokens the target confirmed

    @property
    def index(self) -> int:
        return self.state.slot.index

    @property
    def scores_prompt(self) -> bool:
        """Prompt ids of a request that asks for their logprobs: every position's logits are wanted."""
        return self.state.request.prompt_logprobs is not None and not self.draft and \
            self.kv_before < len(self.state.request.prompt)

    def kept(self) -> int:
        """How many positions of the slot stay after the step: rejected drafts, and a last emitted token
        (which plain decoding would not have fed yet), leave the cache."""
        return self.kv_before + len(self.ids) - len(self.draft) + max(self.rounds - 1, 0)


@dataclass
class StepPlan:
    entries: list[PlanEntry]
    ended: list[Event]           # requests the KV policy ended while planning (context full, overflow)
    # per entry, whether it wants every position's logits (it verifies drafts, or scores its prompt); False when
    # none does (one [n, vocab] array of last rows comes back). Set once here: every round of the step reads it.
    all_logits: list[bool] | bool = field(init=False)

    def __post_init__(self):
        for i, e in enumerate(self.entries):
            e.row = i
        wanted = [bool(e.draft) or e.scores_prompt for e in self.entries]
        self.all_logits = wanted if any(wanted) else False

    def batch_entries(self) -> list[tuple[int, list[int]]]:
        return [(e.index, e.ids) for e in self.entries]


def end(state: RequestState, reason: FinishReason, error: GlmcoreError | None = None) -> list[Event]:
    return [Event(state, None)] if state.finish(reason, error) else []


def schedule(table: SlotTable, token_budget: int, drafter=None, draft_tokens: int = 0) -> StepPlan:
    """Decode tokens of every running request first (each with up to draft_tokens drafted after it),
    then prefill chunks in admission order under the token budget; at least one chunk moves when
    nothing decodes. A draft never makes the window slide or the context fill earlier than plain
    decoding would, nor runs past max_new_tokens, so the output is the one plain decoding gives."""
    entries, ended = [], []
    budget = token_budget
    running = table.running()
    for state in running:
        if state.pending is None:
            continue
        ended += make_room(table, state, 1)
        if state.status is Status.FINISHED:
            continue
        slot, draft = state.slot, []
        if drafter is not None:
            room = min(draft_tokens, budget - 1, table.capacity - len(slot.tokens) - 1,
                       state.request.max_new_tokens - len(state.tokens) - 1)
            draft = drafter.propose(state, room)[:room] if room > 0 else []
        entries.append(PlanEntry(state, [state.pending] + draft, True, len(slot.tokens), draft))
        state.pending = None
        budget -= 1 + len(draft)
    prefilling = [s for s in running if s.todo]
    for state in sorted(prefilling, key=lambda s: s.id) if prefilling else ():
        if budget <= 0 and entries:
            break
        chunk = state.todo[:max(budget, 1)]
        ended += make_room(table, state, len(chunk))
        if state.status is Status.FINISHED:
            continue
        state.todo = state.todo[len(chunk):]
        entries.append(PlanEntry(state, chunk, not state.todo, len(state.slot.tokens)))
        budget -= len(chunk)
    return StepPlan(entries, ended)


def make_room(table: SlotTable, state: RequestState, n_new: int) -> list[Event]:
    """Apply the request's overflow policy before n_new ids go into its slot; the events of its end
    ("length", or an error where even a slid window cannot take them)."""
    try:
        room = table.make_room(state.slot, n_new, state.request.window)
    except ContextOverflow as e:
        return end(state, FinishReason.ERROR, e)
    if room.full:
        state.context_full = True
        return end(state, FinishReason.LENGTH)
    return []


def row_of(entry: PlanEntry, logits, all_logits: list[bool] | bool) -> np.ndarray:
    """The logits row entry samples in its current round (a view, no copy)."""
    if not all_logits:
        return logits[entry.row]
    # counted from the end: an entry that wants only its last row may get just that row
    return logits[entry.row][entry.rounds - len(entry.draft) - 1]


def constrain(states: Sequence[RequestState], rows: list[np.ndarray], executor,
              prefetched: "structured.PrefetchedMasks | None" = None) -> tuple[list[np.ndarray], list[Event]]:
    """Mask the logits rows of constrained requests (their grammar's next-token bitmask, prefetched during the
    step where it was; stop ids only where the grammar is complete) and of requests under min_tokens (no stop
    ids yet). A request whose grammar allows nothing more ends: "stop" when what it wrote is complete, else an
    error. Returns the rows (masked copies where masked) and the end events."""
    con = [i for i, s in enumerate(states) if s.matcher is not None and not argmax_allowed(s, rows[i])]
    events: list[Event] = []
    if con:
        masked, alive = structured.mask_rows(
            [states[i].matcher for i in con], [rows[i] for i in con], [states[i].request.stop_ids for i in con],
            [len(states[i].tokens) >= states[i].request.min_tokens for i in con], executor, prefetched)
        for j, i in enumerate(con):
            rows[i] = masked[j]
            s = states[i]
            if alive[j]:
                continue
            if s.matcher.accepting:
                events += end(s, FinishReason.STOP)
            else:
                events += end(s, FinishReason.ERROR, GrammarError(
                    f"the grammar dead-ended after {len(s.tokens)} tokens: no token of the vocabulary continues "
                    "it; check the grammar"))
    for i, s in enumerate(states):
        if s.matcher is None and len(s.tokens) < s.request.min_tokens and s.request.stop_ids:
            rows[i] = rows[i].copy()
            rows[i][[t for t in s.request.stop_ids if 0 <= t < rows[i].shape[0]]] = -np.inf
    return rows, events


def prefetch_masks(active: Sequence[PlanEntry], executor) -> "structured.PrefetchedMasks | None":
    """The grammar masks of a step's first round, started on a background thread so that they are computed while
    the model runs the step (not those of requests that ask their grammar about their argmax first: computed only
    where it is refused). Nothing may advance these matchers before its wait() has returned."""
    matchers = [e.state.matcher for e in active if e.state.matcher is not None and not checks_argmax_first(e.state)]
    return structured.PrefetchedMasks(matchers, executor) if matchers else None


def settle_drafts(entries: Sequence[PlanEntry], table) -> tuple[int, int]:
    """After a step's rounds: rejected drafts leave the cache as if never fed. Returns (drafted, accepted)."""
    drafted = accepted = 0
    for e in entries:
        if e.draft:
            if e.kept() < len(e.state.slot.tokens):
                table.truncate(e.state.slot, e.kept())
            drafted, accepted = drafted + len(e.draft), accepted + e.accepted
            e.state.timings.drafted += len(e.draft)
    return drafted, accepted


def checks_argmax_first(state: RequestState) -> bool:
    """A constrained request whose token is its row's argmax (greedy, nothing moving it, no logprobs read from
    the masked row): its grammar is asked about that one token first, and its mask computed only if refused."""
    return state.matcher is not None and state.sampler.takes_argmax and state.request.logprobs is None


def argmax_allowed(state: RequestState, row: np.ndarray) -> bool:
    """The row's argmax is a token the grammar allows next (not a stop id, whose rules the mask keeps): then the
    masked row's argmax is that same token (no allowed id before it ties it), so the row needs no mask -- as
    llama.cpp's sampler tries the drawn token before applying a grammar. Microseconds, where the mask walks the
    whole vocabulary."""
    if not checks_argmax_first(state):
        return False
    top = int(np.argmax(row[:state.sampler.n_vocab] if state.sampler.n_vocab else row))
    eos = state.matcher.constraint.table.tokenizer.eos_id
    return top != eos and top not in state.request.stop_ids and state.matcher.allows(top)


def sample(entries: Sequence[PlanEntry], rows: Sequence[np.ndarray]) -> list:
    """One token per entry (or its SamplingError): at a drafted position the drafted token is verified
    (kept or replaced, Sampler.verify), after the last one the token is drawn as plain decoding draws it."""
    if not any(e.draft for e in entries):
        return sample_batch([e.state.sampler for e in entries], rows, [e.state.history for e in entries],
                            [e.state.tokens for e in entries])
    plain = [i for i, e in enumerate(entries) if e.rounds >= len(e.draft)]
    out: list = [None] * len(entries)
    for i, token in zip(plain, sample_batch([entries[i].state.sampler for i in plain], [rows[i] for i in plain],
                                            [entries[i].state.history for i in plain],
                                            [entries[i].state.tokens for i in plain])):
        out[i] = token
    for i, e in enumerate(entries):
        if out[i] is None:
            try:
                out[i] = e.state.sampler.verify(rows[i], e.state.history, e.draft[e.rounds], e.state.tokens)
            except GlmcoreError as err:
                out[i] = err
    return out


def logprobs(entries: Sequence[PlanEntry], rows: Sequence[np.ndarray], tokens: Sequence) -> list[TokenLogprob | None]:
    """Each sampled token's logprob entry where its request asks for them: log_softmax of the row it was
    drawn from (masked by the grammar, before logit_bias, penalties and temperature). At a verified drafted
    position the row is that position's, so speculation gives the logprobs plain decoding gives."""
    return [token_logprob(row, t, e.state.request.logprobs, e.state.sampler.n_vocab)
            if e.state.request.logprobs is not None and isinstance(t, int) else None
            for e, row, t in zip(entries, rows, tokens)]


def score_prompt(entry: PlanEntry, logits: np.ndarray) -> None:
    """Append the logprobs of the prompt ids a prefill chunk's positions predict (all-position logits)."""
    s, prompt = entry.state, entry.state.request.prompt
    for j in range(len(entry.ids)):
        nxt = entry.kv_before + j + 1
        if nxt < len(prompt):
            s.prompt_logprobs.append(token_logprob(logits[j], prompt[nxt], s.request.prompt_logprobs,
                                                   s.sampler.n_vocab))


def update(entries: Sequence[PlanEntry], tokens: Sequence, now: float,
           token_logprobs: Sequence[TokenLogprob | None] = ()) -> tuple[list[Event], list[PlanEntry]]:
    """Apply one round's sampled tokens: end requests (stop id, grammar complete, max_new_tokens, a
    broken row), emit the others' tokens, and keep in the next round the entries whose token is the one
    drafted at this position. Returns the events and those entries."""
    events: list[Event] = []
    going_on: list[PlanEntry] = []
    for e, token, lp in zip(entries, tokens, token_logprobs or [None] * len(entries)):
        s, position = e.state, e.rounds
        e.rounds += 1
        if isinstance(token, GlmcoreError):      # this request's logits were broken; the others go on
            events += end(s, FinishReason.ERROR, token)
            continue
        if not s.t_first:
            s.t_first = now
            s.timings.ttft_s, s.timings.prefill_s = now - s.t_submit, now - s.t_placed
        if token in s.request.stop_ids:
            if lp is not None:
                s.logprobs.append(lp)    # the stop id's too, as vLLM's: an echoed prompt's scores stay aligned
            events += end(s, FinishReason.STOP)
            continue
        if s.matcher is not None and (why := s.matcher.advance(token)) is not None:
            if s.matcher.too_complex:         # a limit of llguidance's, hit by the request's grammar
                err = GrammarError(f"the grammar is too large for the constraint engine after {len(s.tokens)} "
                                   f"tokens ({why}); simplify it: smaller repetition counts, fewer rules")
            else:
                err = GrammarError(f"the sampled token {token} does not continue the grammar ({why}); please report")
            events += end(s, FinishReason.ERROR, err)
            continue
        if lp is not None:
            s.logprobs.append(lp)        # before the token: a consumer that has the token finds its entry
        s.tokens.append(token)
        s.history.append(token)
        s.timings.new_tokens += 1
        events.append(Event(s, token))
        if s.matcher is not None and s.matcher.stopped:
            events += end(s, FinishReason.STOP)       # the grammar is complete: nothing may follow
        elif len(s.tokens) >= s.request.max_new_tokens:
            events += end(s, FinishReason.LENGTH)     # the last token is not fed: a continuation feeds it
        elif position < len(e.draft) and token == e.draft[position]:
            s.timings.accepted += 1
            e.accepted += 1
            going_on.append(e)                       # already fed: its logits are the next row
        else:
            s.pending, s.status = token, Status.DECODE
    return events, going_on
