"""What an architecture module states: its canonical tensors (shape, and how each splits under tensor
parallelism), how published checkpoint names map onto them, its parameter count and synthetic sizes.

The rest of the core (weights.py, parallel.py, synth.py, the conformance suite) reads these statements
and knows no architecture; see glmcore/arch/__init__.py for the registry and docs/plugins.md for the
checklist of adding one.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class Split(enum.Enum):
    """How one canonical tensor ([out, in] for linear weights) is divided over tensor-parallel ranks."""
    REPLICATED = "replicated"     # every rank holds all of it (norms)
    VOCAB = "vocab"               # rows by vocabulary range (embedding, output layer)
    COLUMN = "column"             # output rows by `axis` (each of `blocks` stacked blocks split alike)
    ROW = "row"                   # input columns by `axis`; the partial products are summed across ranks
    EXPERT = "expert"             # whole experts per rank (leading dimension: experts)


class Axis(enum.Enum):
    """What a COLUMN/ROW split divides: the rank's query heads, its query heads and KV groups (a fused
    q|k|v tensor: q rows of my heads, then my KV groups' k rows, then their v rows), or its FFN columns."""
    HEADS = "heads"
    QKV = "qkv"
    FFN = "ffn"


class Role(enum.Enum):
    """What a tensor is for, so synthetic checkpoints initialise it sensibly without reading its name."""
    EMBEDDING = "embedding"
    NORM = "norm"
    BIAS = "bias"
    QUERY_KEY = "query_key"       # scaled for sharp, position-dependent attention
    LINEAR = "linear"
    OUTPUT = "output"             # the output layer: peaked logits
    ROUTER = "router"             # an MoE router: experts chosen by position-dependent, distinct scores
    ROUTER_BIAS = "router_bias"   # e_score_correction_bias: moves the choice, never the weights


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    split: Split = Split.REPLICATED
    axis: Axis | None = None      # for COLUMN and ROW
    blocks: int = 1               # COLUMN: stacked blocks split alike (a fused gate|up: 2)
    role: Role = Role.LINEAR


# canonical name -> (stored name -> the rows of the canonical tensor it holds, None: all of it)
StoredNames = Callable[[str], dict[str, "slice | None"]]


class Architecture:
    """One architecture: the config it parses and the layout it states. Subclass it in one module,
    register() an instance, and every core part finds it by the checkpoint's model_type."""
    name: str = ""                          # the registry key; also ModelConfig.arch
    model_types: tuple[str, ...] = ()       # config.json model_type values this module parses
    title: str = ""                         # for people: which checkpoints these are
    # The torch forward that runs it (plugins/torch_ref/forward.py FORWARDS), shared by the torch-based
    # backends; None: no torch forward exists yet.
    torch_forward: str | None = None
    config_class: type | None = None         # its ModelConfig (sub)class; None: ModelConfig itself
    synthetic_families: tuple[str, ...] = ()    # make-model --family choices this module writes
    gguf_architectures: tuple[str, ...] = ()    # llama.cpp's general.architecture values this module reads

    def parse_config(self, raw: dict, source: str, model_dir: Path | None):
        """config.json (a dict) -> a validated ModelConfig (or subclass) with arch = self.name."""
        raise NotImplementedError

    def tensors(self, cfg) -> dict[str, TensorSpec]:
        """Every canonical tensor the checkpoint must provide, in a stable order."""
        raise NotImplementedError

    def to_canonical(self, raw: dict[str, np.ndarray], where: Path) -> dict[str, np.ndarray]:
        """A checkpoint's tensors (any published layout of this architecture) -> canonical names, fused
        where the layout splits them (mlx-lm's `sanitize`). Unknown names raise CheckpointError."""
        raise NotImplementedError

    def gguf_config(self, meta, shapes: dict[str, tuple[int, ...]]):
        """A GGUF's metadata (glmcore.gguf.GGUFMetadata) and its tensors' shapes -> a validated ModelConfig."""
        raise NotImplementedError

    def gguf_to_canonical(self, cfg, parts: dict, where: Path) -> dict:
        """A GGUF's stored tensors (name -> glmcore.gguf.GGUFPart) -> canonical name -> GGUFTensor, undoing what
        llama.cpp's converter did (split or fused projections, stacked experts). Unknown names raise
        CheckpointError."""
        raise NotImplementedError

    def optional_tensors(self, cfg) -> dict[str, TensorSpec]:
        """Tensors a checkpoint may leave out (the MoE GLMs' NextN layers); checked like the others when
        present. A group sharing a prefix up to its first dot-number (mtp.0.) is all there or all absent."""
        return {}

    def complete(self, cfg, tensors: dict[str, np.ndarray], where: Path) -> None:
        """Fill what the layout leaves implicit (a tied output layer) before the shapes are checked."""

    def stored_names(self, cfg) -> StoredNames:
        """For writing: each canonical tensor's names in the layout cfg was parsed from."""
        raise NotImplementedError

    def num_params(self, cfg) -> int:
        return sum(int(np.prod(s.shape)) for n, s in self.tensors(cfg).items()
                   if not (n == "lm_head.weight" and getattr(cfg, "tie_embeddings", False)))

    def sizes(self, family: str) -> dict[str, dict]:
        """make-model's sizes for a family this module writes: size name -> config.json keys."""
        raise NotImplementedError

    def synthetic_config(self, family: str, size: str, layers: int | None, out: Path,
                         tokenizer_from) -> dict:
        """Write the tokenizer files of a synthetic checkpoint into `out` and return its config.json."""
        raise NotImplementedError

    def describe(self) -> str:
        return f"{self.name} ({self.title})" if self.title else self.name
