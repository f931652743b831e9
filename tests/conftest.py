"""Shared fixtures: tiny synthetic checkpoints of each family, made once per test session."""
from __future__ import annotations

from pathlib import Path

import pytest

SHARED_MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"


@pytest.fixture(scope="session")
def make_tiny(tmp_path_factory):
    """make_tiny(family, fmt="safetensors", **kw) -> checkpoint dir (cached per arguments)."""
    from glmcore.synth import make_model
    made: dict = {}

    def make(family: str, fmt: str = "safetensors", **kw) -> Path:
        key = (family, fmt, tuple(sorted(kw.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"{family}-{fmt}")
            make_model(family, "tiny", out, fmt=fmt, **kw)
            made[key] = out
        return made[key]

    return make


@pytest.fixture(scope="session")
def shared_models() -> Path:
    if not SHARED_MODELS.is_dir():
        pytest.skip(f"real tokenizer files not found at {SHARED_MODELS}")
    return SHARED_MODELS
