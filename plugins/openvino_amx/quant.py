"""Weight-only quantization, round to nearest: no calibration data, no extra step.

Symmetric (the matmuls): signed q, one f16 scale per output channel (int8) or per group of `group` input
columns (int4), NNCF's INT8_SYM/INT4_SYM layout; dequantized as q * scale. OpenVINO's CPU plugin runs it with
its fused dequantizing matmul kernels, with less work per weight than the asymmetric form (no zero point;
issue 15: 8% less CPU per decode step at int8, 18% at int4 without dynamic quantization). Asymmetric (the
embedding table, a row lookup): unsigned q, scale and zero point per row, dequantized as (q - zero) * scale.
"""
from __future__ import annotations

import numpy as np


def quantize_asym(w: np.ndarray, bits: int, group: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [out, in] f32 -> (q, scale, zero): q uint8 [out, in] (group None) or [out, in/group, group];
    scale f32 and zero uint8 [out, 1] or [out, in/group, 1]. Dequantized: (q - zero) * scale."""
    levels = (1 << bits) - 1
    x = w if group is None else w.reshape(w.shape[0], w.shape[1] // group, group)
    lo = np.minimum(x.min(axis=-1, keepdims=True), 0.0)     # the range holds 0, so zero is exact
    hi = np.maximum(x.max(axis=-1, keepdims=True), 0.0)
    scale = (hi - lo) / levels
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    zero = np.clip(np.round(-lo / scale), 0, levels)
    q = np.clip(np.round(x / scale) + zero, 0, levels).astype(np.uint8)
    return q, scale, zero.astype(np.uint8)


def dequantize(q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    x = (q.astype(np.float32) - zero.astype(np.float32)) * scale
    return x.reshape(x.shape[0], -1)


def quantize_sym(w: np.ndarray, bits: int, group: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] f32 -> (q, scale): q int8 in -(2^(bits-1)-1)..2^(bits-1)-1, [out, in] (group None) or
    [out, in/group, group]; scale f16 [out, 1] or [out, in/group, 1]. Dequantized: q * scale."""
    top = (1 << (bits - 1)) - 1
    x = w if group is None else w.reshape(w.shape[0], w.shape[1] // group, group)
    amax = np.abs(x).max(axis=-1, keepdims=True)
    scale = np.where(amax > 0, amax / top, 1.0).astype(np.float16)
    scale = np.where(scale > 0, scale, np.float16(2 ** -24))      # a tiny row must not round to a zero scale
    q = np.clip(np.round(x / scale.astype(np.float32)), -top, top).astype(np.int8)
    return q, scale


def dequantize_sym(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    x = q.astype(np.float32) * scale.astype(np.float32)
    return x.reshape(x.shape[0], -1)
