"""The slot table: which request runs in which slot of the BatchSession, what each slot's cache holds,
and the KV-cache policy carried out on it (place with prefix reuse, make room, slide, truncate, refill)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..backend import BatchSession, Capabilities
from ..errors import ContextOverflow, GlmcoreError
from .prompt_cache import PromptCache, common_prefix
from .request import RequestState, Slot, WindowPolicy



@dataclass(frozen=True)
class Room:
    """What the KV-cache policy decided for a slot about to take new ids: they fit (n_discard 0), slide
    the window first (drop n_discard ids after the first n_keep), or the sequence ends (`full`)."""
    n_keep: int = 0
    n_discard: int = 0
    full: bool = False


class SlotTable:
    """The slots of one BatchSession. `caps` are the backend's: can_shift (slide a window in place) and
    native_batch (copy a prefix between slots, truncate in place) decide how the policy is carried out.
    With a prompt cache (backends with kv_export), a slot's content is saved there before it is overwritten,
    and a prompt whose prefix the cache holds longer than any slot is restored from it."""

    def __init__(self, batch: BatchSession, caps: Capabilities, cache: PromptCache | None = None):
        self.batch = batch
        self.can_shift, self.native = caps.can_shift, caps.native_batch
        self.slots = [Slot(i) for i in range(batch.n_slots)]
        self.cache = cache
        for slot in self.slots:     # a new table's slots hold nothing, so the session's must not either: a scheduler
            batch.reset(slot.index)  # made over a used session starts clean (and the mtp drafter can start there)

    @property
    def capacity(self) -> int:
        return self.batch.capacity

    def free(self) -> list[Slot]:
        return [s for s in self.slots if s.state is None]

    def running(self) -> list[RequestState]:
        return [s.state for s in self.slots if s.state is not None]

    def place(self, state: RequestState, free: list[Slot]) -> None:
        """Put a request in the free slot that already holds the longest prefix of its prompt (prefix
        reuse); with a native batch session, copy a longer prefix from any other slot (a shared system
        prompt), or restore a still longer one from the prompt cache."""
        prompt = list(state.request.prompt)
        head = prompt[:-1]             # the last prompt token is always fed: its logits are sampled
        if state.request.prompt_logprobs is not None:
            head = []                  # every prompt position's logits are wanted: no cached prefix
        held = {s.index: common_prefix(s.tokens, head) for s in self.slots}     # once per slot, not per comparison
        slot = max(free, key=lambda s: (held[s.index], -s.last_used))
        going_on = max((s for s in free if s.continued_by(head)), key=lambda s: len(s.fed), default=None)
        if going_on is not None and len(going_on.fed) > held[slot.index]:
            self.go_on(going_on, state)
            return
        n = held[slot.index]
        donor = max(self.slots, key=lambda s: held[s.index]) if self.native else slot
        cached = self.cache.lookup(head, held[donor.index]) if self.cache is not None else None
        if cached is not None or held[donor.index] > n or n < len(slot.tokens):
            self.save(slot)            # what the slot holds beyond n is about to be overwritten
        if cached is not None:
            self.batch.import_prefix(slot.index, cached.entry.blob)
            slot.hold(cached.entry.tokens)
            n = cached.n
        elif self.native:
            if held[donor.index] > n:
                n = held[donor.index]
                self.batch.copy_prefix(donor.index, slot.index, n)
                slot.hold(prompt[:n])
        if n < len(slot.tokens):
            self.truncate(slot, n)
        slot.turn_starts = [s for s in state.request.turn_starts if 0 < s]
        slot.n_pinned = state.request.n_pinned
        slot.state = state
        state.place(slot, n)

    def go_on(self, slot: Slot, state: RequestState) -> None:
        """Continue a slid slot with the rest of a prompt that starts with its whole conversation: the window
        the slot kept goes on (as `glmcore chat --overflow window` would), rather than the whole conversation
        being prefilled again, sliding, every turn. The slot keeps its pinned prefix; the prompt's later turn
        starts follow the slot's positions."""
        n = len(slot.fed)
        offset = len(slot.tokens) - n
        later = [s + offset for s in state.request.turn_starts if s >= n]
        slot.turn_starts += [s for s in later if not slot.turn_starts or s > slot.turn_starts[-1]]
        slot.state = state
        state.place(slot, n)

    def save(self, slot: Slot) -> None:
        """Keep a free slot's content in the prompt cache, unless the cache holds it already. Called just
        before the content is overwritten (place), the one point where it is lost: saving at every finish
        would copy conversations that simply continue in their slot."""
        if self.cache is not None and self.cache.worth_saving(slot.tokens):
            self.cache.put(slot.tokens, self.batch.export_prefix(slot.index, len(slot.tokens)))

    def make_room(self, slot: Slot, n_new: int, window: WindowPolicy) -> Room:
        """The KV-cache policy for n_new ids into slot, the window slid already where it says so."""
        room = make_room(slot, n_new, self.capacity, window)
        if room.n_discard:
            self.shift(slot, room.n_keep, room.n_discard)
        return room

    def shift(self, slot: Slot, n_keep: int, n_discard: int) -> None:
        """Slide one slot's window: in place where the backend can, else recompute the kept ids."""
        if self.can_shift:
            self.batch.shift(slot.index, n_keep, n_discard)
        else:
            self.refill(slot, slot.tokens[:n_keep] + slot.tokens[n_keep + n_discard:])
        slot.slide(n_keep, n_discard)

    def truncate(self, slot: Slot, n: int) -> None:
        """Keep a slot's first n positions, as if nothing after them had been fed: in place where the
        session is native (copy_prefix onto itself), else recomputed."""
        if self.native and n:
            self.batch.copy_prefix(slot.index, slot.index, n)
        else:
            self.refill(slot, slot.tokens[:n])
        slot.cut(n)

    def refill(self, slot: Slot, ids: list[int]) -> None:
        self.batch.reset(slot.index)
        if ids:
            self.batch.step([(slot.index, ids)])

    def drop(self, slot: Slot) -> None:
        """Forget a slot's cache (after a failed step its content is unknown)."""
        self.batch.reset(slot.index)
        slot.hold([])

    def feed(self, slot: Slot, ids: Sequence[int], window: WindowPolicy) -> np.ndarray:
        """Teacher forcing: append given ids to an idle slot under `window` (sliding it as generation
        would) and return the last position's logits. For scoring text (perplexity) and conformance."""
        ids = [int(t) for t in ids]
        if slot.state is not None:
            raise GlmcoreError(f"slot {slot.index} is running a request; feed an idle slot")
        if self.make_room(slot, len(ids), window).full:
            raise ContextOverflow(f"{len(slot.tokens) + len(ids)} tokens exceed the context of {self.capacity}; "
                                  "raise --ctx or use --overflow window")
        logits = self.batch.step([(slot.index, ids)])[0]
        slot.extend(ids)
        return logits

    def forget(self) -> None:
        """Drop what every free slot and the prompt cache hold."""
        for slot in self.free():
            self.truncate(slot, 0)
        if self.cache is not None:
            self.cache.clear()


def make_room(slot: Slot, n_new: int, capacity: int, window: WindowPolicy) -> Room:
    """The core's KV-cache policy for one slot about to take n_new ids. Raises ContextOverflow when
    even a slid window cannot hold them."""
    if len(slot.tokens) + n_new <= capacity:
        return Room()
    if window.policy == "error":
        return Room(full=True)
    keep = window.n_keep if slot.n_pinned is None else slot.n_pinned
    if keep + n_new > capacity:
        raise ContextOverflow(f"{n_new} new tokens + {keep} kept do not fit the context of {capacity} even after "
                              "sliding the window; shorten the prompt or raise --ctx")
    need = len(slot.tokens) + n_new - capacity
    discard = window.n_discard or max(1, (len(slot.tokens) - keep) // 2)
    discard = min(max(discard, need), len(slot.tokens) - keep)
    # In a chat, discard whole old turns: round up to the next turn start that still fits.
    whole = [s - keep for s in slot.turn_starts if discard <= s - keep <= len(slot.tokens) - keep]
    if whole:
        discard = min(whole)
    return Room(keep, discard)
