"""GGUF files (llama.cpp's format) as glmcore checkpoints: `--model FILE.gguf`, or the first file of a split
set (`NAME-00001-of-00003.gguf`).

Read with the `gguf` package (llama.cpp's own gguf-py), through a subclass that checks every count, size and
offset before the reader acts on it: a GGUF from the internet is untrusted input, and the stock reader loops
without end on a huge array count past the end of a file. What the file states is then mapped by the
architecture's module (glmcore/arch: `gguf_config`, `gguf_to_canonical`) onto glmcore's config and canonical
tensor names; the tokenizer and chat template come from `tokenizer.ggml.*` and `tokenizer.chat_template`,
written once as the tokenizer files glmcore's loaders read (a small directory in the cache).

Tensors keep their stored form: float types as memory-mapped arrays, quantized ones as their raw blocks,
dequantized (with `gguf.quants.dequantize`) only when a backend asks for the float array; a backend that runs
the blocks themselves (cpu_int4: Q4_0, Q8_0) takes them from `GGUFWeights.stored`.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .errors import CheckpointError
from .weights import BF16, Weights, check_tensors

# Types whose dequantizer the gguf package has and glmcore loads; IQ*/TQ* and the rest are refused by name.
LOADABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Bounds far beyond any real GLM file (GLM-4.6's GGUF: ~1800 tensors, a 151552-token vocabulary, 50 keys).
MAX_TENSORS = 1 << 16
MAX_KEYS = 1 << 12
MAX_ARRAY = 1 << 22
MAX_STRING = 1 << 24            # a chat template is tens of KB; a token a few bytes
MAX_DIMS = 4                    # GGML_MAX_DIMS
MAX_DIM = 1 << 40
MAX_ELEMENTS = 1 << 48
SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class _Bad(Exception):
    """A structural problem found while the header is parsed (becomes one CheckpointError)."""


def _reader_class():
    """GGUFReader with bounds on every count and read (built lazily: gguf is imported only for GGUF files)."""
    from gguf import GGUFReader, GGUFValueType

    min_size = {GGUFValueType.STRING: 8, GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8,
                GGUFValueType.FLOAT64: 8, GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4,
                GGUFValueType.FLOAT32: 4, GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2}

    class CheckedReader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            count, size = int(count), np.dtype(dtype).itemsize
            if offset < 0 or count < 0 or offset + size * count > len(self.data):
                raise _Bad(f"truncated: a read of {size * count} bytes at byte {offset} runs past the end of the "
                           f"{len(self.data)}-byte file")
            return super()._get(offset, dtype, count, override_order)

        def _get_str(self, offset):
            n = int(self._get(offset, np.uint64)[0])
            if n > MAX_STRING:
                raise _Bad(f"a string of {n} bytes at byte {offset}")
            return super()._get_str(offset)

        def _get_field_parts(self, orig_offs, raw_type):
            try:
                kind = GGUFValueType(int(raw_type))
            except ValueError:
                raise _Bad(f"unknown metadata value type {int(raw_type)} at byte {orig_offs}") from None
            if kind == GGUFValueType.ARRAY:
                item = int(self._get(orig_offs, np.uint32)[0])
                n = int(self._get(orig_offs + 4, np.uint64)[0])
                if item == GGUFValueType.ARRAY:
                    raise _Bad(f"a nested metadata array at byte {orig_offs}")
                if n > MAX_ARRAY or n * min_size.get(item, 1) > len(self.data) - orig_offs:
                    raise _Bad(f"a metadata array of {n} items at byte {orig_offs}")
                return self._array(orig_offs, item, n)
            return super()._get_field_parts(orig_offs, raw_type)

        def _array(self, orig_offs, item, n):
            """An array as one part of all its items (the stock reader makes numpy views per item: a minute for
            a 151552-token vocabulary and its merges): a numpy array of scalars, or an object array of bytes."""
            try:
                kind = GGUFValueType(item)
            except ValueError:
                raise _Bad(f"unknown metadata array item type {item} at byte {orig_offs}") from None
            head = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
            offs = orig_offs + 12
            if kind == GGUFValueType.STRING:
                mv, end, order = memoryview(self.data), len(self.data), "big" if self.byte_order == "S" else "little"
                items = []
                for _ in range(n):
                    size = int.from_bytes(mv[offs:offs + 8], order) if offs + 8 <= end else -1
                    if not 0 <= size <= MAX_STRING or offs + 8 + size > end:
                        raise _Bad(f"truncated or oversized string in a metadata array at byte {offs}")
                    items.append(bytes(mv[offs + 8:offs + 8 + size]))
                    offs += 8 + size
                values = np.empty(n, object)
                values[:] = items
            elif kind in self.gguf_scalar_to_np:
                values = self._get(offs, self.gguf_scalar_to_np[kind], n)
                offs += values.nbytes
            else:
                raise _Bad(f"metadata array of {kind.name} at byte {orig_offs}")
            return offs - orig_offs, [*head, values], [2], [GGUFValueType.ARRAY, kind]

        def _build_fields(self, offs, count):
            if int(count) > MAX_KEYS:
                raise _Bad(f"{int(count)} metadata keys")
            return super()._build_fields(offs, count)

        def _build_tensor_info(self, offs, count):
            if int(count) > MAX_TENSORS:
                raise _Bad(f"{int(count)} tensors")
            return super()._build_tensor_info(offs, count)

        def _get_tensor_info_field(self, orig_offs):
            n = int(self._get(orig_offs, np.uint64)[0])
            n_dims = int(self._get(orig_offs + 8 + n, np.uint32)[0]) if n <= MAX_STRING else 0
            if n_dims > MAX_DIMS:
                raise _Bad(f"a tensor of {n_dims} dimensions at byte {orig_offs}")
            field = super()._get_tensor_info_field(orig_offs)
            dims = [int(d) for d in field.parts[3]]
            if not all(0 <= d <= MAX_DIM for d in dims) or int(np.prod(dims, dtype=object)) > MAX_ELEMENTS:
                raise _Bad(f"tensor {field.name!r} has absurd dimensions {dims}")
            return field

    return CheckedReader


@dataclass(frozen=True)
class GGUFPart:
    """One stored tensor: its type and data as mapped from the file (float arrays, or uint8 blocks
    [rows, bytes per row] for the quantized and BF16 types), shape in numpy order (rows last-but-one)."""
    name: str
    qtype: str                  # GGMLQuantizationType name: "Q4_0", "F16", ...
    data: np.ndarray
    shape: tuple[int, ...]

    def array(self) -> np.ndarray:
        if self.qtype in ("F32", "F16"):
            return self.data
        if self.qtype == "BF16":
            return self.data.view(BF16).reshape(self.shape)
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        # as a plain array: gguf-py slices it in groups of 16 rows, and each np.memmap view costs a Python call
        return dequantize(np.asarray(self.data), GGMLQuantizationType[self.qtype])


@dataclass(frozen=True)
class GGUFTensor:
    """A canonical tensor made of stored tensors stacked by rows (a fused q|k|v stored as attn_q, attn_k,
    attn_v; a gate|up pair), or of one stored tensor."""
    parts: tuple[GGUFPart, ...]
    shape: tuple[int, ...]
    # The canonical array from the parts' arrays, where it is not their rows stacked (MLA's kv_b from the
    # converter's transposed k_b and v_b); such a tensor has no block layout of its own.
    compose: Callable[..., np.ndarray] | None = None

    @property
    def qtype(self) -> str | None:
        """The stored type of all parts, None where they differ (llama-quantize's mixes: Q4_K_M) or are composed."""
        kinds = {p.qtype for p in self.parts}
        return kinds.pop() if len(kinds) == 1 and self.compose is None else None

    @property
    def dtype(self) -> np.dtype:
        """What array() gives: the stored float type, float32 for dequantized blocks."""
        if self.qtype in ("F32", "F16", "BF16"):
            return self.parts[0].array().dtype
        return np.dtype(np.float32)

    def array(self) -> np.ndarray:
        arrays = [p.array() for p in self.parts]
        if self.compose is not None:
            return self.compose(*[np.asarray(a, np.float32) for a in arrays]).reshape(self.shape)
        if len(arrays) == 1:
            return arrays[0].reshape(self.shape)
        if len({a.dtype for a in arrays}) > 1:         # parts of different types meet in float32
            arrays = [a.astype(np.float32) for a in arrays]
        return np.concatenate(arrays, axis=0).reshape(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype=None, copy=None):
        a = self.array()
        return a if dtype is None else a.astype(dtype, copy=False)

    def __getitem__(self, rows: slice) -> "GGUFTensor":
        """Rows r0:r1 of the tensor, still stored (dequantized only when made an array): a packer streams a
        large quantized tensor chunk by chunk without ever holding all of it as floats."""
        r0, r1, step = rows.indices(self.shape[0])
        if self.compose is not None:
            return stack("", "rows", [GGUFPart(self.parts[0].name, "F32", self.array()[rows], (r1 - r0, *self.shape[1:]))])
        if step != 1:
            raise IndexError("GGUFTensor rows: only contiguous slices")
        parts, at = [], 0
        for p in self.parts:
            lo, hi = max(r0 - at, 0), min(r1 - at, p.shape[0])
            if lo < hi:
                parts.append(GGUFPart(p.name, p.qtype, p.data[lo:hi], (hi - lo, *p.shape[1:])))
            at += p.shape[0]
        if not parts:
            return GGUFTensor((GGUFPart(self.parts[0].name, "F32", np.zeros((0, *self.shape[1:]), np.float32),
                                        (0, *self.shape[1:])),), (0, *self.shape[1:]))
        return GGUFTensor(tuple(parts), (sum(p.shape[0] for p in parts), *self.shape[1:]))

    def blocks(self) -> np.ndarray:
        """The stored blocks of every part, rows stacked: uint8 [rows, bytes per row] (one type only)."""
        if self.qtype is None:
            raise CheckpointError(f"{self.parts[0].name}: parts stored as {[p.qtype for p in self.parts]}; "
                                  "no single block layout")
        return self.parts[0].data if len(self.parts) == 1 else np.concatenate([p.data for p in self.parts])


def stack(where, what: str, parts: list[GGUFPart]) -> GGUFTensor:
    """Stored tensors -> one canonical tensor of their rows in order (they must agree in every other dim)."""
    rest = {p.shape[1:] for p in parts}
    if len(rest) != 1:
        raise CheckpointError(f"{where}: {what} have mismatched shapes {[p.shape for p in parts]}; the file is corrupt")
    return GGUFTensor(tuple(parts), (sum(p.shape[0] for p in parts), *parts[0].shape[1:]))


class GGUFMetadata:
    """The file's key/value metadata with typed, checked getters (`arch.` prefixes filled in)."""

    def __init__(self, values: dict, source: str):
        self.values, self.source = values, source
        self.arch = self.get("general.architecture", str)

    def get(self, key: str, kind, default=KeyError):
        key = key.replace("{arch}", getattr(self, "arch", ""))
        if key not in self.values:
            if default is KeyError:
                raise CheckpointError(f"{self.source}: metadata key {key} is missing; the file is not a complete "
                                      "GGUF of this architecture, re-download it")
            return default
        v = self.values[key]
        ok = (isinstance(v, bool) if kind is bool else
              isinstance(v, (int, float)) and not isinstance(v, bool) if kind is float else
              isinstance(v, int) and not isinstance(v, bool) if kind is int else isinstance(v, kind))
        if not ok:
            raise CheckpointError(f"{self.source}: metadata {key} is a {type(v).__name__}, not {kind.__name__}; "
                                  "the file is corrupt, re-download it")
        return v


@dataclass
class GGUFFile:
    path: Path
    meta: dict
    parts: dict[str, GGUFPart]
    header: bytes               # the bytes before the tensor data: the file's identity


def read_gguf(path: Path) -> GGUFFile:
    """One GGUF file, every structure checked: counts, string and array lengths, dims, types, tensor
    offsets aligned, inside the file and not overlapping."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: not found or not a regular file; point --model at a .gguf file")
    try:
        reader = _reader_class()(path)
        meta = {name: _value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    except _Bad as e:
        raise CheckpointError(f"{path}: not a valid GGUF file ({e}); re-download it") from None
    except (ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError, OverflowError, MemoryError) as e:
        detail = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        if "GGMLQuantizationType" in detail:
            detail = f"a tensor of unknown type ({detail}); types that load: {', '.join(LOADABLE)}"
        raise CheckpointError(f"{path}: not a valid GGUF file ({detail}); re-download it") from None
    parts, spans = {}, []
    for t in reader.tensors:
        qtype = t.tensor_type.name
        if qtype not in LOADABLE:
            raise CheckpointError(f"{path}: tensor {t.name} is stored as {qtype}, which glmcore does not load; "
                                  f"use a file of {', '.join(LOADABLE)} (e.g. Q4_K_M or Q8_0, not IQ types)")
        rel = t.data_offset - reader.data_offset
        if rel % reader.alignment:
            raise CheckpointError(f"{path}: tensor {t.name} starts at data offset {rel}, not a multiple of the "
                                  f"file's alignment {reader.alignment}; the file is corrupt, re-download it")
        spans.append((t.data_offset, t.data_offset + t.n_bytes, t.name))
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        parts[t.name] = GGUFPart(t.name, qtype, t.data, shape)
    spans.sort()
    for a, b in zip(spans, spans[1:]):
        if b[0] < a[1]:
            raise CheckpointError(f"{path}: tensors {a[2]} and {b[2]} overlap in the file; re-download it")
    header = bytes(reader.data[:reader.data_offset])
    return GGUFFile(path, meta, parts, header)


def _value(field):
    """A metadata field as Python: str, int, float, bool, or a list of them."""
    from gguf import GGUFValueType
    kind = field.types[0] if field.types else None
    if kind == GGUFValueType.ARRAY:         # one part of all items (CheckedReader._array)
        items = field.parts[field.data[0]]
        return [b.decode("utf-8") for b in items] if field.types[1] == GGUFValueType.STRING else items.tolist()
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    value = field.parts[field.data[0]][0]
    if kind == GGUFValueType.FLOAT32:    # the decimal the converter wrote (1e-05, not 9.99999974738e-06)
        return float(str(value))
    return value.item()


def read_split(path: Path) -> list[GGUFFile]:
    """A file, or every file of the split set whose first (or any) file `path` names, in order."""
    path = Path(path)
    m = SPLIT.match(path.name)
    if not m:
        files = [read_gguf(path)]
    else:
        count = int(m["count"])
        if not 1 <= count <= 9999:
            raise CheckpointError(f"{path}: a split set of {count} files; re-download it")
        names = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
        missing = [p.name for p in names if not p.is_file()]
        if missing:
            raise CheckpointError(f"{path}: split file {missing[0]} is missing; download all {count} files of the set "
                                  "into one directory")
        files = [read_gguf(p) for p in names]
    n = len(files)
    for i, f in enumerate(files):
        no, count = f.meta.get("split.no", 0), f.meta.get("split.count", 1)
        if (no, count) != (i, n):
            raise CheckpointError(f"{f.path}: holds split part {no} of {count}, expected part {i} of {n}; the "
                                  "files are from different sets, re-download them")
    total = files[0].meta.get("split.tensors.count", sum(len(f.parts) for f in files))
    seen: dict[str, Path] = {}
    for f in files:
        for name in f.parts:
            if name in seen:
                raise CheckpointError(f"{f.path}: tensor {name} is also in {seen[name].name}; the files are from "
                                      "different sets, re-download them")
            seen[name] = f.path
    if len(seen) != total:
        raise CheckpointError(f"{files[0].path}: the set holds {len(seen)} tensors but its first file promises "
                              f"{total}; a file is from another set, re-download them")
    return files


# ---------------------------------------------------------------- the checkpoint

class GGUFWeights(Weights):
    """Canonical name -> float array (dequantized on access, f32; float types as stored and mapped), and the
    stored form of each canonical tensor for backends that run GGUF blocks themselves."""

    def __init__(self, tensors: dict[str, GGUFTensor], files: list[Path], config, identity: str):
        super().__init__(tensors, files, config)
        self.identity = identity

    def __getitem__(self, name: str) -> np.ndarray:
        return self._t[name].array()

    def stored(self, name: str) -> GGUFTensor:
        return self._t[name]

    @property
    def dtype(self) -> np.dtype:
        return self._t["embed.weight"].dtype

    def fingerprint(self) -> str:
        """The file's identity: a hash of its header (metadata and every tensor's name, type, shape, offset)."""
        return self.identity


@dataclass
class GGUFCheckpoint:
    config: ModelConfig
    weights: object             # GGUFWeights
    tokenizer_dir: Path         # tokenizer files written from the metadata
    meta: GGUFMetadata


def _identity(files: list[GGUFFile]) -> str:
    """The set's content identity, for conversion caches: every header (metadata, each tensor's name, type, shape
    and offset) and 16 rows of every tensor, as Weights.fingerprint samples a checkpoint (two fine-tunes quantized
    alike have the same header)."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.header)
        for name in sorted(f.parts):
            data = f.parts[name].data
            rows = np.unique(np.linspace(0, data.shape[0] - 1, 16).astype(np.int64)) if data.ndim and data.size else []
            h.update(np.ascontiguousarray(data[rows]).view(np.uint8).tobytes() if len(rows) else b"")
    return h.hexdigest()[:16]


def is_gguf(path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def open_gguf(path) -> GGUFCheckpoint:
    """A GGUF file (or split set) -> config, weights, and a directory of tokenizer files from its metadata."""
    from . import arch
    path = Path(path)
    files = read_split(path)
    meta = GGUFMetadata(files[0].meta, str(path))
    module = arch.for_gguf(meta.arch)
    if module is None:
        raise CheckpointError(f"{path}: GGUF architecture {meta.arch!r} is not a GLM model glmcore runs; supported: "
                              f"{', '.join(repr(a) for a in arch.gguf_architectures())}")
    # llama.cpp's converter writes a module the config turns off at zero width (the shared expert at
    # n_shared_experts 0) as transformers does: no tensor of the model, as in a checkpoint directory
    parts = {name: p for f in files for name, p in f.parts.items() if 0 not in p.shape}
    cfg = module.gguf_config(meta, {n: p.shape for n, p in parts.items()})
    tensors = module.gguf_to_canonical(cfg, parts, path)
    module.complete(cfg, tensors, path)
    check_tensors(tensors, cfg, path)
    identity = _identity(files)
    tok_dir = write_tokenizer_dir(meta, cfg, identity)
    return GGUFCheckpoint(cfg, GGUFWeights(tensors, [f.path for f in files], cfg, identity), tok_dir, meta)


# ---------------------------------------------------------------- tokenizer and chat template

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type; SentencePiece's piece types)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclass(frozen=True)
class GGUFVocab:
    model: str                  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float]
    merges: list[str]

    @classmethod
    def of(cls, meta: GGUFMetadata) -> "GGUFVocab":
        tokens = meta.get("tokenizer.ggml.tokens", list)
        types = meta.get("tokenizer.ggml.token_type", list, [NORMAL] * len(tokens))
        scores = meta.get("tokenizer.ggml.scores", list, [0.0] * len(tokens))
        merges = meta.get("tokenizer.ggml.merges", list, [])
        if not (len(types) == len(scores) == len(tokens)) or not all(isinstance(t, str) for t in tokens) \
                or not all(isinstance(t, int) for t in types) or not all(isinstance(m, str) for m in merges):
            raise CheckpointError(f"{meta.source}: tokenizer.ggml.tokens/token_type/scores/merges disagree in length "
                                  "or type; the file is corrupt, re-download it")
        return cls(meta.get("tokenizer.ggml.model", str), meta.get("tokenizer.ggml.pre", str, "default"),
                   tokens, types, scores, merges)

    def token_id(self, meta: GGUFMetadata, key: str) -> int | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id", int, None)
        if i is not None and not 0 <= i < len(self.tokens):
            raise CheckpointError(f"{meta.source}: tokenizer.ggml.{key}_token_id {i} is outside the vocabulary of "
                                  f"{len(self.tokens)} tokens; the file is corrupt, re-download it")
        return i

    def used(self) -> int:
        """Tokens up to the last one in use: llama.cpp's converters pad the vocabulary to the embedding rows
        with UNUSED [PADn] tokens, which no tokenizer of the checkpoint has."""
        n = len(self.tokens)
        while n and self.types[n - 1] == UNUSED:
            n -= 1
        return n

    def glm4_ranks(self) -> dict[bytes, int] | None:
        """GLM-4's tiktoken ranks when the vocabulary is laid out as GLM-4's (ranks = ids, then its 14
        special tokens in order), else None."""
        from .hf_tokenizer import byte_decoder
        from .vocabulary import GLM4_SPECIALS
        if self.model != "gpt2" or CONTROL not in self.types:
            return None
        n = self.types.index(CONTROL)
        if self.tokens[n:n + len(GLM4_SPECIALS)] != GLM4_SPECIALS or self.used() != n + len(GLM4_SPECIALS):
            return None
        dec = byte_decoder()
        try:
            return {bytes(dec[c] for c in t): i for i, t in enumerate(self.tokens[:n])}
        except KeyError:
            return None


def gguf_family(meta: GGUFMetadata) -> str:
    """The family (tokenizer and chat format) of a dense-GLM GGUF: from its tokenizer, never its name alone."""
    vocab = GGUFVocab.of(meta)
    if vocab.model == "llama":
        return "chatglm2" if "chatglm2" in meta.get("general.name", str, "").lower() else "chatglm3"
    if vocab.model != "gpt2":
        raise CheckpointError(f"{meta.source}: tokenizer.ggml.model {vocab.model!r} is not a GLM tokenizer (gpt2 or "
                              "llama); the file is not a GLM model")
    if meta.arch == "glm4":
        return "glm4-0414"
    return "glm4" if vocab.glm4_ranks() is not None else "glm-edge"


def write_tokenizer_dir(meta: GGUFMetadata, cfg: ModelConfig, identity: str) -> Path:
    """The tokenizer files of the family's loader, written once from the metadata into the cache:
    GLM-4's rank file, ChatGLM2/3's SentencePiece model, or tokenizer.json + tokenizer_config.json (with the
    file's chat template) + generation_config.json (its stop tokens)."""
    from .cache import build_once, cache_root
    vocab = GGUFVocab.of(meta)
    name = {"glm4": "tokenizer.model", "chatglm2": "tokenizer.model", "chatglm3": "tokenizer.model"}.get(
        cfg.family, "tokenizer.json")

    def build(tmp: Path) -> None:
        if cfg.family == "glm4":
            import base64
            ranks = vocab.glm4_ranks()
            (tmp / name).write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in ranks.items()))
        elif cfg.family in ("chatglm2", "chatglm3"):
            _write_sentencepiece(tmp / name, vocab, meta)
        else:
            _write_hf_tokenizer(tmp, vocab, meta)

    return build_once(cache_root() / "gguf" / identity, build, complete=lambda d: (d / name).is_file())


def _write_sentencepiece(path: Path, vocab: GGUFVocab, meta: GGUFMetadata) -> None:
    """ChatGLM2/3's SentencePiece model from the pieces before the special tokens (which glmcore numbers after
    them, as the checkpoint's tokenizer does): llama.cpp's converter stores pieces, scores and types."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    from .tokenizer import SP_SPECIALS
    family = "chatglm2" if "chatglm2" in meta.get("general.name", str, "").lower() else "chatglm3"
    specials = SP_SPECIALS[family]
    n = next((i for i, t in enumerate(vocab.tokens) if t in specials and vocab.types[i] != NORMAL), vocab.used())
    if vocab.tokens[n:n + len(specials)] != specials:
        raise CheckpointError(f"{meta.source}: the SentencePiece vocabulary is not followed by {family}'s special "
                              f"tokens {specials[:3]}...; the file is not a {family} GGUF")
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = BYTE in vocab.types[:n]
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", bool, True))
    m.normalizer_spec.remove_extra_whitespaces = False
    restore = {0: "<unk>", 1: "<s>", 2: "</s>"}      # the converter renames these three <unk>, <bos>, <eos>
    for i in range(n):
        p = m.pieces.add()
        p.piece = restore.get(i, vocab.tokens[i]) if vocab.types[i] in (CONTROL, UNKNOWN) else vocab.tokens[i]
        p.score = float(vocab.scores[i])
        p.type = vocab.types[i] if vocab.types[i] in (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE) else NORMAL
    path.write_bytes(m.SerializeToString())


def _write_hf_tokenizer(out: Path, vocab: GGUFVocab, meta: GGUFMetadata) -> None:
    """tokenizer.json (byte-level BPE: the vocabulary, merges and GLM-4's split pattern, merges ignored for whole
    words where llama.cpp ignores them) and tokenizer_config.json with the file's chat template."""
    from .vocabulary import GLM4_PAT
    n = vocab.used()
    special = [i for i in range(n) if vocab.types[i] in (CONTROL, USER_DEFINED)]
    added = [{"id": i, "content": vocab.tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": vocab.types[i] == CONTROL} for i in special]
    merges = [m.split(" ", 1) for m in vocab.merges]
    if any(len(m) != 2 for m in merges):
        raise CheckpointError(f"{meta.source}: tokenizer.ggml.merges holds an entry that is not 'a b'; the file is "
                              "corrupt, re-download it")
    tj = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": GLM4_PAT}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": vocab.pre in ("glm4", "glm5"),
                  "vocab": {vocab.tokens[i]: i for i in range(n) if i not in set(special)},
                  "merges": merges},
    }
    (out / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    eos, eot, eom = (vocab.token_id(meta, k) for k in ("eos", "eot", "eom"))
    pad = vocab.token_id(meta, "padding")
    if eos is None:
        raise CheckpointError(f"{meta.source}: tokenizer.ggml.eos_token_id is missing; the file is incomplete, "
                              "re-download it")
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": vocab.tokens[eos],
           "pad_token": vocab.tokens[eos if pad is None else pad], "clean_up_tokenization_spaces": False}
    template = meta.get("tokenizer.chat_template", str, None)
    if template is not None:
        cfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False), encoding="utf-8")
    stops = list(dict.fromkeys(i for i in (eos, eot, eom) if i is not None))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}), encoding="utf-8")
