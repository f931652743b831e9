"""Backend `openvino_amx`: the GLM decoder as a stateful OpenVINO model on the CPU plugin.

The graph is built directly with the opset API from the canonical weights (graph.py): the KV cache lives in
the model's variables, attention/rotary/RMSNorm compile to the plugin's fused kernels, compute is bf16 where
the CPU has AMX or AVX512-BF16, and the linear layers can carry int8 (per channel) or int4 (group-wise)
compressed weights with no calibration step. The IR is written once per model + options into the cache
directory and reused; it follows OpenVINO GenAI's stateful-LLM convention, so openvino_genai.LLMPipeline runs
it too. openvino is imported only in probe()/load()/convert().
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

from glmcore import arch
from glmcore.backend import Backend, Capabilities, LoadOptions, Probe, default_capacity, hookimpl, kernels_run
from glmcore.cpuinfo import cpu_name
from glmcore.errors import BackendError

from .cpu import compressed_matmul_kernel, has_amx, has_avx512_bf16, integer_isa, native_bf16

# graph.py builds these: the dense GLM, and the MoE GLMs (experts through opset17's GroupedMatMul; glm4_moe_lite's
# latent attention over a latent cache)
ARCHITECTURES = ("glm", "glm4_moe", "glm4_moe_lite")


class OpenVINOBackend(Backend):
    name = "openvino_amx"
    option_keys = ("ir", "group_size", "kv_cache", "dynamic_quant", "prefill_chunk", "quant", "calib")
    extra = "openvino"
    description = "OpenVINO stateful model on the CPU: fused attention/rotary/RMSNorm, bf16 on AMX, int8/int4 weights"

    def probe(self) -> Probe:
        problem = _runtime_problem()
        if problem:
            return Probe(False, reason=problem, install=self.install_hint())
        import openvino as ov
        core = ov.Core()
        if "CPU" not in core.available_devices:
            return Probe(False, reason="OpenVINO has no CPU device here", install=self.install_hint())
        precision = ("bf16 (native: " + ("AMX" if has_amx() else "AVX512-BF16") + ")" if native_bf16() else
                     "f32 (this CPU has neither AMX nor AVX512-BF16: --precision bf16 is accepted but OpenVINO "
                     "runs it as f32)")
        details = {
            "openvino": ov.get_version(),
            "cpu": core.get_property("CPU", "FULL_DEVICE_NAME") or cpu_name(),
            "amx": "yes" if has_amx() else "no",
            "avx512_bf16": "yes" if has_avx512_bf16() else "no",
            "precision": precision,
            "weights": "int8 (default), int4 (group 128), f16, f32",
            "kv cache": "in the model (stateful); f32 with --precision f32, f16 with bf16",
            "options": "--opt kv_cache=f32|f16|bf16|u8, dynamic_quant=0 (off)|N (default with bf16: 32 for int8, "
                       "the group for int4; 0 with f32), group_size=128, ir=DIR, quant=gptq (int4, calibrated) "
                       "[calib=FILE]",
            "batch": "native: OpenVINO's paged-attention form of the same graph, many sequences per call",
            "moe experts": "MoE GLMs: f32 router in the graph, the (token, expert) pairs sorted by expert into "
                           "opset17 GroupedMatMul (the CPU plugin's GatherMatmul runs only the chosen experts, "
                           "weights stay i8/i4); GLM-4.7-Flash's latent attention over a latent KV state "
                           "(kv_lora_rank + rope key, plus the latent again as the value), kv_b absorbed",
            "runs on": "this machine's CPU through OpenVINO's CPU plugin",
            "int8/int4 matmuls": _kernel_line(),
        }
        if importlib.util.find_spec("openvino_genai") is not None:
            import openvino_genai
            details["openvino_genai"] = openvino_genai.get_version()
        return Probe(True, device="cpu", details=details)

    def capabilities(self) -> Capabilities:
        return Capabilities(precisions=("f32", "bf16"), weight_formats=("f32", "f16", "int8", "int4"),
                            default_precision="bf16" if native_bf16() else "f32", default_weights="int8",
                            max_context=None, can_shift=False, native_batch=True, kv_export=True,
                            # above cpu_int4 (5) only where OpenVINO has integer kernels for compressed weights
                            speed_rank=20 if integer_isa() else 3)

    def supports(self, config) -> str | None:
        refused = kernels_run(self, config, ARCHITECTURES)
        if refused is None and config.arch != "glm" and importlib.util.find_spec("openvino") is not None \
                and importlib.util.find_spec("openvino.opset17") is None:
            return (f"{self.name} runs {config.arch}'s experts with opset17's GroupedMatMul, which this openvino "
                    "lacks; upgrade it: pip install -U 'openvino>=2026.0'")
        return refused

    def architectures(self) -> list[str]:
        return [arch.get(a).describe() for a in ARCHITECTURES]

    def _require(self) -> None:
        problem = _runtime_problem()
        if problem:
            raise BackendError(f"backend {self.name!r}: {problem}; fix: {self.install_hint()}")

    def _model(self, config, weights, options: LoadOptions):
        """The stateful model, and the IR's weights file where it was read from one (memory-mapped: the
        session releases the file's pages once the plugin has packed its own copy)."""
        from . import graph, session
        xml = None
        if options.extra.get("ir"):
            from glmcore.cache import check_converted
            ir = Path(str(options.extra["ir"]))
            check_converted(ir.parent if ir.suffix == ".xml" else ir, weights, "OpenVINO IR")
            xml = session.checked_ir(ir, config, options)
        elif options.cache_dir is not None:
            xml = session.cached_ir(config, self._weights(config, weights, options, _stderr), options, _stderr)
        if xml is not None:
            import openvino as ov
            try:
                return ov.Core().read_model(xml), xml.with_suffix(".bin")
            except RuntimeError as e:
                raise BackendError(f"{xml}: OpenVINO cannot read this IR ({_last_line(e)}); "
                                   "convert the model again") from None
        opts = session.ir_options(options)       # no cache directory: built in memory, resident twice
        return graph.build_model(config, self._weights(config, weights, options, _stderr), opts["weights"],
                                 opts.get("group_size", 128)), None

    def _weights(self, config, weights, options: LoadOptions, progress):
        """The weights the graph is built from: as they are (quant=rtn, the default), or for int4 with every
        block's linear layers quantized by GPTQ onto the graph's own int4 grid (quant=gptq, glmcore/gptq.py):
        quantize_sym then gives back GPTQ's codes, so the IR's format is the same."""
        method = str(options.extra.get("quant", "rtn")).lower()
        if method == "rtn":
            if options.extra.get("calib"):
                raise BackendError("openvino_amx: calib=FILE is the calibration text of quant=gptq; add --opt quant=gptq")
            return weights
        if method == "gptq" and config.arch != "glm":
            raise BackendError(f"openvino_amx: quant=gptq calibrates the dense GLMs, not {config.arch}; use quant=rtn")
        if method != "gptq" or options.weights != "int4":
            raise BackendError(f"openvino_amx: quant={method!r} with --weights {options.weights} is not supported; "
                               "use quant=rtn, or quant=gptq with --weights int4")
        from glmcore.gptq import calibrated
        from . import graph
        from .session import ir_options
        gs = ir_options(options)["group_size"]

        def grid(name, blk):      # quantize_sym's int4 grid: q in -7..7 times an f16 scale of the group's max |w|
            if name == "lm_head.weight":
                return None
            amax = np.abs(blk).max(1)
            scale = np.where(amax > 0, amax / 7, 1.0).astype(np.float16)
            scale = np.where(scale > 0, scale, np.float16(2 ** -24)).astype(np.float32)
            return scale, np.zeros_like(scale), -7, 7
        key = f"openvino_amx int4 sym g{gs}"
        return calibrated(config, weights, grid, lambda name, k: graph.group_for(k, gs) or k, key,
                          options.extra.get("calib"), progress=progress)

    def load(self, config, weights, options: LoadOptions):
        self._require()
        from . import session
        options = self.resolve(options)
        capacity = default_capacity(config, self.capabilities(), options.capacity)
        model, weights_file = self._model(config, weights, options)
        try:
            sess = session.OpenVINOSession(config, model, options, capacity, weights_file)
        except RuntimeError as e:
            if weights_file is None:     # our own graph, built in memory: a bug, not bad input
                raise
            raise BackendError(f"{weights_file.parent}: OpenVINO cannot compile or run this IR "
                               f"({_last_line(e)}); convert the model again") from None
        if sess.runtime_precision != options.precision:
            _stderr(f"note: {options.precision} requested, but this CPU has neither AMX nor AVX512-BF16: "
                    f"OpenVINO computes in {sess.runtime_precision}")
        return sess

    def load_batch(self, config, weights, options: LoadOptions, n_slots: int):
        """Native: one compiled model in OpenVINO's paged-attention form, n_slots sequences per call (batch.py)."""
        self._require()
        from .batch import OpenVINOBatchSession
        options = self.resolve(options)
        capacity = default_capacity(config, self.capabilities(), options.capacity)
        model, weights_file = self._model(config, weights, options)
        return OpenVINOBatchSession(config, model, options, capacity, n_slots, weights_file,
                                    self._nextn_builder(config, weights, options))

    def _nextn_builder(self, config, weights, options: LoadOptions):
        """What builds the NextN layer's model at start_nextn (speculative decoding's drafter), where the
        checkpoint has one; else None."""
        if not (config.num_mtp_layers and "mtp.0.eh_proj.weight" in weights):
            return None
        from . import graph, session
        opts = session.ir_options(options)
        return lambda: graph.build_nextn_model(config, self._weights(config, weights, options, _stderr),
                                               opts["weights"], opts.get("group_size", 128))

    def conformance_weights(self, config, weights, options: LoadOptions):
        """The f32 values this configuration's graph computes with (dequantized as the graph does), and
        the tolerance row of what remains: the compute precision."""
        from . import graph, session
        options = self.resolve(options)
        opts = session.ir_options(options)
        w = graph.WeightNodes(self._weights(config, weights, options, _stderr), opts["weights"],
                              opts.get("group_size", 128))
        return {name: w.effective(name) for name in weights}, options.precision

    def bytes_per_token(self, config, options: LoadOptions, kv_len: int) -> int:
        """What one decode step reads: the weights as the graph stores them (the chosen experts only) and the KV
        states (K and V; latent attention: the latent key and the latent again as the value)."""
        from . import graph, session
        options = self.resolve(options)
        opts = session.ir_options(options)
        weights = graph.decode_weight_bytes(config, arch.of(config).tensors(config), opts["weights"],
                                            opts.get("group_size", 128))
        kv = session.compile_config(options)["KV_CACHE_PRECISION"]
        per_layer = config.latent_size + config.kv_lora_rank if config.arch == "glm4_moe_lite" else 2 * config.kv_size
        return int(weights + config.num_layers * per_layer * kv_len * (4 if kv == "f32" else 1 if kv == "u8" else 2))

    def convert(self, config, weights, options: LoadOptions, out, progress) -> None:
        self._require()
        from . import session
        options = self.resolve(options)
        session.write_ir(config, self._weights(config, weights, options, progress), session.ir_options(options),
                         out, progress)
        progress(f"run it with: glmcore run --backend {self.name} --weights {options.weights} --opt ir={out} ...; "
                 "or with openvino_genai.LLMPipeline (token ids in, token ids out)")


def _kernel_line() -> str:
    """What runs the compressed matmuls, as compiled here. Which backend is the default is measured, not read
    from this (the `default:` line of `glmcore backends`)."""
    try:
        kernel = compressed_matmul_kernel()
    except RuntimeError as e:
        return f"unknown (the probe model did not compile: {_last_line(e)})"
    isa = integer_isa()
    if isa:
        return f"{kernel} (integer dot products on {isa})"
    return (f"{kernel} (no VNNI/AMX: OpenVINO expands int8/int4 weights to f32 in every matmul, so int4 decodes "
            "no faster than int8)")


def _runtime_problem() -> str:
    """Why the installed OpenVINO cannot run this backend, or "". The graph uses the top-level opset modules
    (OpenVINO 2025.0 and newer; the MoE GLMs need opset17's GroupedMatMul); the fusions it relies on are checked by tests/test_openvino_amx.py."""
    if importlib.util.find_spec("openvino") is None:
        return "openvino is not installed"
    if importlib.util.find_spec("openvino.opset13") is None:
        import openvino as ov
        return f"openvino {ov.get_version().split('-')[0]} is too old: this backend needs 2025.0 or newer"
    return ""


def _last_line(e: Exception) -> str:
    """OpenVINO's messages end with the cause, after lines of source locations."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[-1] if lines else type(e).__name__)[:160]


def _stderr(msg: str) -> None:
    print(f"openvino_amx: {msg}", file=sys.stderr, flush=True)


@hookimpl
def glmcore_backends():
    return [OpenVINOBackend()]
