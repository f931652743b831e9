"""Backend `cpu_int4`: group-wise INT4 weights, our own C kernels, and a StreamingLLM KV window.

Weights are quantized from the canonical checkpoint at load (Q4_0-style symmetric or Q4_1-style
asymmetric, groups of 32/64/128, f16 or bf16 scales), repacked into the kernels' tile layout and
cached on disk, then memory-mapped, so the resident set is about the packed size. A decode or
prefill step is one call into a small C library (plain C reference, AVX2, AVX-VNNI, AVX-512 VNNI, the
fastest of them timed on this CPU) that runs every layer with its own thread pool. The KV cache is a fixed ring buffer;
`shift(n_keep, n_discard)` keeps the attention sinks, drops the next n_discard tokens and re-rotates
the cached keys in place. `load_batch` holds many sequences (a ring each) and runs one step for all of
them: each weight matrix is multiplied once with every token of the step (the prefill GEMM path).

The MoE GLMs run in the same kernels: glm4_moe (GLM-4.5/4.6/4.7) with INT4 routed and shared experts, the
router in fp32 as transformers' route(), and per step the tokens grouped by expert so each chosen expert is
read once (all experts of a projection in one parallel region); glm4_moe_lite (GLM-4.7-Flash) with latent
attention, kv_b absorbed into the query and the output (packed as its two per-head halves), and a latent KV
cache of kv_lora_rank + qk_rope_head_dim values per token and layer, shifted in place on its rope part.
A checkpoint's NextN (MTP) layer is packed beside the model (eh_proj and its decoder layer int4, norms f32) and
run by the speculative drafter (--speculative mtp): its KV cache is one more layer of each slot's ring (slid and
copied with it), fed with the target's final normed hidden states, which a step hands back only then.

Options (LoadOptions.extra, `--opt key=value`): group_size 32|64|128 (32), sym true|false (true),
scale_dtype f16|bf16 (f16), embed_bits 4|8 (4), head_bits 4|8 (8), linear_bits 4|8 (4), kv_dtype f16|f32 (f16),
isa auto|plain|avx2|avxvnni|avx512vnni (auto: the fastest on this CPU, timed once and cached, native.tier_choice;
GLMCORE_INT4_ISA pins it too), packed DIR (a `glmcore convert` output to load),
quant rtn|gptq (rtn: round to nearest; gptq: calibrated, glmcore/gptq.py, the same packed format), calib
FILE (gptq's calibration text; default glmcore/data/calibration.txt).
A GGUF's Q4_0 or Q8_0 blocks are packed as they are (gguf_import.py): no option given, its layers keep their bits;
a K-quant file's Q4_K blocks keep their codes (asymmetric int4), its matrices stored in more bits become int8 rows.
Only numpy and a C compiler (or the library built at install) are needed: no torch.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from glmcore.backend import Backend, Capabilities, LoadOptions, Probe, hookimpl, kernels_run
from glmcore import arch
from glmcore.errors import BackendError

# the dense GLMs; glm4_moe (experts in the kernels, fp32 router); glm4_moe_lite (latent attention, latent cache)
ARCHITECTURES = ("glm", "glm4_moe", "glm4_moe_lite")
QUANT_OPTIONS = ("group_size", "sym", "scale_dtype", "embed_bits", "head_bits", "linear_bits")
OPTIONS = QUANT_OPTIONS + ("kv_dtype", "isa", "packed", "quant", "calib")


def default_threads() -> int:
    """Physical cores this process may run on (decode is memory-bound: SMT siblings do not help)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
    cores = set()
    for c in cpus:
        try:
            base = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
            cores.add(((base / "physical_package_id").read_text().strip(), (base / "core_id").read_text().strip()))
        except OSError:
            cores.add(("", str(c)))
    return max(1, len(cores))


class CpuInt4Backend(Backend):
    name = "cpu_int4"
    option_keys = OPTIONS
    extra = "int4"
    description = "INT4 group-quantized weights, own AVX2/AVX-512 C kernels, StreamingLLM window (CPU)"

    def probe(self) -> Probe:
        from . import native
        try:
            path, how = native.library_path(build=False)
        except BackendError as e:
            return Probe(False, reason=str(e), install=self.install_hint())
        details = {"threads": default_threads(), "runs on": "this machine's CPU"}
        if path is None:
            cc = native.compiler()
            if cc is None:
                return Probe(False, reason="no prebuilt kernel library and no C compiler (cc, gcc or clang) to "
                             "build one; install a C compiler", install=self.install_hint())
            details.update(kernels=f"compiled with {cc} on first load", isa=native.expected_isa(),
                           **{"isa choice": "by the CPU flags until then; auto then times the tiers"})
            return Probe(True, device="cpu", details=details)
        try:
            lib = native.lib()
        except BackendError as e:
            return Probe(False, reason=str(e), install=self.install_hint())
        try:
            isa, why = native.choose_isa()
        except BackendError as e:           # GLMCORE_INT4_ISA names a tier this CPU lacks
            return Probe(False, reason=str(e), install="unset GLMCORE_INT4_ISA or set it to auto")
        widest = native.ISAS[lib.glmi4_best_isa()]
        details.update(kernels=f"{how}: {path}", **native.describe_tier(isa, why),
                       **({"isa note": f"the CPU flags suggest {native.expected_isa()}, the library runs up to {widest}"}
                          if widest != native.expected_isa() else {}))
        return Probe(True, device="cpu", details=details)

    def remeasure(self) -> None:
        from . import native
        from glmcore.autoselect import measurement_off
        if not measurement_off():
            native.tier_choice(rerun=True)

    def capabilities(self) -> Capabilities:
        # int8 activations x int4 weights, accumulated and kept in fp32 between the matrix products
        return Capabilities(precisions=("f32",), weight_formats=("int4",), default_precision="f32",
                            default_weights="int4", max_context=None, can_shift=True, speed_rank=5,
                            native_batch=True, max_slots=None, kv_export=True)

    def supports(self, config) -> str | None:
        return kernels_run(self, config, ARCHITECTURES)

    def architectures(self) -> list[str]:
        return [arch.get(a).describe() for a in ARCHITECTURES]

    def _settings(self, options: LoadOptions):
        from . import native
        from .quant import QuantOptions
        self.check_options(options.extra)
        q = QuantOptions.from_extra(options.extra)
        kv = str(options.extra.get("kv_dtype", "f16"))
        if kv not in ("f16", "f32"):
            raise BackendError(f"cpu_int4: kv_dtype {kv!r} is not supported; use f16 or f32")
        isa, _ = native.choose_isa(str(options.extra.get("isa", "auto")))
        threads = options.threads or default_threads()
        return q, kv, isa, threads

    def load(self, config, weights, options: LoadOptions):
        from .session import Int4Session
        return Int4Session(self.load_batch(config, weights, options, 1))

    def load_batch(self, config, weights, options: LoadOptions, n_slots: int):
        """n_slots sequences over one mapping of the packed weights; a step multiplies each weight matrix
        once with the tokens of all its entries. KV memory: n_slots x capacity positions."""
        from .session import Int4BatchSession
        _, kv, isa, threads = self._settings(options)
        packed = self._packed_dir(config, weights, options)
        return Int4BatchSession(config, packed, options, self.capabilities(), isa, threads, kv, n_slots)

    # ---------------------------------------------------------------- optional conformance/bench hooks

    def conformance_variants(self) -> list[dict]:
        """Every group size, symmetric and asymmetric (bf16 scales in one), and the plain C path."""
        return [{}, {"group_size": 64}, {"group_size": 128}, {"sym": False}, {"sym": False, "group_size": 64},
                {"sym": False, "group_size": 128, "scale_dtype": "bf16"},
                {"isa": "plain", "kv_dtype": "f32", "head_bits": 4, "embed_bits": 8}]

    def conformance_weights(self, config, weights, options: LoadOptions):
        """The float32 weights this configuration computes with (read back from the packed file), and
        the tolerance row of what remains: int8 activations."""
        from .quant import dequantized_weights, read_packed
        meta, blob = read_packed(self._packed_dir(config, weights, options), config)
        return dequantized_weights(meta, np.asarray(blob)), "int8"

    def bytes_per_token(self, config, options: LoadOptions, kv_len: int) -> int:
        """What one decode step reads: every layer's packed matrices, the output layer, the KV cache."""
        from .quant import QuantOptions, packed_layout, packed_stats
        q = QuantOptions.from_extra({k: v for k, v in options.extra.items() if k in QUANT_OPTIONS})
        weights = packed_stats(config, packed_layout(config, q), 0)["bytes_per_token"]
        kv_elt = 4 if options.extra.get("kv_dtype") == "f32" else 2
        per_layer = getattr(config, "latent_size", 0) or 2 * config.kv_size     # a latent row, or K and V
        return int(weights + config.num_layers * per_layer * kv_elt * kv_len)

    def _packed_dir(self, config, weights, options: LoadOptions) -> Path:
        from glmcore.cache import cache_root, check_converted
        if options.extra.get("packed"):
            return check_converted(Path(str(options.extra["packed"])), weights, "cpu_int4 packed model")
        from .quant import QuantOptions, ensure_packed
        q, weights, codes = _gguf_packing(weights, options.extra, QuantOptions.from_extra(options.extra))
        cache = Path(options.cache_dir) if options.cache_dir else cache_root() / "converted"
        return ensure_packed(config, _calibrated(config, weights, q, options.extra, _stderr), q, cache,
                             progress=_stderr, codes=codes)

    def convert(self, config, weights, options: LoadOptions, out: Path, progress) -> None:
        from .quant import QuantOptions, write_packed
        extra = {k: v for k, v in options.extra.items() if v is not None}
        self.check_options(extra)
        q, weights, codes = _gguf_packing(weights, extra, QuantOptions.from_extra(extra))
        weights = _calibrated(config, weights, q, extra, progress)
        fp = weights.fingerprint() if hasattr(weights, "fingerprint") else ""
        write_packed(config, weights, q, Path(out), progress, fingerprint=fp, codes=codes)
        progress(f"load it with: --backend cpu_int4 --opt packed={out}")


def _gguf_packing(weights, extra: dict, q):
    """A GGUF's weights: streamed in their stored form, and Q4_0/Q8_0 blocks kept as they are unless a quantization
    option asks otherwise (plugins/cpu_int4/gguf_import.py); other weights unchanged. quant=gptq needs floats."""
    if str(extra.get("quant", "rtn")).lower() != "rtn":
        return q, weights, None
    from .gguf_import import packing
    return packing(weights, extra, q, QUANT_OPTIONS)


def _calibrated(config, weights, q, extra: dict, progress):
    """The weights to pack: as they are (quant=rtn), or with every block's linear layers quantized by GPTQ
    onto this exact int4 grid (quant=gptq; glmcore/gptq.py): the packer's round to nearest then gives back
    GPTQ's codes, so the packed format and the kernels are the same either way."""
    method = str(extra.get("quant", "rtn")).lower()
    if method == "rtn":
        if extra.get("calib"):
            raise BackendError("cpu_int4: calib=FILE is the calibration text of quant=gptq; add --opt quant=gptq")
        return weights
    if method != "gptq":
        raise BackendError(f"cpu_int4: quant={method!r} is not supported; use rtn (round to nearest) or gptq "
                           "(calibrated)")
    if config.arch != "glm":       # glmcore/gptq.py runs the dense block's forward to calibrate
        raise BackendError(f"cpu_int4: quant=gptq calibrates the dense GLMs, not {config.arch}; use quant=rtn")
    from glmcore.gptq import calibrated
    from .quant import SCALE_DTYPES, VERSION
    sd, g = SCALE_DTYPES[q.scale_dtype], q.group_size

    def grid(name, blk):
        """The grid quantize4 derives from a group (zero-padded to the group size, as it pads a row)."""
        if blk.shape[1] < g:
            blk = np.pad(blk, ((0, 0), (0, g - blk.shape[1])))
        if q.sym:
            d = blk[np.arange(len(blk)), np.abs(blk).argmax(1)] / -8.0
            d = d.astype(sd).astype(np.float32)
            return d, -8.0 * d, 0, 15
        lo, hi = blk.min(1), blk.max(1)
        return ((hi - lo) / 15.0).astype(sd).astype(np.float32), lo.astype(sd).astype(np.float32), 0, 15
    key = f"cpu_int4 v{VERSION} g{g} sym={q.sym} {q.scale_dtype}"
    return calibrated(config, weights, grid, lambda name, k: g, key, extra.get("calib"), progress=progress)


def _stderr(msg: str) -> None:
    import sys
    print(msg, file=sys.stderr, flush=True)


@hookimpl
def glmcore_backends():
    return [CpuInt4Backend()]
