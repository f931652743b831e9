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

from ..errors import CheckpointError


class Split(enum.Enum):
    """How one canonical tensor ([out, in] for linear weights) is divided over tensor-parallel ranks."""
    REPLICATED = "replicated"     # every rank holds all of it (norms)
    VOCAB = "vocab"               # rows by vocabulary range (embedding, output layer)
    COLUMN = "column"             # output rows by `axis` (each of `blocks` stacked blocks split alike)
    ROW = "row"                   # input columns by `axis`; the partial products are summed across ranks
    EXPERT = "expert"             # whole experts per rank (leading dimension: experts)
    ONCE = "once"                 # the bias of a ROW product: rank 0 holds it, the others zeros (summed once)


class Axis(enum.Enum):
    """What a COLUMN/ROW split divides: the rank's query heads, its query heads and KV groups (a fused
    q|k|v tensor: q rows of my heads, then my KV groups' k rows, then their v rows), its FFN columns, or its
    columns of an MoE layer's shared expert."""
    HEADS = "heads"
    QKV = "qkv"
    FFN = "ffn"
    SHARED_FFN = "shared_ffn"


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
    head_size: int = 0            # Axis.HEADS: rows (COLUMN) or columns (ROW) per head; 0: the config's head_dim


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


# A NextN layer's own tensors beside its decoder layer (GLM-4.5's names after model.layers.N.) -> canonical
MTP_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
             "shared_head.norm.weight": "final_norm.weight", "shared_head.head.weight": "head.weight",
             "embed_tokens.weight": "embed.weight"}


def mtp_tensors(cfg, layer: Callable[[str], dict[str, TensorSpec]]) -> dict[str, TensorSpec]:
    """The NextN layers' tensors: the norms of the embedding and of the hidden state, their projection, one decoder
    layer (`layer(prefix)`: the architecture's block) and the shared head's norm. Optional, but complete and of the
    model's width when present; embed/head copies are the model's own where a checkpoint stores them."""
    h, norm = cfg.hidden_size, TensorSpec((cfg.hidden_size,), role=Role.NORM)
    t = {}
    for j in range(cfg.num_mtp_layers):
        p = f"mtp.{j}."
        t.update({p + "enorm.weight": norm, p + "hnorm.weight": norm, p + "eh_proj.weight": TensorSpec((h, 2 * h)),
                  p + "final_norm.weight": norm})
        t.update(layer(p + "layer."))
    return t


def place_mtp(cfg, tensors: dict[str, np.ndarray], where: Path) -> None:
    """Move the tensors of layers past the decoder layers (the NextN layers) from layers.N.* to mtp.J.*
    (J = N - num_layers). A layer index past num_layers + num_nextn_predict_layers belongs to another model."""
    L = cfg.num_layers
    for name in [n for n in tensors if n.startswith("layers.")]:
        i, rest = name[len("layers."):].split(".", 1)
        j = int(i) - L
        if j < 0:
            if rest in MTP_NAMES.values():      # a decoder layer never holds these
                raise CheckpointError(f"{where}: layer {i} stores NextN tensor {rest}; only the layers after the "
                                      f"{L} decoder layers are NextN layers, the checkpoint does not match config.json")
            continue
        if j >= cfg.num_mtp_layers:
            raise CheckpointError(f"{where}: the tensors of layer {i} lie past the {L} decoder layers and "
                                  f"{cfg.num_mtp_layers} NextN layer(s) of config.json; config.json belongs to "
                                  "another model size")
        t = tensors.pop(name)
        tensors[f"mtp.{j}." + (rest if rest in MTP_NAMES.values() else "layer." + rest)] = t
    for j in range(cfg.num_mtp_layers):   # copies of the model's own embedding and head are not kept twice
        for own in ("embed.weight", "head.weight"):
            tensors.pop(f"mtp.{j}.{own}", None)
