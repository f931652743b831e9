"""The engine's pieces one by one, on a fake batch session (test_scheduler.PureBatch: logits a pure
function of what a slot holds): the slot table's placement and truncation, schedule()'s plan, update()'s
handling of a round of sampled tokens, and how many positions a drafted entry keeps."""
from pathlib import Path

import numpy as np

from glmcore.backend import Capabilities
from glmcore.engine import Request, RequestState, Slot, SlotTable, Status, WindowPolicy
from glmcore.engine.step import PlanEntry, schedule, update
from glmcore.events import FinishReason
from glmcore.sampling import SamplingParams
from test_scheduler import PureBatch

GREEDY = SamplingParams(temperature=0)


def table(n_slots=2, capacity=32, native=True) -> SlotTable:
    return SlotTable(PureBatch(n_slots=n_slots, capacity=capacity, native=native), Capabilities(native_batch=native))


def placed(t: SlotTable, prompt, max_new=8, **kw) -> RequestState:
    state = RequestState.new(Request(prompt, GREEDY, max_new, **kw), None)
    t.place(state, t.free())
    return state


def decoding(t: SlotTable, prompt, pending, max_new=8, **kw) -> RequestState:
    """A request whose prompt is in its slot's cache and whose last sampled token is `pending`."""
    state = placed(t, prompt, max_new, **kw)
    t.batch.step([(state.slot.index, state.todo)])
    state.slot.extend(state.todo)
    state.todo, state.pending, state.status = [], pending, Status.DECODE
    state.tokens.append(pending)
    state.history.append(pending)
    return state


class Fixed:
    """A drafter that always proposes the same ids."""
    def __init__(self, ids):
        self.ids = ids

    def propose(self, state, k):
        return self.ids[:k]


def test_place_reuses_the_longest_cached_prefix_and_truncate_keeps_the_first_positions():
    t = table()
    t.slots[1].hold([1, 2, 3, 4, 5])
    t.batch.held[1] = [1, 2, 3, 4, 5]
    s = placed(t, [1, 2, 3, 9, 9])
    assert s.slot.index == 1 and s.todo == [9, 9] and s.timings.cached_tokens == 3
    assert t.batch.held[1] == [1, 2, 3] == t.slots[1].tokens          # truncated in place (copy_prefix onto itself)
    assert t.batch.copies == [(1, 1, 3)]
    other = placed(t, [1, 2, 3, 7])                                     # the other slot copies the shared prefix
    assert other.slot.index == 0 and other.todo == [7] and t.batch.copies[-1] == (1, 0, 3)


def test_truncate_without_a_native_session_re_prefills_the_kept_ids():
    t = table(native=False)
    t.batch.step([(0, [4, 5, 6, 7])])
    t.slots[0].hold([4, 5, 6, 7])
    t.truncate(t.slots[0], 2)
    assert t.batch.held[0] == [4, 5] and t.batch.copies == [] and t.batch.calls[-1] == [(0, [4, 5])]


def test_a_slot_remembers_the_conversation_its_window_slid_over():
    slot = Slot(0)
    slot.hold([1, 2])
    slot.extend([3, 4, 5, 6, 7, 8])
    assert not slot.slid and slot.continued_by([1, 2, 3, 4, 5, 6, 7, 8, 9]) is False     # unslid: plain prefix reuse
    slot.turn_starts = [2, 4, 6]
    slot.slide(2, 3)                                   # 3, 4, 5 leave the cache
    assert slot.tokens == [1, 2, 6, 7, 8] and slot.fed == list(range(1, 9)) and slot.fresh == 3
    assert slot.turn_starts == [3] and slot.shifts == 1
    assert slot.continued_by(list(range(1, 12))) and slot.continued_by(list(range(1, 9)))
    assert not slot.continued_by(list(range(1, 8))) and not slot.continued_by([1, 2, 6, 7, 8, 9])
    slot.extend([9, 10])
    slot.cut(6)                                        # rejected drafts: the conversation shortens with them
    assert slot.tokens == [1, 2, 6, 7, 8, 9] and slot.fed == list(range(1, 10)) and slot.continued_by(range(1, 11))
    slot.cut(3)
    assert slot.tokens == [1, 2, 6] and slot.fed == list(range(1, 7)) and slot.fresh == 1
    slot.cut(1)                                        # deeper than what was fed since the slide: a plain prefix
    assert slot.tokens == slot.fed == [1] and not slot.slid


def test_a_prompt_that_extends_a_slid_slots_conversation_goes_on_in_that_slot():
    t = table(capacity=16)
    s = t.slots[1]
    t.feed(s, list(range(10, 24)), WindowPolicy("window", n_keep=2))
    t.feed(s, [24, 25, 26, 27], WindowPolicy("window", n_keep=2))        # slides: 14 + 4 ids > 16
    assert s.slid and t.batch.held[1] == s.tokens
    kept, conversation = list(s.tokens), list(range(10, 28))
    state = placed(t, conversation + [30, 31, 32], turn_starts=[2, 18])
    assert state.slot is s and state.todo == [30, 31, 32] and state.timings.cached_tokens == 18
    assert s.tokens == kept and s.turn_starts[-1] == len(kept)            # turn start 18 at the slot's position
    assert t.batch.copies == []                                           # nothing truncated or copied
    other = placed(t, list(range(10, 20)) + [99])        # only shares the slid slot's pinned ids: the other slot
    assert other.slot.index == 0 and other.todo == list(range(12, 20)) + [99]      # the pinned ids copied


def test_schedule_puts_decodes_first_with_their_drafts_then_prefill_chunks_under_the_budget():
    t = table()
    d = decoding(t, [1, 2, 3], 10)
    p = placed(t, list(range(20, 40)))
    plan = schedule(t, 8, Fixed([11, 12, 13, 14, 15]), 3)
    assert [(e.state, e.ids, e.draft, e.sample) for e in plan.entries] == [
        (d, [10, 11, 12, 13], [11, 12, 13], True), (p, list(range(20, 24)), [], False)]
    assert plan.all_logits == [True, False]       # the prefill chunk needs its last row only
    assert plan.batch_entries() == [(d.slot.index, [10, 11, 12, 13]), (p.slot.index, [20, 21, 22, 23])]
    assert d.pending is None and p.todo == list(range(24, 40))


def test_drafts_stop_short_of_the_context_end_the_token_budget_and_max_new_tokens():
    for capacity, budget, max_new, expected in [(6, 64, 99, 2), (32, 3, 99, 2), (32, 64, 3, 1), (4, 64, 99, 0)]:
        t = table(capacity=capacity)
        d = decoding(t, [1, 2, 3], 10, max_new=max_new)     # 3 held, 1 generated
        plan = schedule(t, budget, Fixed([11, 12, 13, 14, 15]), 5)
        assert len(plan.entries[0].draft) == expected, (capacity, budget, max_new)
        assert not plan.ended and d.status is Status.DECODE


def test_a_full_context_ends_the_request_while_planning():
    t = table(capacity=3)
    d = decoding(t, [1, 2, 3], 10)
    plan = schedule(t, 8)
    assert plan.entries == [] and [(e.state, e.token) for e in plan.ended] == [(d, None)]
    assert d.finish_reason == FinishReason.LENGTH and d.context_full and t.slots[d.slot.index].state is None


def test_a_window_slides_for_the_decode_token_and_drafts_fill_only_the_room_left():
    t = table(capacity=8)
    d = decoding(t, list(range(1, 9)), 10, window=WindowPolicy("window", n_keep=2))
    plan = schedule(t, 64, Fixed([11, 12, 13, 14, 15]), 5)
    assert t.slots[d.slot.index].shifts == 1 and len(d.slot.tokens) == 5     # 6 after the keep, half discarded
    assert plan.entries[0].draft == [11, 12]                                     # 5 + 1 + 2 = 8


def entry(t, draft, pending=10, max_new=8, **kw) -> PlanEntry:
    decoding(t, [1, 2, 3], pending, max_new=max_new, **kw)
    return schedule(t, 64, Fixed(draft), len(draft)).entries[0]


def test_update_keeps_confirmed_drafts_going_and_a_mismatch_becomes_the_next_pending_token():
    t = table()
    e = entry(t, [11, 12, 13])
    events, more = update([e], [11], 1.0)
    assert more == [e] and [ev.token for ev in events] == [11] and e.accepted == 1
    events, more = update([e], [5], 1.0)
    assert more == [] and [ev.token for ev in events] == [5] and e.state.pending == 5
    assert e.state.tokens == [10, 11, 5] and e.state.timings.accepted == 1
    assert e.kept() == 3 + 2      # pending 10 and confirmed 11 stay fed; 12, 13 are cut


def test_update_ends_on_a_stop_id_or_max_new_tokens_and_counts_the_rows_read():
    t = table()
    e = entry(t, [11, 12], stop_ids=[12])
    update([e], [11], 1.0)
    events, more = update([e], [12], 1.0)
    assert more == [] and [ev.token for ev in events] == [None] and e.state.finish_reason == FinishReason.STOP
    assert e.state.tokens == [10, 11] and e.kept() == 3 + 2
    t2 = table()
    e2 = entry(t2, [11, 12], max_new=2)      # one token left: no draft may run past it
    assert e2.draft == []
    events, _ = update([e2], [7], 1.0)
    assert [ev.token for ev in events] == [7, None] and e2.state.finish_reason == FinishReason.LENGTH


def test_every_draft_confirmed_adds_the_token_after_them():
    t = table()
    e = entry(t, [11, 12])
    for token in (11, 12):
        _, more = update([e], [token], 1.0)
        assert more == [e]
    _, more = update([e], [40], 1.0)
    assert more == [] and e.state.pending == 40 and e.kept() == 3 + 3 and e.accepted == 2


def test_logits_rows_of_a_verification_are_the_positions_after_each_fed_token():
    from glmcore.engine.step import row_of
    t = table()
    e = entry(t, [11, 12])
    logits = [np.arange(3)[:, None] * np.ones((1, 4))]
    assert [row_of(e, logits, True)[0] for e.rounds in range(3)] == [0, 1, 2]


def test_the_scheduler_class_stays_a_loop_over_the_pieces():
    """Issue 38: planning, masking, sampling, updating and the slot policy live in their own modules (each tested
    above with a fake batch); the Scheduler class only drives them, in under 150 lines."""
    import ast
    import glmcore.engine.scheduler as module
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler"]
    assert cls.end_lineno - cls.lineno + 1 < 150
