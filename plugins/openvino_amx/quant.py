"""Weight-only asymmetric quantization, round to nearest: no calibration data, no extra step.

int8: one scale and zero point per output channel. int4: one per group of `group` input columns (NNCF's
INT4_ASYM layout). The graph dequantizes as (q - zero) * scale, the pattern OpenVINO's CPU plugin runs with
its fused dequantizing matmul kernels.
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
