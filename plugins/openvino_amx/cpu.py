"""What this CPU offers for bf16: AMX (Sapphire Rapids and later) or AVX512-BF16 (Cooper Lake, Zen 4)."""
from __future__ import annotations

from glmcore.cpuinfo import cpu_flags


def has_amx() -> bool:
    return {"amx_tile", "amx_bf16"} <= cpu_flags()


def has_avx512_bf16() -> bool:
    return "avx512_bf16" in cpu_flags()


def native_bf16() -> bool:
    """OpenVINO's CPU plugin runs bf16 only where the ISA has it; elsewhere a bf16 hint runs as f32."""
    return has_amx() or has_avx512_bf16()
