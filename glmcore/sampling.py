"""Token sampling in numpy: identical for every backend, so switching backends never changes meaning."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .errors import SamplingError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8       # 0 = greedy
    top_p: float = 0.8             # the GLM models' own generation defaults
    top_k: int = 0                 # 0 = off
    repetition_penalty: float = 1.0
    seed: int | None = None

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
        ]
        for ok, what, fix in checks:
            if not ok:
                raise SamplingError(f"invalid {what}: {fix}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class Sampler:
    def __init__(self, params: SamplingParams, n_vocab: int | None = None):
        self.params = params
        self.n_vocab = n_vocab          # ids >= n_vocab are padding rows of the output layer
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: Iterable[int] = ()) -> int:
        p = self.params
        x = np.array(logits[: self.n_vocab] if self.n_vocab else logits, dtype=np.float64)
        if p.repetition_penalty != 1.0:
            seen = np.fromiter(set(history), dtype=np.int64)
            seen = seen[seen < x.size]
            v = x[seen]
            x[seen] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if p.greedy:
            return int(np.argmax(x))
        x /= p.temperature
        if 0 < p.top_k < x.size:
            kth = np.partition(x, -p.top_k)[-p.top_k]
            x[x < kth] = -np.inf
        order = np.argsort(-x, kind="stable")
        probs = np.exp(x[order] - x[order[0]])
        probs /= probs.sum()
        if p.top_p < 1.0:
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            cut = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            probs = probs[:cut] / probs[:cut].sum()
            order = order[:cut]
        return int(order[self.rng.choice(len(probs), p=probs)])
