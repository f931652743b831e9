"""How far a backend's logits are from the reference's: five figures per compared array.

Every figure is taken per position (one row of logits) and the worst position is reported, except
top-1 agreement, which is the fraction of positions whose argmax agrees. A bug that hits one position
(the last slot of the cache, the first token after a window shift) then cannot hide in an average.
"""
from __future__ import annotations

import numpy as np

# name -> (direction, label): "max" metrics must stay at or below the bound, "min" ones at or above.
METRICS = {
    "max_abs": ("max", "max|d|"),
    "rel_l2": ("max", "rel L2"),
    "cosine": ("min", "cosine"),
    "top1": ("min", "top-1"),
    "kl": ("max", "KL"),
}


class ShapeMismatch(Exception):
    pass


def compare(ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
    """ref, got: [vocab] or [positions, vocab] logits. Non-finite values in `got` give nan/inf figures,
    which fail every bound."""
    ref = np.asarray(ref, dtype=np.float64)
    got = np.asarray(got, dtype=np.float64)
    if ref.shape != got.shape:
        raise ShapeMismatch(f"logits shape {got.shape}, the reference has {ref.shape}")
    ref = ref.reshape(-1, ref.shape[-1])
    got = got.reshape(-1, got.shape[-1])
    with np.errstate(all="ignore"):
        diff = got - ref
        norm_ref = np.linalg.norm(ref, axis=1)
        norm_got = np.linalg.norm(got, axis=1)
        rel_l2 = np.linalg.norm(diff, axis=1) / norm_ref
        cosine = (ref * got).sum(1) / (norm_ref * norm_got)
        top1 = np.argmax(ref, 1) == np.argmax(got, 1)
        lp = _log_softmax(ref)
        lq = _log_softmax(got)
        kl = (np.exp(lp) * (lp - lq)).sum(1)
    finite = bool(np.isfinite(got).all())
    return {
        "max_abs": float(np.abs(diff).max()) if finite else float("inf"),
        "rel_l2": float(rel_l2.max()) if finite else float("inf"),
        "cosine": float(cosine.min()) if finite else float("nan"),
        "top1": float(top1.mean()) if finite else 0.0,
        "kl": float(max(kl.max(), 0.0)) if finite else float("inf"),
    }


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(1, keepdims=True)
    return x - np.log(np.exp(x).sum(1, keepdims=True))


def out_of_bounds(metrics: dict[str, float], bounds: dict[str, float]) -> list[str]:
    """Names of the metrics outside their bound. nan is always outside (comparisons with nan are False)."""
    bad = []
    for name, bound in bounds.items():
        value = metrics[name]
        ok = value <= bound if METRICS[name][0] == "max" else value >= bound
        if not ok:
            bad.append(name)
    return bad
