"""The cases: what is fed to a backend session and to the reference, teacher-forced on the same ids.

Each case function drives one Session (the backend's or the reference's) and returns the logits to
compare. The same function runs on both sides wherever the math is the same; where the reference must
take another road to the same answer (a chat continuation re-prefilled whole, a window shift
recomputed), the reference side is its own function next to it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from glmcore.backend import BatchSession, Capabilities, Session, SessionAdapter
from glmcore.scheduler import Request, Scheduler, WindowPolicy
from glmcore.errors import GlmcoreError
from glmcore.sampling import SamplingParams

from .models import TokenSource

# Case names, in the order they run on one session.
CASES = ("prefill", "decode", "decode_vs_prefill", "reset_reuse", "near_capacity", "window_shift",
         "chat_continuation", "seed", "batch_mixed", "batch_generate")

PROMPT = 24            # prefill case
REUSE = (16, 8)        # reset_reuse: prompt, decode steps
SHIFT = (48, 4, 16, 16)   # window_shift: prompt, n_keep, n_discard, decode steps after the shift
CHAT = (16, 8, 12, 8)  # chat_continuation: turn 1, reply 1, turn 2, reply 2
SEED = (8, 16, 1234)   # seed: prompt, new tokens, sampling seed
BATCH_SLOTS = 4
BATCH_GEN = (8, 6, 16)  # batch_generate: requests, new tokens each, token budget per step
MIN_CAPACITY = max(PROMPT + REUSE[0] + 1, SHIFT[0] + 1, sum(CHAT) + 1, sum(SEED[:2]))


class ContractError(Exception):
    """The session broke the Session contract (kv_len, shapes), independent of numerics."""


@dataclass
class Script:
    """Every id a run feeds, fixed per model and capacity, so reference results can be reused."""
    capacity: int
    prompt: list[int]
    steps: list[int]
    reuse_prompt: list[int]
    reuse_steps: list[int]
    near: list[int]
    near_step: int
    shift_prompt: list[int]
    n_keep: int
    n_discard: int
    shift_steps: list[int]
    turn1: list[int]
    reply1: list[int]
    turn2: list[int]
    reply2: list[int]
    seed_prompt: list[int]
    batch_ops: list[tuple]
    gen_prompts: list[list[int]]

    @classmethod
    def build(cls, source: TokenSource, capacity: int, decode_steps: int) -> "Script":
        if capacity < max(MIN_CAPACITY, PROMPT + decode_steps):
            raise GlmcoreError(f"capacity {capacity} is too small for the suite: it needs at least "
                               f"{max(MIN_CAPACITY, PROMPT + decode_steps)} (prompt {PROMPT} + {decode_steps} "
                               "decode steps); raise --capacity or lower --decode-steps")
        t = source.take
        return cls(capacity=capacity, prompt=t(PROMPT), steps=t(decode_steps),
                   reuse_prompt=t(REUSE[0]), reuse_steps=t(REUSE[1]),
                   near=t(capacity - 1), near_step=t(1)[0],
                   shift_prompt=t(SHIFT[0]), n_keep=SHIFT[1], n_discard=SHIFT[2], shift_steps=t(SHIFT[3]),
                   turn1=t(CHAT[0]), reply1=t(CHAT[1]), turn2=t(CHAT[2]), reply2=t(CHAT[3]),
                   seed_prompt=t(SEED[0]), batch_ops=batch_ops(t),
                   gen_prompts=[t(3 + 2 * i) for i in range(BATCH_GEN[0])])

    @property
    def kept(self) -> list[int]:
        p, k, d = self.shift_prompt, self.n_keep, self.n_discard
        return p[:k] + p[k + d:]


def expect_len(s: Session, n: int, after: str) -> None:
    if s.kv_len != n:
        raise ContractError(f"kv_len is {s.kv_len} after {after}, expected {n}")


def expect_rows(logits: np.ndarray, rows: int | None, vocab: int, what: str) -> np.ndarray:
    shape = (vocab,) if rows is None else (rows, vocab)
    logits = np.asarray(logits)
    if logits.shape != shape:
        raise ContractError(f"{what} returned logits of shape {logits.shape}, expected {shape}")
    if logits.dtype != np.float32:
        raise ContractError(f"{what} returned {logits.dtype} logits, the contract is float32")
    return logits


def fresh(s: Session) -> None:
    if s.kv_len:
        s.reset()
        expect_len(s, 0, "reset()")


def one_slot(s: Session, can_shift: bool, vocab: int | None = None) -> Scheduler:
    """The core's loop over a single session, as load_batch's default adapter gives it."""
    return Scheduler(SessionAdapter([s]), Capabilities(can_shift=can_shift), n_vocab=vocab)




def _decode_all(s: Session, ids: list[int], vocab: int, start: int) -> np.ndarray:
    out = []
    for i, t in enumerate(ids):
        out.append(expect_rows(s.decode(t), None, vocab, "decode"))
        expect_len(s, start + i + 1, f"decode step {i + 1}")
    return np.stack(out) if out else np.zeros((0, vocab), np.float32)


def _prefill_all(s: Session, ids: list[int], vocab: int, start: int = 0) -> np.ndarray:
    logits = expect_rows(s.prefill(ids, all_logits=True), len(ids), vocab, f"prefill of {len(ids)} ids")
    expect_len(s, start + len(ids), f"prefill of {len(ids)} ids")
    return logits


# ---------------------------------------------------------------- cases run identically on both sides

def prefill_decode(s: Session, sc: Script, vocab: int) -> dict[str, np.ndarray]:
    """Logits at every prompt position, then one decode step per teacher-forced id."""
    fresh(s)
    pre = _prefill_all(s, sc.prompt, vocab)
    dec = _decode_all(s, sc.steps, vocab, len(sc.prompt))
    return {"prefill": pre, "decode": dec}


def one_shot_prefill(s: Session, sc: Script, vocab: int) -> dict[str, np.ndarray]:
    """The prompt and every decoded id in one prefill: what the decode steps must reproduce."""
    fresh(s)
    return {"decode_vs_prefill": _prefill_all(s, sc.prompt + sc.steps, vocab)}


def reset_reuse(s: Session, sc: Script, vocab: int) -> dict[str, np.ndarray]:
    """reset() a session that holds a sequence, then run another: nothing of the first may leak."""
    if s.kv_len == 0:                      # make it dirty when the previous case did not run
        s.prefill(sc.prompt)
    s.reset()
    expect_len(s, 0, "reset()")
    pre = _prefill_all(s, sc.reuse_prompt, vocab)
    dec = _decode_all(s, sc.reuse_steps, vocab, len(sc.reuse_prompt))
    return {"reset_reuse": np.concatenate([pre, dec])}


def near_capacity(s: Session, sc: Script, vocab: int) -> dict[str, np.ndarray]:
    """A prompt of capacity-1 ids, then one decode that fills the last slot."""
    fresh(s)
    pre = _prefill_all(s, sc.near, vocab)
    dec = _decode_all(s, [sc.near_step], vocab, len(sc.near))
    return {"near_capacity": np.concatenate([pre, dec])}


def chat_continuation(s: Session, sc: Script, vocab: int) -> dict[str, np.ndarray]:
    """Turn 1, a reply decoded token by token, then turn 2 appended to the cache by prefill."""
    fresh(s)
    s.prefill(sc.turn1)
    _decode_all(s, sc.reply1, vocab, len(sc.turn1))
    start = len(sc.turn1) + len(sc.reply1)
    turn2 = _prefill_all(s, sc.turn2, vocab, start)
    reply2 = _decode_all(s, sc.reply2, vocab, start + len(sc.turn2))
    return {"chat_continuation": np.concatenate([turn2, reply2])}


def chat_continuation_reference(s: Session, sc: Script, vocab: int) -> dict[str, np.ndarray]:
    """The same logits from one prefill of the whole history."""
    fresh(s)
    history = sc.turn1 + sc.reply1 + sc.turn2
    turn2 = _prefill_all(s, history, vocab)[-len(sc.turn2):]
    reply2 = _decode_all(s, sc.reply2, vocab, len(history))
    return {"chat_continuation": np.concatenate([turn2, reply2])}


# ---------------------------------------------------------------- window shift

def window_shift(s: Session, sc: Script, vocab: int, can_shift: bool) -> dict[str, np.ndarray]:
    """Through the core's scheduler, as in production: shift() in place when the backend can, else the
    scheduler's fallback (reset, re-prefill the kept ids). Then decode past the shift."""
    fresh(s)
    sched, window = one_slot(s, can_shift), WindowPolicy()
    sched.feed(sched.slots[0], sc.shift_prompt, window)
    sched.table.shift(sched.slots[0], sc.n_keep, sc.n_discard)
    expect_len(s, len(sc.kept), f"shift({sc.n_keep}, {sc.n_discard})")
    out = []
    for i, t in enumerate(sc.shift_steps):
        out.append(expect_rows(sched.feed(sched.slots[0], [t], window), None, vocab, "decode after the shift"))
        expect_len(s, len(sc.kept) + i + 1, f"decode step {i + 1} after the shift")
    return {"window_shift": np.stack(out)}


def window_shift_reference(s: Session, sc: Script, vocab: int, in_place) -> dict[str, np.ndarray]:
    """Recompute: the kept ids prefilled at their new, contiguous positions. That is exactly what a
    backend without shift() does, and the answer it must give.

    In place (`in_place` is a function shifting the reference's own cache): a backend that shifts in
    place keeps the K/V it computed while the discarded tokens were still there; from the second layer
    on those depend on the discarded tokens, so in-place shifting (StreamingLLM) is not equal to
    recomputing. Its reference is the same operation done on the reference's cache: drop the slots,
    rotate the later keys back by n_discard positions."""
    fresh(s)
    if in_place is None:
        s.prefill(sc.kept)
    else:
        s.prefill(sc.shift_prompt)
        in_place(s, sc.n_keep, sc.n_discard)
        expect_len(s, len(sc.kept), "the reference's shift")
    return {"window_shift": _decode_all(s, sc.shift_steps, vocab, len(sc.kept))}


# ---------------------------------------------------------------- seed

def seeded_tokens(s: Session, sc: Script, vocab: int, can_shift: bool) -> list[int]:
    """Sampled generation through the core's scheduler and Sampler with a fixed seed."""
    n_new, seed = SEED[1], SEED[2]
    fresh(s)
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=seed)   # a genuine draw every step
    return list(one_slot(s, can_shift, vocab).submit(Request(sc.seed_prompt, params, n_new)))


# ---------------------------------------------------------------- batch sessions (contract v2)

def batch_ops(take) -> list[tuple]:
    """Mixed steps over 4 slots: slots of different lengths, a chunk prefilled while others decode, a
    slot freed and reused, a prefix copied between slots, a window shift in one slot, a prefix restored
    as the prompt cache restores one (export_prefix, import_prefix) into a slot that held another."""
    one = lambda: take(1)           # noqa: E731 -- a decode token
    return [
        ("step", [(0, take(12)), (1, take(7)), (2, take(20))]),
        ("step", [(0, one()), (1, one()), (2, take(5))]),
        ("reset", 1),
        ("step", [(1, take(9)), (0, one()), (2, one())]),
        ("copy", 0, 3, 8),
        ("step", [(3, take(4)), (0, one()), (1, one())]),
        ("shift", 2, 4, 8),
        ("step", [(2, one()), (3, one()), (1, one())]),
        ("restore", 1, 0, 10),
        ("step", [(2, one()), (0, one())]),
    ]


def batch_mixed(bs: BatchSession, sc: Script, vocab: int, caps: Capabilities) -> dict[str, np.ndarray]:
    """The ops on the backend's batch session; the logits of every entry, in op order. A shift on a
    backend that cannot shift in place, and a copy on one without native batching, are the scheduler's
    fallbacks (reset, re-prefill the kept ids)."""
    held = [[] for _ in range(bs.n_slots)]
    rows, steps = [], 0
    for op in sc.batch_ops:
        if op[0] == "step":
            steps += 1
            if steps % 2:
                out = expect_rows(bs.step(op[1]), len(op[1]), vocab, "a batch step")
            else:    # every other step, some entries want every position's logits (a draft verification beside others)
                out = _last_rows(bs.step(op[1], [j % 2 == 0 for j in range(len(op[1]))]), op[1], vocab)
            for (slot, ids), row in zip(op[1], out):
                held[slot] += ids
                rows.append(row)
        elif op[0] == "reset":
            bs.reset(op[1])
            held[op[1]] = []
        elif op[0] in ("copy", "restore"):
            _, src, dst, n = op
            held[dst] = held[src][:n]
            if op[0] == "restore" and caps.kv_export:
                bs.import_prefix(dst, bs.export_prefix(src, n))
            elif caps.native_batch:
                bs.copy_prefix(src, dst, n)
            else:
                bs.reset(dst)
                bs.step([(dst, held[dst])])
        else:
            _, slot, keep, discard = op
            held[slot] = held[slot][:keep] + held[slot][keep + discard:]
            if caps.can_shift:
                bs.shift(slot, keep, discard)
            else:
                bs.reset(slot)
                bs.step([(slot, held[slot])])
        for slot, ids in enumerate(held):
            if bs.kv_len(slot) != len(ids):
                raise ContractError(f"slot {slot} has kv_len {bs.kv_len(slot)} after {op[0]}, expected {len(ids)}")
    return {"batch_mixed": np.stack(rows)}


def _last_rows(out, entries, vocab: int) -> list[np.ndarray]:
    """Each entry's last row of a step that asked every position's logits of the even entries: those get
    [len(ids), vocab], the others [1, vocab] (or, wastefully but correctly, every position too)."""
    if len(out) != len(entries):
        raise ContractError(f"a batch step with per-entry all_logits returned {len(out)} arrays for {len(entries)} "
                            "entries")
    last = []
    for j, ((_, ids), rows) in enumerate(zip(entries, out)):
        n = np.asarray(rows).shape[0] if np.ndim(rows) == 2 else -1
        want = len(ids) if j % 2 == 0 else n if n in (1, len(ids)) else 1
        last.append(expect_rows(rows, want, vocab, f"entry {j} of a step with per-entry all_logits")[-1])
    return last


def batch_mixed_reference(s: Session, sc: Script, vocab: int, in_place) -> dict[str, np.ndarray]:
    """Each slot replayed alone on one single-sequence session; rows put back in the batch's order."""
    rows: dict[tuple[int, int], np.ndarray] = {}
    for slot in range(BATCH_SLOTS):
        fresh(s)
        held: list[int] = []
        for i, op in enumerate(sc.batch_ops):
            if op[0] == "step":
                for j, (sl, ids) in enumerate(op[1]):
                    if sl == slot:
                        rows[i, j] = s.prefill(ids)
                        held += ids
            elif op[0] == "reset" and op[1] == slot:
                s.reset()
                held = []
            elif op[0] in ("copy", "restore") and op[2] == slot:
                held = _slot_ids(sc, op[1], i)[:op[3]]
                s.reset()
                s.prefill(held)
            elif op[0] == "shift" and op[1] == slot:
                _, _, keep, discard = op
                held = held[:keep] + held[keep + discard:]
                if in_place is None:
                    s.reset()
                    s.prefill(held)
                else:
                    in_place(s, keep, discard)
    order = [(i, j) for i, op in enumerate(sc.batch_ops) if op[0] == "step" for j in range(len(op[1]))]
    return {"batch_mixed": np.stack([rows[k] for k in order])}


def _slot_ids(sc: Script, slot: int, before: int) -> list[int]:
    """The ids a slot holds before op number `before` (copies and resets followed, shifts not needed:
    only copies from unshifted slots are scripted)."""
    held: list[int] = []
    for op in sc.batch_ops[:before]:
        if op[0] == "step":
            held += [t for sl, ids in op[1] if sl == slot for t in ids]
        elif op[0] == "reset" and op[1] == slot:
            held = []
        elif op[0] in ("copy", "restore") and op[2] == slot:
            held = _slot_ids(sc, op[1], before)[:op[3]]
    return held


def batch_generate(bs: BatchSession, single: Session, sc: Script, vocab: int, caps: Capabilities) -> dict:
    """Greedy requests through the scheduler on the batch session, several in flight and prefill chunks
    mixed with decodes, against each request run alone through the scheduler on a single session; and a
    seeded request among them against the same request alone."""
    n, new, budget = BATCH_GEN
    sched = Scheduler(bs, caps, n_vocab=vocab, token_budget=budget)
    greedy = SamplingParams(temperature=0)
    seeded = SamplingParams(temperature=1.0, top_p=1.0, seed=SEED[2])
    params = [seeded if i == n // 2 else greedy for i in range(n)]
    handles = [sched.submit(Request(p, q, new)) for p, q in zip(sc.gen_prompts, params)]
    sched.run()
    together = [h.tokens for h in handles]
    alone = []
    for p, q in zip(sc.gen_prompts, params):
        fresh(single)
        alone.append(list(one_slot(single, caps.can_shift, vocab).submit(Request(p, q, new))))
    return {"together": together, "alone": alone, "seeded": n // 2}
