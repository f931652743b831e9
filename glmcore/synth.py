"""Synthetic checkpoints in each family's real on-disk layout, at any size from tiny to 6B.

No weights can be downloaded here, so the project makes its own: config.json with the real keys,
sharded safetensors or PyTorch .bin with the real index file and tensor names, and a real tokenizer.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import arch
from .config import ModelConfig
from .errors import GlmcoreError
from .generated import DTYPES, GENERATED, init_tensor
from .weights import BF16, write_safetensors


def make_model(family: str, size: str, out: str | Path, fmt: str = "safetensors", shards: int | None = None,
               seed: int = 0, tokenizer_from: str | Path | None = None, dtype: str | None = None,
               progress: Callable[[str], None] | None = None, layers: int | None = None,
               generated: bool = False) -> ModelConfig:
    """generated: write no weight files; the weights are made from the seed whenever the checkpoint is read
    (GeneratedWeights), for shapes whose weights do not fit on the disk."""
    if family not in arch.synthetic_families():
        raise GlmcoreError(f"unknown family {family!r}; choose {', '.join(arch.synthetic_families())}")
    sizes = arch.for_family(family).sizes(family)
    if size not in sizes:
        raise GlmcoreError(f"unknown size {size!r} for {family}; choose {', '.join(sizes)}")
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
        raise GlmcoreError(f"invalid --layers {layers}: use a positive integer")
    if fmt not in ("safetensors", "bin"):
        raise GlmcoreError(f"unknown format {fmt!r}; choose safetensors or bin")
    if shards is not None and (isinstance(shards, bool) or not isinstance(shards, int) or shards < 1):
        raise GlmcoreError(f"invalid --shards {shards}: use a positive integer")
    from .cache import build_once, new_output_dir
    # Written beside `out` and renamed into place: a user's files are never overwritten, and a failed
    # or interrupted run leaves nothing behind.
    cfg: list[ModelConfig] = []
    build_once(new_output_dir(out), lambda tmp: cfg.append(_write_model(family, size, tmp, fmt, shards, seed,
                                                                       tokenizer_from, dtype, progress, layers,
                                                                       generated)),
               complete=lambda p: False)
    return cfg[0]


def _write_model(family, size, out: Path, fmt, shards, seed, tokenizer_from, dtype, progress,
                 layers: int | None = None, generated: bool = False) -> ModelConfig:
    """The family's architecture module writes the tokenizer files and says config.json; the weights are
    its canonical tensors under the checkpoint names of that layout (or, generated, none: made when read)."""
    raw = arch.for_family(family).synthetic_config(family, size, layers, out, tokenizer_from)
    dtype = dtype or ("f32" if size in ("tiny", "small") else "bf16")
    raw["glmcore_synthetic"] = {"family": family, "size": size, "seed": seed, "note": "random weights"}
    if generated:
        raw["glmcore_synthetic"].update(weights=GENERATED, dtype=dtype,
                                        note="random weights, made from the seed when read (no weight files)")
    (out / "config.json").write_text(json.dumps(raw, indent=2, ensure_ascii=False) + "\n")
    cfg = ModelConfig.from_dir(out)
    return cfg if generated else _write_weights(cfg, out, size, fmt, shards, seed, dtype, progress)


def _write_weights(cfg: ModelConfig, out: Path, size, fmt, shards, seed, dtype, progress) -> ModelConfig:
    """The canonical tensors under their checkpoint names: names(canonical) -> {stored name: rows or None}."""
    np_dtype = DTYPES[dtype]
    module = arch.of(cfg)
    names = module.stored_names(cfg)
    specs = {**module.tensors(cfg), **module.optional_tensors(cfg)}     # a synthetic model has its NextN layers
    shapes = {n: spec.shape for n, spec in specs.items()}
    if not names("lm_head.weight"):
        del shapes["lm_head.weight"]        # tied: the checkpoint stores the embedding once
    total = sum(int(np.prod(s)) for s in shapes.values()) * np_dtype.itemsize
    if shards is None:
        shards = 2 if size == "tiny" else max(1, -(-total // (2 << 30)))
    if shards > len(shapes):
        raise GlmcoreError(f"invalid --shards {shards}: this model has only {len(shapes)} tensors")
    groups = _split(list(shapes), shapes, shards, np_dtype.itemsize)
    ext = "safetensors" if fmt == "safetensors" else "bin"
    stem = "model" if fmt == "safetensors" else "pytorch_model"
    weight_map = {}
    for k, group in enumerate(groups, 1):
        fname = f"{stem}.{ext}" if shards == 1 else f"{stem}-{k:05d}-of-{shards:05d}.{ext}"
        tensors = {}
        for n in group:
            parts = names(n)
            if not parts:
                continue
            t = init_tensor(n, specs[n], cfg, seed).astype(np_dtype)
            tensors.update({stored: t if rows is None else t[rows] for stored, rows in parts.items()})
        _write(out / fname, tensors, fmt)
        weight_map.update({t: fname for t in tensors})
        if progress:
            progress(f"wrote {fname} ({k}/{shards})")
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / f"{stem}.{ext}.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return cfg


def cached_model(family: str, size: str, seed: int = 0, purpose: str = "models",
                 tokenizer_from: str | Path | None = None) -> Path:
    """A synthetic checkpoint in the cache directory, made on first use (with tokenizer_from: that
    checkpoint's tokenizer, as make_model's; the entry is named after its directory)."""
    from .cache import build_once, cache_root
    tok = f"-{Path(tokenizer_from).resolve().name}" if tokenizer_from is not None else ""
    return build_once(cache_root() / purpose / f"{family}-{size}-seed{seed}{tok}",
                      lambda tmp: _write_model(family, size, tmp, "safetensors", None, seed, tokenizer_from, None,
                                               None),
                      complete=lambda p: (p / "config.json").is_file(),
                      source=None if tokenizer_from is None else str(tokenizer_from))


def _split(names, shapes, n, itemsize):
    sizes = [int(np.prod(shapes[k])) * itemsize for k in names]
    target = sum(sizes) / n
    groups, cur, acc = [], [], 0
    for name, s in zip(names, sizes):
        if cur and acc + s / 2 > target * (len(groups) + 1) and len(groups) < n - 1:
            groups.append(cur)
            cur = []
        cur.append(name)
        acc += s
    groups.append(cur)
    while len(groups) < n:      # more shards than tensors: never happens for real sizes
        groups.append([])
    return groups


def _write(path: Path, tensors: dict[str, np.ndarray], fmt: str) -> None:
    if fmt == "safetensors":
        write_safetensors(path, tensors, {"format": "pt"})
        return
    try:
        import torch
    except ImportError:
        raise GlmcoreError('writing .bin checkpoints needs torch: pip install torch==2.13.0 (CPU build), '
                           'or use --format safetensors') from None
    state = {}
    for k, v in tensors.items():
        t = torch.from_numpy(np.ascontiguousarray(v.view(np.uint16) if v.dtype == BF16 else v))
        state[k] = t.view(torch.bfloat16) if v.dtype == BF16 else t
    torch.save(state, path)
