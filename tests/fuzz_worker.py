"""Loads each mutated file of a fuzz batch, in a process of its own (a crash is seen by the parent).

usage: python fuzz_worker.py JOBS.json. Prints `start I` before job I and one JSON result after it:
{"i": I, "ok": true} or {"i": I, "error": type, "message": str} for a GlmcoreError, or
{"i": I, "bug": traceback} for any other exception. A crash leaves `start I` as the last line."""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import numpy as np

from glmcore.errors import GlmcoreError


def _touch(arrays) -> None:
    for a in arrays.values():
        np.asarray(a, dtype=np.float64).sum()         # read every byte the view claims


def load_safetensors(path, **_):
    from glmcore.weights import read_safetensors
    _touch(read_safetensors(Path(path)))


def load_bin(path, **_):
    from glmcore.weights import read_torch_zip
    _touch(read_torch_zip(Path(path)))


def load_checkpoint(path, **_):
    """What `glmcore run` reads from a model directory, short of a backend."""
    from glmcore.config import ModelConfig
    from glmcore.tokenizer import load_tokenizer
    from glmcore.weights import load_weights
    cfg = ModelConfig.from_dir(path)
    tok = load_tokenizer(path, cfg.family)
    text = tok.decode(tok.encode("hello 你好 <|user|>") + list(range(min(tok.n_vocab, 4096))))
    assert isinstance(text, str)
    _touch(load_weights(path, cfg))


def load_gguf(path, cache, **_):
    """What `glmcore run --model FILE.gguf` reads, short of a backend: every tensor dequantized."""
    import os
    os.environ["GLMCORE_CACHE"] = cache
    from glmcore.gguf import open_gguf
    from glmcore.tokenizer import load_tokenizer
    c = open_gguf(path)
    tok = load_tokenizer(c.tokenizer_dir, c.config.family)
    assert isinstance(tok.decode(tok.encode("hello 你好 <|user|>") + list(range(min(tok.n_vocab, 4096)))), str)
    _touch(c.weights)


def _model(model_dir):
    from glmcore.config import ModelConfig
    from glmcore.weights import load_weights
    cfg = ModelConfig.from_dir(model_dir)
    return cfg, load_weights(model_dir, cfg)


def load_packed(path, model, **_):
    from glmcore.backend import LoadOptions
    from glmcore_plugins.cpu_int4 import CpuInt4Backend
    cfg, w = _model(model)
    s = CpuInt4Backend().load(cfg, w, LoadOptions("f32", "int4", 32, threads=1, extra={"packed": path}))
    assert np.isfinite(s.prefill([1, 2, 3])).all() or True


def load_ir(path, model, **_):
    from glmcore.backend import LoadOptions
    from glmcore_plugins.openvino_amx import OpenVINOBackend
    cfg, w = _model(model)
    OpenVINOBackend().load(cfg, w, LoadOptions("f32", "int8", 32, threads=1, extra={"ir": path})).prefill([1, 2, 3])


def load_onnx_entry(path, **_):
    """tpu_bm1684x's loader must see a damaged cache entry as stale (and so rebuild it) before
    onnxruntime reads it."""
    from glmcore_plugins.tpu_bm1684x.export import is_current, read_manifest
    m = read_manifest(Path(path))
    if m is not None and is_current(Path(path), m.get("key")):
        raise AssertionError("a mutated cache entry is taken as current")


LOADERS = {k[5:]: v for k, v in globals().items() if k.startswith("load_")}


def main() -> int:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    for i, job in enumerate(jobs):
        print(f"start {i}", flush=True)
        try:
            LOADERS[job["kind"]](**job)
            res = {"i": i, "ok": True}
        except GlmcoreError as e:
            res = {"i": i, "error": type(e).__name__, "message": str(e)}
        except Exception:
            res = {"i": i, "bug": traceback.format_exc()}
        print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
