"""Nothing glmcore runs contacts the network. The one runtime that would: OpenVINO's Python package
sends usage telemetry on import (openvino.tools.ovc -> openvino_telemetry, which also writes a client
id under ~/intel) unless openvino_telemetry cannot be imported, in which case OpenVINO uses its own
no-op stub. Blocking that import is the opt-out; it must happen before anything imports openvino,
so glmcore/__init__.py calls this first. (onnxruntime, torch, sentencepiece and tiktoken as glmcore
uses them -- a rank file read from disk -- send nothing.)"""
from __future__ import annotations

import sys


def block_telemetry() -> None:
    if "openvino_telemetry" not in sys.modules:   # already imported by the host application: too late
        sys.modules["openvino_telemetry"] = None  # `import openvino_telemetry` now raises ImportError
