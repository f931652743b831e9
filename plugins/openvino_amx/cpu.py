"""What this CPU offers OpenVINO's CPU plugin: bf16 (AMX on Sapphire Rapids and later, AVX512-BF16 on Cooper
Lake / Zen 4) and integer matmul kernels (AMX-INT8, AVX-512 VNNI, AVX-VNNI) for compressed weights."""
from __future__ import annotations

from glmcore.cpuinfo import cpu_flags


def has_amx() -> bool:
    return {"amx_tile", "amx_bf16"} <= cpu_flags()


def has_avx512_bf16() -> bool:
    return "avx512_bf16" in cpu_flags()


def native_bf16() -> bool:
    """OpenVINO's CPU plugin runs bf16 only where the ISA has it; elsewhere a bf16 hint runs as f32."""
    return has_amx() or has_avx512_bf16()


def integer_isa() -> str | None:
    """The ISA OpenVINO's CPU plugin runs int8/int4-compressed matmuls on with integer dot products, or None.
    Its dynamic quantization needs VNNI (avx512_core_vnni or avx2_vnni) or AMX; without them the plugin
    expands compressed weights to f32 in every matmul (brgemm_avx2_f32), so int4 decodes no faster than int8
    and cpu_int4's own kernels are the faster default."""
    f = cpu_flags()
    if "amx_int8" in f:
        return "AMX-INT8"
    if "avx512_vnni" in f:
        return "AVX-512 VNNI"
    if "avx_vnni" in f:
        return "AVX-VNNI"
    return None


def compressed_matmul_kernel() -> str:
    """The primitive OpenVINO really compiles an int8-compressed matmul to on this CPU (read from the compiled
    model's runtime info, e.g. brgemm_avx2_f32), with the default dynamic quantization of a bf16/f32 run."""
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops
    x = ops.parameter([1, 64], ov.Type.f32, name="x")
    w = ops.convert(ops.constant(np.ones((64, 64), np.int8)), ov.Type.f32)
    y = ops.matmul(x, ops.multiply(w, ops.constant(np.full((64, 1), 0.5, np.float32))), False, True)
    compiled = ov.Core().compile_model(ov.Model([y], [x], "kernel_probe"), "CPU",
                                       {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "32"})
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        if info["layerType"].astype(str) == "FullyConnected":
            return info["primitiveType"].astype(str)
    return "unknown (no FullyConnected node in the compiled model)"
