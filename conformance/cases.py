"""The cases: what is fed to a backend session and to the reference, teacher-forced on the same ids.

Each case function drives one Session (the backend's or the reference's) and returns the logits to
compare. The same function runs on both sides wherever the math is the same; where the reference must
take another road to the same answer (a chat continuation re-prefilled whole, a window shift
recomputed), the reference side is its own function next to it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from glmcore.backend import Session
from glmcore.engine import Engine, WindowPolicy
from glmcore.errors import GlmcoreError
from glmcore.sampling import SamplingParams

from .models import TokenSource

# Case names, in the order they run on one session.
CASES = ("prefill", "decode", "decode_vs_prefill", "reset_reuse", "near_capacity", "window_shift",
         "chat_continuation", "seed")

PROMPT = 24            # prefill case
REUSE = (16, 8)        # reset_reuse: prompt, decode steps
SHIFT = (48, 4, 16, 16)   # window_shift: prompt, n_keep, n_discard, decode steps after the shift
CHAT = (16, 8, 12, 8)  # chat_continuation: turn 1, reply 1, turn 2, reply 2
SEED = (8, 16, 1234)   # seed: prompt, new tokens, sampling seed
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
                   seed_prompt=t(SEED[0]))

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
    """Through the core's Engine, as in production: shift() in place when the backend can, else the
    Engine's fallback (reset, re-prefill the kept ids). Then decode past the shift."""
    fresh(s)
    engine = Engine(s, WindowPolicy("window", sc.n_keep, sc.n_discard), can_shift=can_shift)
    engine.feed(sc.shift_prompt)
    engine.shift(sc.n_keep, sc.n_discard)
    expect_len(s, len(sc.kept), f"shift({sc.n_keep}, {sc.n_discard})")
    out = []
    for i, t in enumerate(sc.shift_steps):
        out.append(expect_rows(engine.feed([t]), None, vocab, "decode after the shift"))
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
    """Sampled generation through the core's Engine and Sampler with a fixed seed."""
    n_new, seed = SEED[1], SEED[2]
    engine = Engine(s, can_shift=can_shift)
    engine.reset()
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=seed)   # a genuine draw every step
    return list(engine.generate(sc.seed_prompt, params, n_new, n_vocab=vocab))
