"""The built-in default model: a small ChatGLM3 trained here on classical Chinese poems.

It ships as package data (glmcore/data/demo-chatglm3-poet: config.json, model.safetensors, mtp.safetensors
(a NextN layer trained for it), tokenizer.model, tokenizer_config.json and its model card) and is copied on first use into the cache
directory in the real on-disk layout, so every backend loads it like a checkpoint from the hub. The
training script is tools/train_demo.py; the random-weight synthetic checkpoints (glmcore.synth)
remain for tests and benchmarks.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

from .errors import GlmcoreError

DEMO_NAME = "demo-chatglm3-poet"
PACKAGED_DIR = Path(__file__).resolve().parent / "data" / DEMO_NAME
# mtp.safetensors: its NextN layer for speculative decoding (--speculative mtp), beside the checkpoint proper
MODEL_FILES = ("config.json", "model.safetensors", "mtp.safetensors", "tokenizer.model", "tokenizer_config.json")
CARD_FILES = ("README.md",)


def packaged_dir() -> Path:
    """The model's folder inside the installed package; a one-line error if a file is missing."""
    missing = [f for f in MODEL_FILES if not (PACKAGED_DIR / f).is_file()]
    if missing:
        raise GlmcoreError(f"the built-in demo model is incomplete: {PACKAGED_DIR / missing[0]} is missing; "
                           "reinstall glmcore (pip install --force-reinstall glmcore) or pass --model DIR")
    return PACKAGED_DIR


def _digest(src: Path) -> str:
    h = hashlib.sha256()
    for name in MODEL_FILES:
        h.update(name.encode() + b"\0" + (src / name).read_bytes())
    return h.hexdigest()[:12]


def demo_model_dir(notice=lambda msg: print(msg, file=sys.stderr)) -> Path:
    """The trained demo model in the cache directory (cache/demo/demo-chatglm3-poet-<hash>), copied
    there from the package on first use; a new package version gets a new folder."""
    from .cache import build_once, cache_root
    src = packaged_dir()

    def build(tmp: Path) -> None:
        for name in MODEL_FILES + CARD_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)

    path = build_once(cache_root() / "demo" / f"{DEMO_NAME}-{_digest(src)}", build,
                      complete=lambda p: all((p / f).is_file() for f in MODEL_FILES))
    raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    notice(f"note: using the built-in demo model ({path}): a small ChatGLM3 "
           f"({raw['num_layers']} layers, hidden {raw['hidden_size']}) trained on classical Chinese poems; "
           "pass --model DIR for a real checkpoint")
    return path
