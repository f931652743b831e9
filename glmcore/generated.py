"""The tensors of a synthetic checkpoint, made from its seed: what `make-model` stores, and what a checkpoint
written with `--generated-weights` (no weight files) reads as its weights. One function makes each tensor, so
the two are the same bits."""
from __future__ import annotations

import json
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from . import arch
from .arch import Role
from .config import ModelConfig
from .errors import GlmcoreError

DTYPES = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "bf16": np.dtype(ml_dtypes.bfloat16)}


def init_tensor(name: str, spec, cfg: ModelConfig, seed: int) -> np.ndarray:
    """Deterministic per tensor (independent of sharding), scaled by its role (glmcore.arch.Role) so that
    attention is sharp and logits are peaked, as in a trained model: precision errors then show up in
    top-1 agreement, and a positional bug (rotary off by one) changes the output visibly."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    shape, role, h = spec.shape, spec.role, cfg.hidden_size
    if role is Role.NORM:
        return 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    if role is Role.BIAS:
        return 0.2 * rng.standard_normal(shape, dtype=np.float32)
    if role is Role.EMBEDDING:
        return rng.standard_normal(shape, dtype=np.float32)
    if role is Role.ROUTER_BIAS:
        return 0.05 * rng.standard_normal(shape, dtype=np.float32)     # moves some choices, as trained ones do
    if role is Role.ROUTER:
        std = 2.0 / np.sqrt(h)        # logits ~ N(0, 4): sigmoid scores spread, the top-k distinct
    if role is Role.QUERY_KEY:
        std = 1.6 / np.sqrt(h)        # q.k/sqrt(d) ~ N(0, 2.5): sharp, position-dependent attention
    elif role is Role.OUTPUT:
        std = 6.0 / np.sqrt(h)        # logits ~ N(0, 36): a confident next-token distribution
    else:
        std = 1.0 / np.sqrt(shape[-1])  # keeps each residual update around unit scale
    return (std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)



GENERATED = "generated"
MAX_ELEMENTS = 1 << 31     # per generated tensor (8 GiB of f32): the largest real GLM tensor has 0.8 G


class GeneratedWeights(Mapping):
    """The canonical tensors of a synthetic checkpoint written without weight files (`make-model
    --generated-weights`): each is made when read, exactly as make-model would have stored it (same seed, same
    dtype), and is not kept. A model whose weights do not fit on the disk (GLM-4.7-Flash at full depth) is then
    converted by streaming: `glmcore convert --backend cpu_int4` reads one tensor at a time."""

    def __init__(self, cfg: ModelConfig, seed: int, dtype: str, path: Path):
        module = arch.of(cfg)
        self._specs = {**module.tensors(cfg), **module.optional_tensors(cfg)}
        self._tied = not module.stored_names(cfg)("lm_head.weight")
        self._seed, self._dtype = seed, DTYPES[dtype]
        self.config, self.files = cfg, [path / "config.json"]

    def __getitem__(self, name: str) -> np.ndarray:
        src = "embed.weight" if self._tied and name == "lm_head.weight" else name
        spec = self._specs[src]
        if int(np.prod(spec.shape, dtype=np.float64)) > MAX_ELEMENTS:
            raise GlmcoreError(f"{self.files[0]}: tensor {name} of shape {spec.shape} is too large to generate "
                               f"(over {MAX_ELEMENTS} values); fix the sizes in config.json")
        return init_tensor(src, spec, self.config, self._seed).astype(self._dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def __contains__(self, name) -> bool:
        return name in self._specs

    def f32(self, name: str) -> np.ndarray:
        return np.asarray(self[name], dtype=np.float32)

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    def fingerprint(self) -> str:
        import hashlib
        blob = json.dumps({"config": self.config.to_dict(), "seed": self._seed, "dtype": self._dtype.name,
                           "weights": GENERATED}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def generated_weights(model_dir: Path, cfg: ModelConfig) -> GeneratedWeights | None:
    """The weights of a checkpoint made with --generated-weights (None for any other checkpoint)."""
    try:
        mark = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")).get("glmcore_synthetic")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None             # the config reader has said what is wrong with it already, or will
    if not isinstance(mark, dict) or mark.get("weights") != GENERATED:
        return None
    seed, dtype = mark.get("seed"), mark.get("dtype")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64 or dtype not in DTYPES:
        raise GlmcoreError(f"{model_dir / 'config.json'}: glmcore_synthetic needs an integer seed and a dtype of "
                           f"{', '.join(DTYPES)} to generate its weights; make the model again")
    return GeneratedWeights(cfg, seed, dtype, Path(model_dir))
