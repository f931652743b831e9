"""Checkpoint reading: safetensors and PyTorch .bin shards -> canonical tensor names -> numpy arrays.

Both formats are read without torch: safetensors is a JSON header plus raw little-endian data, and a
PyTorch zip checkpoint is a pickle whose tensors point at uncompressed storage files in the zip. Both
are memory-mapped, so a 6B checkpoint costs no RAM until a backend touches it. bf16 stays bf16
(ml_dtypes), f16 stays f16: the backend decides the compute precision.

The safetensors library's numpy API cannot represent bf16, and torch.load would make torch a core
dependency and execute arbitrary pickles; hence these two small readers.
"""
from __future__ import annotations

import json
import math
import pickle
import struct
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePosixPath, PureWindowsPath

import ml_dtypes
import numpy as np

from . import arch
from .config import ModelConfig
from .errors import CheckpointError
from .files import read_bounded
from .generated import GeneratedWeights, generated_weights

BF16 = np.dtype(ml_dtypes.bfloat16)
_ST_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": BF16, "F64": np.dtype("<f8"),
              "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I8": np.dtype("i1"), "U8": np.dtype("u1")}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
WEIGHT_DTYPES = (np.dtype("<f4"), np.dtype("<f2"), BF16)
MAX_INDEX_BYTES = 64 << 20      # a real *.index.json is tens of KB


# ---------------------------------------------------------------- canonical names

def canonical_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor and its shape, as cfg's architecture module (glmcore/arch) states them."""
    return {name: spec.shape for name, spec in arch.of(cfg).tensors(cfg).items()}


# ---------------------------------------------------------------- the Weights mapping

class Weights(Mapping):
    """Canonical name -> numpy array (memory-mapped, dtype as stored). Read-only."""

    def __init__(self, tensors: dict[str, np.ndarray], files: list[Path], config: ModelConfig | None = None):
        self._t = tensors
        self.files = files
        self.config = config

    def __getitem__(self, name: str) -> np.ndarray:
        return self._t[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._t)

    def __len__(self) -> int:
        return len(self._t)

    def f32(self, name: str) -> np.ndarray:
        return np.asarray(self._t[name], dtype=np.float32)

    @property
    def dtype(self) -> np.dtype:
        return self._t["embed.weight"].dtype

    def fingerprint(self) -> str:
        """The checkpoint's identity, for conversion caches and the provenance of converted models: its
        config and every tensor's name, dtype and shape and the bytes of 16 of its rows. Content, not paths
        or times: a copied checkpoint is the same model, two checkpoints with the same config but other
        weights differ. Reading those rows is a random read per row (12 s for a 12-layer GLM-4.7-Flash's 1,710
        tensors on a cold page cache), so the result is remembered in the glmcore cache against the files'
        paths, sizes, modification times and inodes: a file changed in any of those is read again."""
        memo = _FingerprintMemo(self.files, self.config, self._t)
        known = memo.get()
        if known:
            return known
        import hashlib
        h = hashlib.sha256(json.dumps(self.config.to_dict() if self.config else None, sort_keys=True).encode())
        for name in sorted(self._t):
            t = self._t[name]
            h.update(f"{name}:{t.dtype.str}:{t.shape}".encode())
            if t.ndim and t.shape[0]:
                rows = np.unique(np.linspace(0, t.shape[0] - 1, 16).astype(np.int64))
                h.update(np.ascontiguousarray(t[rows]).view(np.uint8).tobytes())
                # the pages read (and those the kernel maps around them: GBs over an MoE checkpoint's thousands
                # of expert tensors) would count in this process's RSS for as long as it runs
                release(t)
        fingerprint = h.hexdigest()[:16]
        memo.put(fingerprint)
        return fingerprint


class _FingerprintMemo:
    """Checkpoint fingerprints remembered in the glmcore cache (FILE: key -> fingerprint, the MAX most recent),
    keyed by the config, the tensors' names, dtypes and shapes (two views of the same files differ) and each
    file's resolved path, size, modification time and inode. No files (tensors built in memory): nothing is
    remembered. A cache that cannot be written only costs the reading again."""
    FILE, MAX = "fingerprints.json", 512

    def __init__(self, files: list[Path], config: ModelConfig | None, tensors: Mapping[str, np.ndarray]):
        self.key = None
        try:
            stats = [(str(Path(f).resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
                     for f in files for st in [Path(f).stat()]]
        except OSError:
            return
        if stats:
            import hashlib
            layout = [(n, str(t.dtype), list(t.shape)) for n, t in sorted(tensors.items())]
            self.key = hashlib.sha256(json.dumps([stats, config.to_dict() if config else None, layout],
                                                 sort_keys=True).encode()).hexdigest()[:32]

    def _read(self) -> dict:
        from .cache import read_json
        known = read_json(self.FILE)
        return known if isinstance(known, dict) else {}

    def get(self) -> str | None:
        value = self._read().get(self.key) if self.key else None
        return value if isinstance(value, str) and len(value) == 16 and all(c in "0123456789abcdef" for c in value) \
            else None

    def put(self, fingerprint: str) -> None:
        if not self.key:
            return
        from .cache import write_json
        known = self._read()
        known.pop(self.key, None)
        known[self.key] = fingerprint                       # insertion order: the most recent last
        try:
            write_json(self.FILE, dict(list(known.items())[-self.MAX:]))
        except OSError:
            pass


# A NextN (multi-token-prediction) layer trained for a checkpoint that shipped without one, kept apart so that
# every other reader of the checkpoint (transformers, llama.cpp's converter) sees it unchanged; read only when
# config.json declares num_nextn_predict_layers. The demo model's is one (tools/train_demo.py mtp).
NEXTN_FILE = "mtp.safetensors"


def load_weights(model_dir: str | Path, cfg: ModelConfig) -> Weights | GeneratedWeights:
    model_dir = Path(model_dir)
    generated = generated_weights(model_dir, cfg)      # a synthetic checkpoint without weight files
    if generated is not None:
        return generated
    raw, files = _read_raw(model_dir)
    side = model_dir / NEXTN_FILE
    if cfg.num_mtp_layers and side.is_file():
        nextn = read_safetensors(side)
        both = sorted(set(nextn) & set(raw))
        if both:
            raise CheckpointError(f"{side}: tensor {both[0]} is also in the checkpoint's own weights; keep each "
                                  f"tensor in one file (remove {NEXTN_FILE} or the copy)")
        raw, files = {**raw, **nextn}, files + [side]
    module = arch.of(cfg)
    tensors = module.to_canonical(raw, model_dir)
    # transformers writes a module the config turns off at zero width (the shared expert at n_shared_experts 0)
    expected = canonical_shapes(cfg)
    tensors = {n: t for n, t in tensors.items() if t.size or n in expected}
    module.complete(cfg, tensors, model_dir)
    check_tensors(tensors, cfg, model_dir)
    return Weights(tensors, files, cfg)


def _read_raw(model_dir: Path) -> tuple[dict[str, np.ndarray], list[Path]]:
    for index_name, reader in (("model.safetensors.index.json", read_safetensors),
                               ("pytorch_model.bin.index.json", read_torch_zip)):
        index = model_dir / index_name
        if index.is_file():
            weight_map = _read_index(index)
            files = sorted({model_dir / f for f in weight_map.values()})
            odd = [f.name for f in files if f.exists() and not f.is_file()]
            if odd:
                raise CheckpointError(f"{model_dir}: shard {odd[0]} (listed in {index_name}) is not a regular file "
                                      "(a FIFO, device or directory); replace it with the real shard")
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{model_dir}: missing shard {missing[0]} (listed in {index_name}); "
                                      "download all shards of the checkpoint")
            out: dict[str, np.ndarray] = {}
            for f in files:
                out.update(reader(f))
            absent = sorted(set(weight_map) - set(out))
            if absent:
                raise CheckpointError(f"{model_dir / weight_map[absent[0]]}: lacks tensor {absent[0]} promised by "
                                      f"{index_name}; the shard is from another checkpoint, re-download it")
            return out, files
    for name, reader in (("model.safetensors", read_safetensors), ("pytorch_model.bin", read_torch_zip)):
        if (model_dir / name).is_file():
            return reader(model_dir / name), [model_dir / name]
    raise CheckpointError(f"{model_dir}: no weights found (expected model.safetensors[.index.json] or "
                          "pytorch_model.bin[.index.json]); point --model at a checkpoint directory")


def _read_index(index: Path) -> dict[str, str]:
    """The weight_map of an index file: tensor name -> shard file name inside the model directory."""
    try:
        # bounded: GLM-4's index is 30 KB; a huge one is refused before it is parsed
        weight_map = json.loads(read_bounded(index, MAX_INDEX_BYTES, index.name, "restore it from the original "
                                             "checkpoint", CheckpointError).decode("utf-8"))["weight_map"]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise CheckpointError(f"{index}: not a valid index ({type(e).__name__}: {str(e)[:80]}); restore it from "
                              "the original checkpoint") from None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise CheckpointError(f"{index}: weight_map is not an object of tensor name -> file name; restore it "
                              "from the original checkpoint")
    for shard in set(weight_map.values()):
        # A shard is a file of this directory: never an absolute path or one that climbs out of it.
        p = PurePosixPath(shard.replace("\\", "/"))
        if not shard or p.is_absolute() or ".." in p.parts or PureWindowsPath(shard).drive:
            raise CheckpointError(f"{index}: shard {shard[:80]!r} lies outside the model directory; an index may "
                                  "only name files inside it")
    return weight_map


def check_tensors(tensors: dict[str, np.ndarray], cfg: ModelConfig, model_dir: Path) -> None:
    """Every canonical tensor of cfg present, of a float dtype and its shape (an optional group all or none);
    nothing else. For any reader: a checkpoint directory or a GGUF."""
    expected = canonical_shapes(cfg)
    optional = {n: s.shape for n, s in arch.of(cfg).optional_tensors(cfg).items()}
    for group in {_group(n) for n in optional if n in tensors}:        # a stored optional group is complete
        expected.update({n: s for n, s in optional.items() if _group(n) == group})
    for name, shape in expected.items():
        if name not in tensors:
            raise CheckpointError(f"{model_dir}: tensor {name} is missing; the checkpoint is incomplete "
                                  "or does not match config.json")
        if tensors[name].dtype not in WEIGHT_DTYPES:
            raise CheckpointError(f"{model_dir}: tensor {name} is stored as {tensors[name].dtype}, not f32/f16/bf16; "
                                  "quantized or integer checkpoints are not supported")
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(f"{model_dir}: tensor {name} has shape {tuple(tensors[name].shape)} but config.json "
                                  f"implies {shape}; config.json belongs to another model size")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise CheckpointError(f"{model_dir}: tensor {extra[0]} does not fit config.json "
                              f"(num_layers={cfg.num_layers}); config.json belongs to another model size")


def _group(name: str) -> str:
    """An optional tensor's group: its name up to the first numbered part (mtp.0.enorm.weight -> mtp.0)."""
    parts = name.split(".")
    i = next((k for k, p in enumerate(parts) if p.isdigit()), len(parts) - 1)
    return ".".join(parts[:i + 1])


def release(arr: np.ndarray) -> None:
    """Drop a memory-mapped tensor's pages from this process once a backend holds its own copy: they
    stay in the OS page cache (reading the tensor again maps them back), but no longer count in the
    process's resident memory next to the copy. No-op for arrays that are not mapped, or without madvise."""
    import mmap
    base = arr
    while base is not None and not isinstance(getattr(base, "base", None), mmap.mmap):
        base = getattr(base, "base", None)
    if base is None or not hasattr(mmap, "MADV_DONTNEED") or not arr.size:
        return
    start = base.ctypes.data - base.offset % mmap.ALLOCATIONGRANULARITY      # where np.memmap's mapping begins
    steps = [(d - 1) * st for d, st in zip(arr.shape, arr.strides)]
    low = arr.ctypes.data + sum(x for x in steps if x < 0)
    high = arr.ctypes.data + sum(x for x in steps if x > 0) + arr.itemsize
    first = (low - start) // mmap.PAGESIZE * mmap.PAGESIZE
    base.base.madvise(mmap.MADV_DONTNEED, first, high - start - first)


# ---------------------------------------------------------------- safetensors

def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


def _dims(shape, what: str, path: Path) -> tuple[int, ...]:
    """A tensor shape from a file: at most 8 non-negative integers (Python ints: no overflow)."""
    if not isinstance(shape, (list, tuple)) or len(shape) > 8 or \
            not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape):
        raise CheckpointError(f"{path}: {what} has invalid shape {str(shape)[:80]}; re-download this file")
    return tuple(shape)


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every header field is checked before use: dtype known, shape of non-negative integers, offsets
    inside the data section, sized exactly for the shape, and no two tensors overlapping."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated (no header); re-download this shard")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 << 20):
            raise CheckpointError(f"{path}: corrupt header (length {n} for a {size}-byte file); re-download this shard")
        try:
            header = json.loads(f.read(n), object_pairs_hook=_no_duplicates)
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise CheckpointError(f"{path}: corrupt header (not JSON); re-download this shard") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt header (not a JSON object); re-download this shard")
    header.pop("__metadata__", None)
    base = 8 + n
    entries = []
    for name, info in header.items():
        try:
            dtype = _ST_DTYPES[info["dtype"]]
            start, end = info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry for {name!r}; re-download this shard") from None
        shape = _dims(info.get("shape"), f"tensor {name!r}", path)
        nbytes = dtype.itemsize * math.prod(shape)
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end
                and base + end <= size and end - start == nbytes):
            raise CheckpointError(f"{path}: truncated or corrupt data for {name} (offsets {start}..{end}, "
                                  f"{nbytes} bytes expected, file is {size} bytes); re-download this shard")
        entries.append((start, end, name, dtype, shape))
    entries.sort(key=lambda e: e[:2])
    for a, b in zip(entries, entries[1:]):
        if b[0] < a[1]:
            raise CheckpointError(f"{path}: tensors {a[2]} and {b[2]} overlap in the file; re-download this shard")
    out = {}
    mm = np.memmap(path, dtype=np.uint8, mode="r") if size > base else np.zeros(0, np.uint8)
    for start, end, name, dtype, shape in entries:
        out[name] = mm[base + start: base + end].view(dtype).reshape(shape)
    return out


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    header, offset = {}, 0
    arrays = []
    for name, t in tensors.items():
        t = np.ascontiguousarray(t)
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
        arrays.append(t)
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)     # keep the data 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in arrays:
            f.write(t.tobytes())


# ---------------------------------------------------------------- PyTorch zip checkpoints (no torch)

_TORCH_STORAGE = {"FloatStorage": np.dtype("<f4"), "HalfStorage": np.dtype("<f2"), "BFloat16Storage": BF16,
                  "DoubleStorage": np.dtype("<f8"), "LongStorage": np.dtype("<i8"), "IntStorage": np.dtype("<i4"),
                  "CharStorage": np.dtype("i1"), "ByteStorage": np.dtype("u1"), "BoolStorage": np.dtype("?")}


class _Storage:
    def __init__(self, dtype: np.dtype, key: str):
        self.dtype, self.key = dtype, key


def _rebuild_tensor(storage, offset, size, stride, *_):
    return ("tensor", storage, offset, tuple(size), tuple(stride))


class _SafeUnpickler(pickle.Unpickler):
    """Resolves only what a state_dict pickle needs; anything else is refused, never executed."""

    def find_class(self, module, name):
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_tensor"):
            return _rebuild_tensor
        if module == "torch" and name in _TORCH_STORAGE:
            return _TORCH_STORAGE[name]
        if module == "collections" and name == "OrderedDict":
            import collections
            return collections.OrderedDict
        if module == "torch" and name == "Size":
            return tuple
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")

    def persistent_load(self, pid):
        # ('storage', storage_type, key, location, numel)
        if pid[0] == "storage":
            stype = pid[1]
            dtype = stype if isinstance(stype, np.dtype) else _torch_dtype(stype)
            return _Storage(dtype, str(pid[2]))
        raise pickle.UnpicklingError(f"unknown persistent id {pid[0]!r}")


def _torch_dtype(obj) -> np.dtype:
    name = getattr(obj, "__name__", str(obj))
    raise pickle.UnpicklingError(f"unsupported storage type {name}")


def read_torch_zip(path: Path) -> dict[str, np.ndarray]:
    """A torch.save zip. The pickle is read by _SafeUnpickler (nothing in it runs); each tensor's
    storage, offset, size and stride are checked to stay inside its storage before it is mapped."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path}: not a PyTorch zip checkpoint (truncated, or the pre-1.6 legacy format); "
                              "re-download it or convert it to safetensors")
    try:
        zf = zipfile.ZipFile(path)
        pkl = next(n for n in zf.namelist() if n.endswith("data.pkl"))
        prefix = pkl[: -len("data.pkl")]
        state = _SafeUnpickler(zf.open(pkl)).load()
    except (StopIteration, pickle.UnpicklingError, EOFError, zipfile.BadZipFile, ValueError, TypeError,
            AttributeError, KeyError, IndexError, RecursionError, MemoryError, OverflowError, OSError) as e:
        raise CheckpointError(f"{path}: corrupt PyTorch checkpoint ({type(e).__name__}: {str(e)[:100]}); "
                              "re-download it") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a state_dict")
    out = {}
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        for name, t in state.items():
            if not (isinstance(t, tuple) and len(t) == 5 and t[0] == "tensor" and isinstance(t[1], _Storage)):
                raise CheckpointError(f"{path}: entry {str(name)[:80]!r} is not a tensor")
            _, storage, offset, size, stride = t
            size, stride = _dims(size, f"tensor {name!r}", path), _dims(stride, f"stride of {name!r}", path)
            if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0 or len(size) != len(stride):
                raise CheckpointError(f"{path}: tensor {name!r} has an invalid offset or stride; re-download it")
            try:
                info = zf.getinfo(f"{prefix}data/{storage.key}")
            except KeyError:
                raise CheckpointError(f"{path}: storage {storage.key[:40]!r} of tensor {name!r} is missing from "
                                      "the archive; re-download it") from None
            if info.compress_type != zipfile.ZIP_STORED:
                raise CheckpointError(f"{path}: storage {storage.key} is compressed; re-save with torch.save")
            # Data begins after the local file header, whose extra field may differ from the central one.
            f.seek(info.header_offset)
            local = f.read(30)
            if len(local) < 30 or local[:4] != b"PK\x03\x04":
                raise CheckpointError(f"{path}: corrupt zip entry for storage {storage.key}; re-download it")
            fname_len, extra_len = struct.unpack("<HH", local[26:30])
            start = info.header_offset + 30 + fname_len + extra_len
            n_items = info.file_size // storage.dtype.itemsize
            if start + info.file_size > file_size:
                raise CheckpointError(f"{path}: truncated (storage {storage.key} runs past the end); re-download it")
            # The last element the view touches must lie inside the storage (an empty view touches none).
            last = offset + sum((d - 1) * s for d, s in zip(size, stride)) if math.prod(size) else offset - 1
            if last >= n_items:
                raise CheckpointError(f"{path}: tensor {name!r} reaches element {last} of storage {storage.key}, "
                                      f"which holds {n_items}; the file is corrupt, re-download it")
            flat = np.memmap(path, dtype=storage.dtype, mode="r", offset=start, shape=(n_items,)) if n_items \
                else np.zeros(0, storage.dtype)
            out[name] = np.lib.stride_tricks.as_strided(
                flat[offset:], shape=size, strides=[s * storage.dtype.itemsize for s in stride], writeable=False)
    return out
