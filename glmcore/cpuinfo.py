"""What the CPU is and which instruction-set features it reports (Linux /proc/cpuinfo), for probes
and benchmark headers. Backends still verify at run time what their kernels can really use."""
from __future__ import annotations

import platform
from functools import lru_cache


def _field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    return frozenset((_field("flags") or "").split())


@lru_cache(maxsize=1)
def cpu_name() -> str:
    return _field("model name") or platform.processor() or platform.machine()
