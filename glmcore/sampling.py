"""Token sampling in numpy: identical for every backend, so switching backends never changes meaning."""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from .errors import SamplingError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8       # 0 = greedy
    top_p: float = 0.8             # the GLM models' own generation defaults
    top_k: int = 0                 # 0 = off
    repetition_penalty: float = 1.0
    seed: int | None = None
    # OpenAI's additive penalties, over the generated tokens only (vLLM's apply_penalties counts the output
    # tokens for both; only repetition_penalty looks at the prompt too): logit - frequency * count - presence
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)     # token id -> added to its logit

    MAX_PENALTY = 2.0          # OpenAI's range for presence/frequency, [-2, 2]
    MAX_BIAS = 100.0           # and for logit_bias, [-100, 100]

    def __post_init__(self):
        checks = [
            (self.temperature >= 0 and np.isfinite(self.temperature), f"temperature {self.temperature}",
             "use 0 (greedy) or a positive value"),
            (0 < self.top_p <= 1, f"top-p {self.top_p}", "use a value in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, f"top-k {self.top_k}", "use 0 (off) or a positive integer"),
            (self.repetition_penalty > 0 and np.isfinite(self.repetition_penalty),
             f"repetition penalty {self.repetition_penalty}", "use a positive value (1 = off)"),
            (self.seed is None or (isinstance(self.seed, int) and self.seed >= 0), f"seed {self.seed}",
             "use a non-negative integer"),
            (abs(self.presence_penalty) <= self.MAX_PENALTY, f"presence penalty {self.presence_penalty}",
             f"use a value in [-{self.MAX_PENALTY:g}, {self.MAX_PENALTY:g}] (0 = off)"),
            (abs(self.frequency_penalty) <= self.MAX_PENALTY, f"frequency penalty {self.frequency_penalty}",
             f"use a value in [-{self.MAX_PENALTY:g}, {self.MAX_PENALTY:g}] (0 = off)"),
        ]
        for token, bias in self.logit_bias.items():
            checks.append((isinstance(token, int) and not isinstance(token, bool) and token >= 0,
                           f"logit bias token id {token!r}", "use a non-negative integer token id"))
            checks.append((abs(bias) <= self.MAX_BIAS, f"logit bias {bias} for token {token}",
                           f"use a value in [-{self.MAX_BIAS:g}, {self.MAX_BIAS:g}]"))
        for ok, what, fix in checks:
            if not ok:
                raise SamplingError(f"invalid {what}: {fix}")

    # Below this a temperature only divides logits into inf/NaN (5e-324 did): it samples the argmax anyway,
    # so it is greedy, as vLLM's _SAMPLING_EPS treats it.
    GREEDY_BELOW = 1e-5

    @property
    def greedy(self) -> bool:
        return self.temperature < self.GREEDY_BELOW or self.top_k == 1

    def check_vocab(self, n_vocab: int) -> None:
        """Refuse a logit_bias id outside the vocabulary (the model's; padding rows of the output layer are not)."""
        bad = sorted(t for t in self.logit_bias if t >= n_vocab)
        if bad:
            raise SamplingError(f"invalid logit bias token id {bad[0]}: the vocabulary's ids are 0..{n_vocab - 1}")


# The sampling a checkpoint recommends: generation_config.json's keys (those vLLM's default `--generation-config
# auto` reads; transformers' generate() samples with them) or a GGUF's general.sampling.* (llama.cpp's converter
# writes them from that file and llama-server reads them). They replace SamplingParams' own defaults; a request's
# or a flag's value still wins. do_sample is not read (vLLM and llama.cpp do not either).
RECOMMENDED_KEYS = {"temperature": float, "top_p": float, "top_k": int, "repetition_penalty": float}
GGUF_RECOMMENDED_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                         "general.sampling.top_k": "top_k", "general.sampling.penalty_repeat": "repetition_penalty"}


def recommended(values: Mapping[str, object], where: str) -> SamplingParams:
    """SamplingParams with the recommended values `values` holds (absent or null ones keep glmcore's defaults); a
    value that is not a number, or is out of range, is one line naming `where` and the key. top_k <= 0 is off,
    as vLLM (-1) and llama.cpp (0) read it."""
    given = {}
    for key, kind in RECOMMENDED_KEYS.items():
        v = values.get(key)
        if v is None:
            continue
        # JSON ints are unbounded (numpy refuses those past int64); the bound also refuses inf and NaN
        number = isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 1e300
        if not number or (kind is int and not float(v).is_integer()):
            shown = repr(v)[:40]
            raise SamplingError(f"{where}: {key} is {shown}, not a{'n integer' if kind is int else ' number'}; fix "
                                "the value or delete the key")
        given[key] = max(int(v), 0) if kind is int else float(v)
    try:
        return replace(SamplingParams(), **given)
    except SamplingError as e:
        raise SamplingError(f"{where}: {e}; or delete the key") from None


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float32 log-probabilities of float32 logits [..., vocab] (the normalizer summed in float64); a masked
    (-inf) logit stays -inf."""
    x = np.asarray(logits, dtype=np.float32)
    m = x.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(x - m).sum(axis=-1, keepdims=True, dtype=np.float64)).astype(np.float32)
    return x - m - lse


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability at its position, and the n likeliest tokens there (most likely first)."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(row: np.ndarray, token: int, n_top: int, n_vocab: int | None = None) -> TokenLogprob:
    """log_softmax of a logits row at `token`, with its n_top likeliest ids (ties in id order). Normalized over
    the whole row, the output layer's padding ids included, as transformers' and vLLM's logprobs and the
    harness's scores are; the alternatives are ids < n_vocab only (padding ids are never sampled or shown)."""
    lp = log_softmax(row)
    top = ()
    if n_top > 0:
        shown = lp[:n_vocab] if n_vocab else lp
        k = min(n_top, shown.size)
        cand = np.argpartition(-shown, k - 1)[:k]
        cand = cand[np.lexsort((cand, -lp[cand]))]
        top = tuple((int(i), float(lp[i])) for i in cand)
    return TokenLogprob(int(token), float(lp[token]), top)


class Sampler:
    """One request's sampler: its parameters and its own RNG.

    The distribution is the plain one -- sort the vocabulary, softmax, keep the smallest top set whose
    mass reaches top_p, draw with rng.choice -- but only the candidates that can be in that set are
    sorted: tokens within a logit margin of the maximum, found in O(vocab) and widened until their
    mass reaches top_p. That is ~0.2 ms at 151,552 ids instead of ~25 ms for a full sort.
    """

    MARGINS = (8.0, 16.0, 32.0)     # in units of (logit - max) / temperature; e^-32 is below f32 noise

    def __init__(self, params: SamplingParams, n_vocab: int | None = None):
        if n_vocab:
            params.check_vocab(n_vocab)
        self.params = params
        self.n_vocab = n_vocab          # ids >= n_vocab are padding rows of the output layer
        self.rng = np.random.default_rng(params.seed)
        self._bias = (np.fromiter(params.logit_bias, dtype=np.int64, count=len(params.logit_bias)),
                      np.fromiter(params.logit_bias.values(), dtype=np.float32, count=len(params.logit_bias)))

    def __call__(self, logits: np.ndarray, history: Iterable[int] = (), generated: Sequence[int] = ()) -> int:
        """history: prompt and generated ids (the repetition penalty); generated: the ids this request
        generated (presence and frequency penalties)."""
        ids, probs = self.distribution(logits, history, generated)
        return int(ids[0]) if probs is None else int(ids[self.rng.choice(len(probs), p=probs)])

    def verify(self, logits: np.ndarray, history: Iterable[int], draft: int, generated: Sequence[int] = ()) -> int:
        """Speculative decoding's acceptance of a drafted token (the drafters propose one token, not a
        distribution): the draft is kept with probability p(draft), else a token is drawn from p with the
        draft removed -- rejection sampling with a one-point draft distribution, so the token's
        distribution is exactly p (greedy: the argmax, accepted iff it is the draft)."""
        ids, probs = self.distribution(logits, history, generated)
        if probs is None:
            return int(ids[0])
        hit = np.flatnonzero(ids == draft)
        if not hit.size:
            return int(ids[self.rng.choice(len(probs), p=probs)])
        p_draft = float(probs[hit[0]])
        if self.rng.random() < p_draft:
            return int(draft)
        rest = probs.copy()
        rest[hit[0]] = 0.0
        return int(ids[self.rng.choice(len(rest), p=rest / rest.sum())])

    @property
    def takes_argmax(self) -> bool:
        """Greedy on the row as it comes (no logit_bias or penalty moves it): the token is the row's argmax."""
        p = self.params
        return p.greedy and not (p.logit_bias or p.repetition_penalty != 1.0 or p.presence_penalty
                                 or p.frequency_penalty)

    def adjusted(self, logits: np.ndarray, history: Iterable[int] = (), generated: Sequence[int] = ()) -> np.ndarray:
        """The logits the distribution is drawn from, as vLLM's sampler orders it: the row comes masked (the
        grammar, min_tokens: -inf) and stays masked, as -inf plus anything is -inf; then logit_bias, the
        repetition penalty (prompt and output), the frequency and presence penalties (output only). A view
        of the row when nothing applies."""
        p = self.params
        x = np.asarray(logits[: self.n_vocab] if self.n_vocab else logits, dtype=np.float32)
        if not (p.logit_bias or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty):
            return x
        x = x.copy()
        if p.logit_bias:
            ids, bias = self._bias
            inside = ids < x.size
            x[ids[inside]] += bias[inside]
        if p.repetition_penalty != 1.0:
            seen = np.fromiter(set(history), dtype=np.int64)
            seen = seen[(seen >= 0) & (seen < x.size)]
            v = x[seen]
            x[seen] = np.where(v > 0, v / np.float32(p.repetition_penalty), v * np.float32(p.repetition_penalty))
        if (p.presence_penalty or p.frequency_penalty) and len(generated):
            out = np.asarray(generated, dtype=np.int64)
            ids, counts = np.unique(out[(out >= 0) & (out < x.size)], return_counts=True)
            x[ids] -= np.float32(p.frequency_penalty) * counts.astype(np.float32) + np.float32(p.presence_penalty)
        return x

    def distribution(self, logits: np.ndarray, history: Iterable[int] = (),
                     generated: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray | None]:
        """The ids that can be drawn, most likely first, and their probabilities (None: greedy, one id)."""
        p = self.params
        x = self.adjusted(logits, history, generated)
        top = int(np.argmax(x))
        if not np.isfinite(x[top]):             # argmax lands on the first NaN if there is one
            raise SamplingError("the backend returned non-finite logits (NaN or inf); the model or backend is "
                                "broken: check the checkpoint, or try --precision f32")
        if p.greedy:
            return np.array([top]), None
        cand = None
        if 0 < p.top_k < x.size:
            kth = np.partition(x, -p.top_k)[-p.top_k]
            cand = np.flatnonzero(x >= kth)          # ties at the k-th value stay, as with a -inf mask
        return self._nucleus(x, float(x[top]), cand)

    def _nucleus(self, x: np.ndarray, m: float, cand: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """m: the largest logit."""
        p, t = self.params, self.params.temperature
        tail = 0.0
        if cand is None:
            e = np.subtract(x, np.float32(m))         # one scratch buffer, then in place: 3 passes over V
            e *= np.float32(1.0 / t)
            np.exp(e, out=e)
            total = float(e.sum())
            cand = None
            for margin in self.MARGINS if p.top_p < 1.0 else ():
                keep = np.flatnonzero(e >= np.float32(np.exp(-margin)))
                mass = float(e[keep].sum())
                if mass >= (p.top_p + 1e-6) * total:
                    cand, tail = keep, total - mass
                    break
            if cand is None:
                cand = np.arange(x.size)
        # the few that matter, in float64 exactly as the plain sampler computes them
        xs = x[cand].astype(np.float64) / t
        order = np.argsort(-xs, kind="stable")        # cand is ascending, so ties keep id order
        probs = np.exp(xs[order] - m / t)
        probs /= probs.sum() + tail                   # tail: the mass outside the candidates (same scale)
        ids = cand[order]
        if p.top_p < 1.0:
            cut = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            probs, ids = probs[:cut], ids[:cut]
        return ids, probs / probs.sum()


def sample_batch(samplers: Sequence[Sampler], logits: np.ndarray, histories: Sequence[Iterable[int]],
                 generated: Sequence[Sequence[int]] | None = None) -> list[int | SamplingError]:
    """Logits [B, vocab] in, B tokens out; row i is drawn by samplers[i] with its own parameters and RNG.
    A row whose logits are broken gives its SamplingError instead of a token, so one bad request does
    not fail the others."""
    out: list[int | SamplingError] = []
    for s, row, h, g in zip(samplers, logits, histories, generated or [()] * len(samplers)):
        try:
            out.append(s(row, h, g))
        except SamplingError as e:
            out.append(e)
    return out
