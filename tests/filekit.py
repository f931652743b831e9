"""Writers of deliberately broken checkpoint files, for the hardening and fuzz tests."""
from __future__ import annotations

import collections
import io
import json
import pickle
import struct
import zipfile
from pathlib import Path

import numpy as np


def safetensors_bytes(header, data: bytes = b"") -> bytes:
    blob = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(blob)) + blob + data


class _Storage:
    def __init__(self, key: str, numel: int):
        self.key, self.numel = key, numel


class _Tensor:
    def __init__(self, storage, offset, size, stride):
        self.args = (storage, offset, size, stride, False, collections.OrderedDict())

    def __reduce__(self):
        import torch._utils
        return torch._utils._rebuild_tensor_v2, self.args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            import torch
            return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel)
        return None


def bin_bytes(tensors: dict, storages: dict[str, bytes]) -> bytes:
    """A torch.save-style zip: tensors name -> (storage key, offset, size, stride) over f32 storages
    (key -> raw bytes). Any field may be a lie; that is the point."""
    objs = {k: _Storage(k, len(v) // 4) for k, v in storages.items()}
    state = collections.OrderedDict(
        (name, _Tensor(objs.get(key) or _Storage(key, 0), off, size, stride))
        for name, (key, off, size, stride) in tensors.items())
    pkl = io.BytesIO()
    _Pickler(pkl, protocol=2).dump(state)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pkl.getvalue())
        for k, v in storages.items():
            zf.writestr(f"archive/data/{k}", v)
    return out.getvalue()


def f32(n: int) -> bytes:
    return np.arange(n, dtype="<f4").tobytes()


def write(path: Path, data: bytes) -> Path:
    Path(path).write_bytes(data)
    return Path(path)
