"""Backend `ascend_npu`: GLM as one PyTorch graph with fused attention/RMSNorm, for Ascend NPUs.

On an Ascend NPU (torch_npu present and a device visible) the step is compiled by torchair's NPU
backend with frozen parameters, and attention/RMSNorm/KV updates run as torch_npu fused kernels. On
any other machine the same model and the same graph discipline run on CUDA or the CPU: torch.compile
with inductor, SDPA and the fused RMSNorm. `--opt mode=eager` runs it uncompiled. torch and torch_npu
are imported only in probe()/capabilities()/load().
"""
from __future__ import annotations

import importlib.util
import os
import shutil

from glmcore.backend import Backend, Capabilities, LoadOptions, Probe, hookimpl
from glmcore.errors import BackendError

_DEVICE = {}     # cached detection: {"device": str, "notes": dict}
DTYPE_NAMES = ("f32", "bf16", "f16")


def detect_device(requested: str | None = None) -> tuple[str, dict]:
    """The device this backend uses: npu:0 when torch_npu sees one, else cuda:0, else cpu.
    `requested` (LoadOptions.extra["device"]) overrides the choice."""
    import torch
    notes = {}
    if importlib.util.find_spec("torch_npu") is not None:
        try:
            import torch_npu  # noqa: F401  (registers the "npu" device with torch)
            notes["torch_npu"] = getattr(torch_npu, "__version__", "unknown")
            npu_ok = torch.npu.is_available()
        except Exception as e:      # a broken CANN install must not break the host path
            notes["torch_npu"] = f"failed to import: {type(e).__name__}: {e}"
            npu_ok = False
    else:
        notes["torch_npu"] = "not installed"
        npu_ok = False
    if requested:
        kind = requested.split(":")[0]
        ok = {"cpu": True, "cuda": torch.cuda.is_available(), "npu": npu_ok}.get(kind)
        if not ok:
            raise BackendError(f"ascend_npu: device {requested!r} is not available here; "
                               "pass --opt device=cpu, or leave it out to pick npu:0, cuda:0 or cpu")
        return (requested if ":" in requested or kind == "cpu" else f"{kind}:0"), notes
    if npu_ok:
        return "npu:0", notes
    if torch.cuda.is_available():
        return "cuda:0", notes
    return "cpu", notes


def _default_device() -> str:
    if "device" not in _DEVICE:
        _DEVICE["device"], _DEVICE["notes"] = detect_device()
    return _DEVICE["device"]


def device_precisions(device: str) -> tuple[str, ...]:
    import torch
    kind = device.split(":")[0]
    if kind == "npu":
        # Atlas A2/A3 run bf16; the Atlas inference cards (310P) only fp16.
        bf16 = getattr(torch.npu, "is_bf16_supported", lambda: True)()
        return ("f32", "bf16", "f16") if bf16 else ("f32", "f16")
    if kind == "cuda":
        return ("f32", "bf16", "f16") if torch.cuda.is_bf16_supported() else ("f32", "f16")
    # CPU: bf16 always works (fp32 accumulation); fp16 only with native fp16 GEMM (AVX512-FP16/AMX),
    # since without it torch's fp16 matmul is a slow fallback (6x slower than bf16 on AVX2).
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        return ("f32", "bf16", "f16")
    return ("f32", "bf16")


class AscendNpuBackend(Backend):
    name = "ascend_npu"
    extra = "ascend"
    description = "torch graph mode (torchair on Ascend NPU; inductor on CUDA/CPU), fused attention + RMSNorm, static KV cache"

    def probe(self) -> Probe:
        if importlib.util.find_spec("torch") is None:
            return Probe(False, reason="torch is not installed", install=self.install_hint())
        import torch
        device = _default_device()
        notes = _DEVICE["notes"]
        kind = device.split(":")[0]
        details = {"torch": torch.__version__, "torch_npu": notes["torch_npu"], "device": device,
                   "mode": "graph (default; --opt mode=eager)"}
        if kind == "npu":
            details["torchair"] = ("installed" if importlib.util.find_spec("torchair") else
                                   "not installed: graph mode needs it (pip install torchair) or use mode=eager")
            details["compiler"] = "torchair npu backend, frozen parameters"
            details["kernels"] = "torch_npu npu_rms_norm, npu_prompt/incre_flash_attention, scatter_update_"
            details["runs on"] = "Ascend NPU"
        else:
            details["compiler"] = "inductor"
            details["kernels"] = "F.rms_norm, scaled_dot_product_attention, index_copy_ (no NPU: host path)"
            details["runs on"] = "CUDA GPU" if kind == "cuda" else "this machine's CPU (no Ascend NPU found)"
            if kind == "cpu" and not shutil.which(os.environ.get("CXX", "g++")):
                details["compiler"] = "inductor needs a C++ compiler (g++) for graph mode; mode=eager works without"
        return Probe(True, device=device, details=details)

    def capabilities(self) -> Capabilities:
        if importlib.util.find_spec("torch") is None:
            return Capabilities(precisions=("f32", "bf16"), weight_formats=("f32", "bf16"), speed_rank=-1)
        device = _default_device()
        precisions = device_precisions(device)
        kind = device.split(":")[0]
        default = "f32" if kind == "cpu" else ("bf16" if "bf16" in precisions else "f16")
        rank = {"npu": 100, "cuda": 50}.get(kind, -1)   # on the CPU it is a compile-heavy host path: not a default
        return Capabilities(precisions=precisions, weight_formats=precisions, default_precision=default,
                            default_weights=default, can_shift=False, speed_rank=rank)

    def resolve(self, options: LoadOptions) -> LoadOptions:
        # Weights are held in the compute precision: --weights defaults to --precision and must match it.
        caps = self.capabilities()
        precision = options.precision or caps.default_precision
        if precision in DTYPE_NAMES and precision not in caps.precisions:
            device = _DEVICE.get("device", "this device")
            why = " (this CPU has no native fp16 matmul, which torch needs for usable speed)" \
                if precision == "f16" and device == "cpu" else ""
            raise BackendError(f"backend {self.name!r} has no precision {precision!r} on {device}{why}; "
                               f"choose one of {', '.join(caps.precisions)}")
        if options.weights not in (None, precision):
            raise BackendError(f"backend {self.name!r} keeps weights in the compute precision; pass "
                               f"--weights {precision} or leave --weights out")
        return super().resolve(LoadOptions(precision, precision, options.capacity, options.threads,
                                           options.cache_dir, dict(options.extra)))

    def conformance_variants(self) -> list[dict]:
        # Graph mode (the default) in every precision, and eager mode too: both must match the reference.
        return [{"mode": "graph"}, {"mode": "eager", "precision": "f32", "weights": "f32"},
                {"mode": "eager", "precision": "bf16", "weights": "bf16"}]

    def load(self, config, weights, options: LoadOptions):
        import torch
        from .session import AscendSession
        options = self.resolve(options)
        requested = options.extra.get("device")
        device = detect_device(requested)[0] if requested else _default_device()
        if options.precision not in device_precisions(device):
            raise BackendError(f"backend {self.name!r} has no precision {options.precision!r} on {device}; "
                               f"choose one of {', '.join(device_precisions(device))}")
        if device.startswith("npu"):
            torch.npu.set_device(device)
        return AscendSession(config, weights, options, self.capabilities(), torch.device(device))


@hookimpl
def glmcore_backends():
    return [AscendNpuBackend()]
