"""The rotary tables, computed in one place for every runtime (torch, the C kernels, OpenVINO graphs,
exported static graphs): each takes these arrays instead of computing its own."""
from __future__ import annotations

import numpy as np


def inv_freq(cfg) -> np.ndarray:
    """[rotary_dim/2] float32: base ** -(2i / rotary_dim), in float32 as transformers computes it."""
    dim = cfg.rotary_dim
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    return (np.float32(1.0) / (np.float32(cfg.rope_base) ** exponent)).astype(np.float32)


def rotary_tables(cfg, positions) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [len(positions), rotary_dim/2] float32 for integer positions. The angles are float32
    products (as the reference models form them); cos/sin are taken in float64 and rounded once, so
    every runtime gathers the same correctly rounded table (ChatGLM2's fp16 angles drift: never)."""
    angles = np.asarray(positions, dtype=np.float32)[:, None] * inv_freq(cfg)[None, :]
    return (np.cos(angles.astype(np.float64)).astype(np.float32),
            np.sin(angles.astype(np.float64)).astype(np.float32))
