"""Backend `ascend_npu`: GLM as one PyTorch graph with fused attention/RMSNorm, for Ascend NPUs.

On an Ascend NPU (torch_npu present and a device visible) the step is compiled by torchair's NPU
backend with frozen parameters; on Atlas A2/A3 attention/RMSNorm/KV updates run as torch_npu fused
kernels, on other Ascend chips as SDPA and index_put_ (ops.soc_support says why). On any other machine
the same model and the same graph discipline run on CUDA or the CPU: torch.compile with inductor, SDPA
and the fused RMSNorm. `--opt mode=eager` runs it uncompiled. `load_batch` gives a native batch
session (decode of many sequences in one graph call). torch and torch_npu are imported only in
probe()/capabilities()/load().
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
            if npu_ok:
                notes["soc"] = torch.npu.get_device_name(0)
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


def _soc() -> str:
    """The NPU's SoC name (torch.npu.get_device_name), or "" off the NPU."""
    _default_device()
    return _DEVICE["notes"].get("soc", "")


def torchair_status() -> tuple[bool, str]:
    """Whether torchair (shipped inside torch_npu, importable as `torchair` once torch_npu is imported)
    works. torch_npu puts a lazy stand-in in sys.modules["torchair"] (torch_npu.dynamo._LazyTorchair)
    that imports the real one on first attribute access and re-raises a failed import there, and
    find_spec on a module without __spec__ raises: so touch what graph mode uses, inside the try."""
    try:
        import torchair
        torchair.get_npu_backend  # noqa: B018  (the lazy import happens here)
    except Exception as e:
        return False, (f"torchair is not importable ({type(e).__name__}: {e}); it ships with torch_npu "
                       "(torch_npu.dynamo.torchair): install the torch_npu build matching your CANN and torch")
    return True, f"torchair {getattr(torchair, '__version__', '')}".strip()


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
    option_keys = ("device", "mode", "buckets", "batch_buckets", "block_size")
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
        details["batch graphs"] = ("all decode tokens of a step in one call over a static [slots, kv_heads, "
                                   "positions, head_dim] cache, one graph per batch-size bucket (--opt batch_buckets=)")
        details["verified"] = ("the CPU/inductor path runs in the tests against the torch reference; the NPU path "
                               "(torchair, torch_npu kernels per SoC) only against stand-ins: the kernels registered "
                               "with op-plugin's schemas and Meta kernels (a prefill at a new start compiles no new "
                               "graph; the MoE chain of each op-plugin release against the reference), a torchair config that refuses unknown options; never on an Ascend NPU")
        from .ops import CHECKED_SCHEMAS
        details["torch_npu schemas"] = (f"attention calls chosen from the kernels' registered schemas (every argument "
                                        f"passed is declared; lengths only where SymInt[]); checked against "
                                        f"{CHECKED_SCHEMAS}")
        from .ops import moe_summary
        details["moe experts"] = moe_summary()
        if kind == "npu":
            from .ops import soc_support
            fused, why = soc_support(_soc())
            if fused:
                import torch_npu
                details["moe experts"] = moe_summary(torch_npu)
            details["soc"] = why
            ok, tair = torchair_status()
            details["torchair"] = tair
            details["compiler"] = "torchair npu backend, frozen parameters"
            details["kernels"] = ("torch_npu npu_rms_norm, npu_fused_infer_attention_score / npu_incre_flash_attention "
                                  "with actual_seq_lengths (where the schema types them SymInt[]), scatter_update_"
                                  if fused else "F.rms_norm, scaled_dot_product_attention, index_put_")
            details["runs on"] = f"Ascend NPU ({_soc() or 'SoC unknown'})"
            if not ok:
                return Probe(False, device=device, reason=f"{tair}; graph mode (the default) needs it",
                             install="the torch_npu wheel for your CANN version (torchair is part of it)",
                             details=details)
        else:
            details["compiler"] = "inductor"
            details["kernels"] = "F.rms_norm, scaled_dot_product_attention, index_put_ (no NPU: host path)"
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
        if kind == "npu":
            from .ops import soc_support
            rank = 100 if soc_support(_soc())[0] else 60   # no fused kernels on this chip: still the NPU, plainer
        return Capabilities(precisions=precisions, weight_formats=precisions, default_precision=default,
                            default_weights=default, can_shift=False, speed_rank=rank, native_batch=True)

    def supports(self, config) -> str | None:
        from glmcore_plugins.torch_ref import torch_forward_runs
        return torch_forward_runs(self, config)

    def architectures(self) -> list[str]:
        from glmcore_plugins.torch_ref import torch_forward_architectures
        return torch_forward_architectures()

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

    def _device(self, options: LoadOptions):
        import torch
        requested = options.extra.get("device")
        device = detect_device(requested)[0] if requested else _default_device()
        if options.precision not in device_precisions(device):
            raise BackendError(f"backend {self.name!r} has no precision {options.precision!r} on {device}; "
                               f"choose one of {', '.join(device_precisions(device))}")
        if device.startswith("npu"):
            torch.npu.set_device(device)
        return torch.device(device)

    def load(self, config, weights, options: LoadOptions):
        from .session import AscendSession
        options = self.resolve(options)
        device = self._device(options)
        return AscendSession(config, weights, options, self.capabilities(), device, _soc())

    def load_batch(self, config, weights, options: LoadOptions, n_slots: int):
        from .session import AscendBatchSession
        options = self.resolve(options)
        device = self._device(options)
        return AscendBatchSession(config, weights, options, self.capabilities(), device, n_slots, _soc())

    def load_shard(self, shard, options: LoadOptions, n_slots: int):
        """This rank's part of the model under tensor parallelism (glmcore/parallel.py), on its own device."""
        from .session import AscendBatchSession
        options = self.resolve(LoadOptions(options.precision, options.weights, options.capacity, options.threads,
                                           options.cache_dir, dict(options.extra, device=shard.device)))
        device = self._device(options)
        return AscendBatchSession(shard.config, shard.weights, options, self.capabilities(), device, n_slots, _soc(),
                                  tp=shard)


@hookimpl
def glmcore_backends():
    return [AscendNpuBackend()]
