"""Emulated lossy formats on top of the torch reference, to calibrate and test the tolerance table.

`EmulatedBackend("int4")` is the torch reference computing in fp32 with its weights rounded the way a
backend with that weight format stores them: bf16/f16 rounding of every tensor; int8 per-output-channel
absmax of the linear layers; int4 group-wise (32) absmax of the linear layers and the embedding with
the output layer at int8, as both built-in int4 backends (cpu_int4, openvino_amx) do by default.
It shows what the *weight* format alone costs; rounding of activations and of the KV cache in a
real bf16/f16 backend adds to it, which the bounds in tolerances.py leave room for.

    python -m glmcore_conformance.emulate      # measured figures of each emulated format, all families

The tests use these as positive controls (an honest lossy backend must pass its own row) and as
negative ones (an int4 backend must not pass as bf16).
"""
from __future__ import annotations

import sys

import numpy as np

from glmcore.backend import Backend, Capabilities, LoadOptions, Probe

FORMATS = ("f32", "f16", "bf16", "int8", "int4")
INT4_GROUP = 32


def round_weight(w: np.ndarray, fmt: str) -> np.ndarray:
    """float32 [out, in] -> float32 holding the values format `fmt` can represent."""
    w = np.asarray(w, dtype=np.float32)
    if fmt == "f32":
        return w
    if fmt == "f16":
        return w.astype(np.float16).astype(np.float32)
    if fmt == "bf16":
        import ml_dtypes
        return w.astype(ml_dtypes.bfloat16).astype(np.float32)
    if fmt == "int8":     # symmetric, one scale per output row
        scale = np.abs(w).max(1, keepdims=True) / 127.0
        return np.round(w / np.where(scale == 0, 1, scale)).clip(-127, 127) * scale
    if fmt == "int4":     # symmetric, one scale per group of 32 inputs
        out, inp = w.shape
        group = INT4_GROUP if inp % INT4_GROUP == 0 else inp
        g = w.reshape(out, inp // group, group)
        scale = np.abs(g).max(2, keepdims=True) / 7.0
        q = np.round(g / np.where(scale == 0, 1, scale)).clip(-8, 7)
        return (q * scale).reshape(out, inp).astype(np.float32)
    raise ValueError(f"unknown format {fmt!r}")


class EmulatedBackend(Backend):
    """The torch reference with its linear weights rounded to `fmt` (and, for f16/bf16, its other
    tensors too). `declare` is the precision/weight format it claims, default `fmt` itself."""

    description = "torch reference with emulated weight rounding (calibration)"

    def __init__(self, fmt: str, declare: str | None = None, name: str | None = None):
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}")
        self.fmt = fmt
        self.declare = declare or fmt
        self.name = name or f"emulated_{fmt}"

    def probe(self) -> Probe:
        import importlib.util
        if importlib.util.find_spec("torch") is None:
            return Probe(False, reason="torch is not installed", install='pip install "glmcore[torch]"')
        return Probe(True, details={"emulates": self.fmt})

    def capabilities(self) -> Capabilities:
        d = self.declare
        precision = d if d in ("f32", "f16", "bf16") else "f32"
        return Capabilities(precisions=(precision,), weight_formats=(d,), default_precision=precision,
                            default_weights=d)

    def load(self, config, weights, options: LoadOptions):
        from glmcore_plugins.torch_ref.model import TorchRefSession
        return TorchRefSession(config, {**weights, **self.rounded(weights)}, options, self.capabilities())

    def conformance_weights(self, config, weights, options: LoadOptions):
        """The suite's optional hook: the weights this backend computes with, and its compute row."""
        return self.rounded(weights), "f32"

    def rounded(self, weights) -> dict[str, np.ndarray]:
        out = {}
        for name in weights:
            t = weights.f32(name) if hasattr(weights, "f32") else np.asarray(weights[name], np.float32)
            fmt = self.fmt
            if fmt in ("int8", "int4") and t.ndim == 1:
                continue                     # norms and biases stay in float
            if fmt == "int8" and name == "embed.weight":
                continue                     # int8 formats keep the embedding (it is not read per token)
            if fmt == "int4" and name == "lm_head.weight":
                fmt = "int8"                 # int4 formats keep the output layer at int8
            out[name] = round_weight(t.reshape(t.shape[0], -1), fmt).reshape(t.shape)
        return out


def main(argv: list[str] | None = None) -> int:
    from .suite import run_suite
    from .report import print_table
    backends = [EmulatedBackend(f) for f in FORMATS[1:]]
    report = run_suite(backends, progress=lambda m: print(m, file=sys.stderr))
    print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
