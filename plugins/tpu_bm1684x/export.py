"""Write the ONNX parts of a model into a directory, with a manifest; reuse them when nothing changed.

Weights go to external data files shared by the parts that use them (embedding and embedding_cache
share `embed.weights`, block_N and block_cache_N share `layer_N.weights`), so the disk holds each
weight once and no .onnx file approaches 2 GB. (TPU-MLIR's loader pulls external data back into one
in-memory proto, so the biggest parts also get a TorchScript twin for it: see graphs.export_torchscript.)
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from glmcore.cache import build_once, intact
from glmcore.config import ModelConfig

from .spec import FORMAT_VERSION, TORCH_OPSET

MANIFEST = "manifest.json"
_ALIGN = 4096                 # external data offsets page-aligned (lets runtimes map them)
_INLINE_BYTES = 1024          # smaller tensors stay inside the .onnx


def manifest_key(cfg: ModelConfig, fingerprint: str, seq_len: int, dtype: str) -> dict:
    return {"format": FORMAT_VERSION, "fingerprint": fingerprint, "seq_len": seq_len, "dtype": dtype,
            "config": cfg.to_dict(), "opset": TORCH_OPSET}


def read_manifest(parts_dir: Path) -> dict | None:
    try:
        m = json.loads((Path(parts_dir) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    parts = m.get("parts", []) if isinstance(m, dict) else None
    # else rebuilt: a part is named by a plain file stem (never a path: the loader opens parts_dir / name.onnx)
    ok = isinstance(parts, list) and all(isinstance(p, dict) and isinstance(p.get("name"), str)
                                         and re.fullmatch(r"[A-Za-z0-9_-]+", p["name"]) for p in parts)
    return m if ok else None


def is_current(parts_dir: Path, key: dict) -> bool:
    m = read_manifest(parts_dir)
    return m is not None and m.get("key") == key and all((Path(parts_dir) / f"{p['name']}.onnx").is_file()
                                                          for p in m.get("parts", [])) \
        and intact(parts_dir)          # a damaged part is rebuilt, never handed to onnxruntime


def export_parts(cfg: ModelConfig, weights, seq_len: int, dtype: str, out: Path, progress=None) -> dict:
    """Export every part into `out` (replaced atomically) unless the parts there are current.
    Returns the manifest."""
    out = Path(out)
    key = manifest_key(cfg, weights.fingerprint(), seq_len, dtype)
    if is_current(out, key):
        if progress:
            progress(f"reusing the exported ONNX parts in {out} (same model and options)")
        return read_manifest(out)
    build_once(out, lambda tmp: _export_into(cfg, weights, seq_len, dtype, tmp, key, progress),
               complete=lambda p: is_current(p, key))
    return read_manifest(out)


def _export_into(cfg, weights, seq_len, dtype, out: Path, key: dict, progress) -> dict:
    import onnx
    import torch

    from .graphs import export_part, group_weights, part_specs

    parts = part_specs(cfg, seq_len, dtype)
    scratch = out / ".scratch.onnx"
    group, arrays, store = None, {}, None
    try:
        for n, part in enumerate(parts, 1):
            if part["group"] != group:               # a group's parts are consecutive: load its weights once
                if store:
                    store.close()
                group = part["group"]
                arrays = group_weights(cfg, weights, group, seq_len, dtype)
                store = _WeightStore(out / f"{group}.weights") if arrays else None
            export_part(part, cfg, dtype, arrays, scratch)
            model = onnx.load(str(scratch))
            if store:
                store.attach(model, arrays)
            onnx.save(model, str(out / f"{part['name']}.onnx"))
            part["f32_ops"] = norm_op_names(model)
            if progress:
                progress(f"[{n}/{len(parts)}] exported {part['name']}.onnx")
    finally:
        if store:
            store.close()
        scratch.unlink(missing_ok=True)
    manifest = {"key": key, "parts": parts, "torch": torch.__version__, "onnx": onnx.__version__}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def norm_op_names(model) -> list[str]:
    """The TPU-MLIR op names of the RMSNorm nodes (scopes .../input_norm/, .../post_attn_norm/,
    .../final_norm/), for the quantize table that keeps them in F32.

    TPU-MLIR's ONNX front end (python/transform/OnnxConverter.py) names each op after its node's first
    output plus the op type, "{output}_{OpType}"; the quantize table is matched against those names and
    unknown names are silently ignored (TopToTpuPass.cpp, init_qtable). Canonicalization then fuses
    Pow/ReduceMean/Add/Sqrt/Div/Mul/Mul into one top.RMSNormOp that keeps the location, hence the name,
    of the final weight Mul (Top/Canonicalize/Reciprocal.cpp, MergeToRMSNormPattern). Every op of the
    norm is listed: the fused op is found by its last Mul, an unfused norm (a TPU-MLIR without that
    pattern) by all of them."""
    return [f"{node.output[0]}_{node.op_type}" for node in model.graph.node
            if "norm/" in node.name and node.op_type != "Constant"]


class _WeightStore:
    """One external-data file per weight group; each array is written once and shared by the parts."""

    def __init__(self, path: Path):
        self.path = path
        self.f = open(path, "wb")
        self.offsets: dict[str, tuple[int, int]] = {}

    def attach(self, model, arrays: dict) -> None:
        """Turn the graph inputs named after weights into initializers (external data if not tiny)."""
        from onnx import TensorProto, helper, numpy_helper
        kept = [i for i in model.graph.input if i.name not in arrays]
        used = [i.name for i in model.graph.input if i.name in arrays]
        del model.graph.input[:]
        model.graph.input.extend(kept)
        for name in used:
            a = arrays[name]
            if a.nbytes < _INLINE_BYTES:
                model.graph.initializer.append(numpy_helper.from_array(a, name))
                continue
            if name not in self.offsets:
                pos = self.f.tell()
                self.f.write(b"\0" * (-pos % _ALIGN))
                self.offsets[name] = (self.f.tell(), a.nbytes)
                self.f.write(memoryview(np.ascontiguousarray(a)).cast("B"))
            offset, length = self.offsets[name]
            t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(a.dtype), dims=a.shape)
            for k, v in (("location", self.path.name), ("offset", str(offset)), ("length", str(length))):
                entry = t.external_data.add()
                entry.key, entry.value = k, v
            t.data_location = TensorProto.EXTERNAL
            model.graph.initializer.append(t)

    def close(self) -> None:
        if not self.f.closed:
            self.f.close()
