"""The cache directory and the one way results are written into it.

Conversion results (synthetic checkpoints, OpenVINO IR, ONNX parts, packed int4) are expensive and
may be built by two processes at once, so each is built in a temporary sibling directory and renamed
into place: a reader never sees half a result, and a concurrent build of the same thing is harmless.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    if os.environ.get("GLMCORE_CACHE"):
        return Path(os.environ["GLMCORE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "glmcore"


def build_once(final: Path, build: Callable[[Path], object], complete: Callable[[Path], bool]) -> Path:
    """Make directory `final` by build(tmp) unless complete(final) already holds. A stale `final`
    (present but not complete) is replaced."""
    final = Path(final)
    if complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}-"))
    try:
        build(tmp)
        if final.exists() and not complete(final):
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if not complete(final):      # only a concurrent build of the same result may win the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
