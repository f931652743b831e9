"""The checkpoints the suite and the benchmark run on, and the token ids they feed.

Synthetic checkpoints are made once with glmcore.synth.make_model under
`glmcore.model.cache_root()/<purpose>/` and reused; a user's real checkpoint is read in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from glmcore.config import ModelConfig
from glmcore.errors import GlmcoreError
from glmcore.weights import Weights, load_weights

# A few paragraphs of ordinary text: on a real checkpoint, teacher-forcing natural text gives the
# activations (outlier channels included) that quantization errors really meet.
TEXT = (
    "The quick brown fox jumps over the lazy dog. 你好！我是人工智能助手，很高兴认识你。"
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    "Large language models predict the next token from the tokens before it; the key and value "
    "vectors of earlier tokens are kept in a cache so that each new token costs one step. "
    "北京是中国的首都，有三千多年的历史。长城、故宫和天坛都是著名的名胜古迹。"
    "Quantization stores weights in fewer bits: eight-bit integers with one scale per channel, or "
    "four-bit integers with one scale per group of thirty-two values. 1, 2, 3, 5, 8, 13, 21, 34.\n"
)


@dataclass
class Model:
    path: Path
    config: ModelConfig
    weights: Weights
    synthetic: bool

    @property
    def label(self) -> str:
        return self.config.family if self.synthetic else f"{self.config.family} ({self.path.name})"


# One seed per family: at tiny size chatglm2 and chatglm3 have the same shapes, and different weights
# make them two checks instead of one.
FAMILY_SEEDS = {"chatglm2": 2, "chatglm3": 3, "glm4": 4, "glm4-0414": 5, "glm-edge": 6, "glm4-moe": 7,
                "glm4-moe-lite": 8}


def synthetic_dir(family: str, size: str = "tiny", purpose: str = "conformance", seed: int | None = None) -> Path:
    """A synthetic checkpoint in the cache, made on first use (glmcore.synth.cached_model)."""
    from glmcore.synth import cached_model
    return cached_model(family, size, FAMILY_SEEDS.get(family, 0) if seed is None else seed, purpose)


def open_model(path: str | Path, synthetic: bool = False) -> Model:
    path = Path(path)
    if not path.is_dir():
        raise GlmcoreError(f"--model {str(path)!r} is not a directory; point it at a checkpoint directory "
                           "(config.json + weights), or drop it to use the synthetic models")
    config = ModelConfig.from_dir(path)
    return Model(path, config, load_weights(path, config), synthetic)


class TokenSource:
    """Deterministic token ids for the cases: the text above, tokenized by the model's own tokenizer
    and repeated as needed; random ids where the tokenizer cannot be loaded. Each `take` continues
    where the last stopped, so consecutive cases see different ids."""

    def __init__(self, model: Model, seed: int = 0):
        vocab = model.config.vocab_size
        ids: list[int] = []
        try:
            from glmcore.tokenizer import load_tokenizer
            ids = [i for i in load_tokenizer(model.path, model.config.family).encode(TEXT) if 0 <= i < vocab]
        except Exception:       # no or unreadable tokenizer: random ids serve as well for teacher forcing
            ids = []
        if len(ids) < 64:
            ids = np.random.default_rng(seed).integers(0, vocab, 4096).tolist()
        self.pool = ids
        self.pos = 0

    def take(self, n: int) -> list[int]:
        out = [self.pool[(self.pos + i) % len(self.pool)] for i in range(n)]
        self.pos = (self.pos + n) % len(self.pool)
        return out
