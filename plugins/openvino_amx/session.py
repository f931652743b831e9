"""The IR conversion cache and the Session that runs the stateful model on OpenVINO's CPU plugin."""
from __future__ import annotations

import copy
import ctypes
import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import openvino as ov

from glmcore.backend import LoadOptions, Session
from glmcore.cache import build_once
from glmcore.config import ModelConfig
from glmcore.errors import BackendError

from . import graph

GRAPH_VERSION = 6          # bump when build_model's output changes: old cache entries are then not reused
IR_NAME = "openvino_model.xml"          # the name openvino_genai.LLMPipeline looks for
MANIFEST = "glmcore_openvino.json"
KV_PRECISIONS = ("f32", "f16", "bf16", "u8")
DEFAULT_DYNAMIC_QUANT = 32      # activation group with bf16 compute (int8 weights; int4: their group)
# Tokens per inference of a prefill (--opt prefill_chunk, like llama.cpp's --ubatch-size). The CPU plugin
# keeps each dynamic-shape node's output buffer at the largest size it has run, so scratch grows with the
# longest call: measured on the 1b int4 IR (777 MiB), resident memory after a 128-token prefill 993 MiB in
# one call, 926 in chunks of 64, 893 in chunks of 32; prefill tok/s 176 / 160 / 150 (same process, 2 threads).
PREFILL_CHUNK = 64


# ---------------------------------------------------------------- options

def ir_options(options: LoadOptions) -> dict:
    """The options that change the IR itself (precision and KV format are compile-time choices)."""
    out = {"weights": options.weights}
    if options.weights == "int4":
        group = options.extra.get("group_size", 128)
        if not isinstance(group, int) or group < 16 or group & (group - 1):
            raise BackendError(f"invalid group_size {group!r}: use a power of two >= 16, e.g. --opt group_size=128")
        out["group_size"] = group
    return out


def default_dynamic_quant(options: LoadOptions) -> int:
    """The activation group of dynamic quantization with bf16 compute: int4 weights take their own group (128
    unless set), int8 ones 32. At int4's group each group's int8 dot product meets one scale per operand: on
    the 1b, AVX-512 VNNI without AMX, 2 threads, group 128 against 32 decoded 1.05x and prefilled 1.36x, with
    the held-out poems' KL and top-1 agreement unchanged within the int4 weights' own error (KL mean 0.0132 vs
    0.0130, top-1 90.7% vs 90.5%). int8 keeps 32: there 128 gained 1.04x decode / 1.28x prefill but raised
    KL mean 0.00034 -> 0.00055 and p99 0.0029 -> 0.0054 (llama.cpp's Q8_0: 0.00026 / 0.0022)."""
    if options.weights == "int4":
        return ir_options(options)["group_size"]
    return DEFAULT_DYNAMIC_QUANT


def compile_config(options: LoadOptions) -> dict:
    """Every precision-relevant plugin setting explicitly: nothing is left to the plugin's defaults (u8 KV cache,
    its dynamic-quantization group)."""
    extra = options.extra
    kv = extra.get("kv_cache", "f32" if options.precision == "f32" else "f16")
    if kv not in KV_PRECISIONS:
        raise BackendError(f"invalid kv_cache {kv!r}; choose one of {', '.join(KV_PRECISIONS)} (--opt kv_cache=f16)")
    # Dynamic quantization (activations to int8 per group, int8 dot products on VNNI) is on by default with
    # bf16 compute only: it cut the CPU time of a decode step by 26-35% (issue 15) and stays inside the bf16
    # conformance row; f32 compute stays exact.
    dq = extra.get("dynamic_quant", 0 if options.precision == "f32" else default_dynamic_quant(options))
    if not isinstance(dq, int) or dq < 0:
        raise BackendError(f"invalid dynamic_quant {dq!r}: 0 (off) or an activation group size, e.g. 32")
    config = {
        "INFERENCE_PRECISION_HINT": options.precision,
        "EXECUTION_MODE_HINT": "PERFORMANCE",
        "PERFORMANCE_HINT": "LATENCY",
        "NUM_STREAMS": "1",
        "KV_CACHE_PRECISION": kv,
        "KEY_CACHE_PRECISION": kv,
        "VALUE_CACHE_PRECISION": kv,
        "DYNAMIC_QUANTIZATION_GROUP_SIZE": str(dq),
    }
    if options.threads:
        config["INFERENCE_NUM_THREADS"] = str(options.threads)
    return config


# ---------------------------------------------------------------- IR on disk

def cache_key(cfg: ModelConfig, weights, opts: dict) -> str:
    blob = json.dumps({"model": weights.fingerprint(), "config": cfg.to_dict(), "ir": opts,
                       "graph": GRAPH_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def write_ir(cfg: ModelConfig, weights, opts: dict, out: Path, progress: Callable[[str], None]) -> Path:
    """Build the model and write the IR directory: openvino_model.xml/.bin, generation_config.json (for
    openvino_genai) and a manifest of what it was built from."""
    t0 = time.perf_counter()
    progress(f"building the OpenVINO graph ({cfg.num_layers} layers, weights {opts['weights']})")
    model = graph.build_model(cfg, weights, opts["weights"], opts.get("group_size", 128),
                              lambda msg: progress(f"  {msg}"))
    progress(f"writing {IR_NAME} and its weights")
    out.mkdir(parents=True, exist_ok=True)
    # compress_to_fp16=False: the weights are exactly in the format the options asked for
    ov.save_model(model, out / IR_NAME, compress_to_fp16=False)
    del model
    (out / "generation_config.json").write_text(json.dumps(_generation_config(weights), indent=2) + "\n")
    manifest = {"glmcore_graph": GRAPH_VERSION, "openvino": ov.get_version(), "source": weights.fingerprint(),
                "config": cfg.to_dict(), **opts}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    progress(f"done: {size:.1f} MiB in {time.perf_counter() - t0:.1f} s")
    return out / IR_NAME


def _generation_config(weights) -> dict:
    """eos/pad ids from the checkpoint's config.json, so LLMPipeline has stop ids without a tokenizer."""
    out: dict = {}
    files = getattr(weights, "files", [])
    src = Path(files[0]).parent / "config.json" if files else None
    if src is not None and src.is_file():
        raw = json.loads(src.read_text())
        for key in ("eos_token_id", "pad_token_id"):
            if raw.get(key) is not None:
                out[key] = raw[key]
    return out


def cached_ir(cfg: ModelConfig, weights, options: LoadOptions, progress: Callable[[str], None]) -> Path:
    """The IR for this model + options from options.cache_dir, converting once on the first use."""
    opts = ir_options(options)
    root = Path(options.cache_dir) / "openvino_amx"
    final = root / f"{cfg.family}-{opts['weights']}-{cache_key(cfg, weights, opts)}"
    if not (final / MANIFEST).is_file():
        progress(f"converting the model once; the IR is kept in {final}")
    build_once(final, lambda tmp: write_ir(cfg, weights, opts, tmp, progress),
               complete=lambda p: (p / MANIFEST).is_file())
    return final / IR_NAME


def checked_ir(path: Path, cfg: ModelConfig, options: LoadOptions) -> Path:
    """The .xml of an IR written by `glmcore convert` (--opt ir=DIR), checked against the model and the options
    (its weight format and int4 group: what the run derives from them -- bytes per token, the activations'
    quantization group, a NextN drafter's weights -- must be the IR's)."""
    weights_format = options.weights
    path = Path(path)
    d = path if path.is_dir() else path.parent
    manifest = d / MANIFEST
    if not manifest.is_file() or not (d / IR_NAME).is_file():
        raise BackendError(f"{d}: not an IR directory written by `glmcore convert --backend openvino_amx` "
                           f"(no {MANIFEST} or {IR_NAME}); convert the model first")
    try:
        m = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise BackendError(f"{manifest}: unreadable ({type(e).__name__}); convert the model again") from None
    if not isinstance(m, dict):
        raise BackendError(f"{manifest}: not a glmcore IR manifest (a JSON object); convert the model again")
    if m.get("config") != cfg.to_dict():
        raise BackendError(f"{d}: the IR was converted from another model; convert this --model again")
    if m.get("weights") != weights_format:
        raise BackendError(f"{d}: the IR has weights {m.get('weights')}, not {weights_format}; "
                           f"pass --weights {m.get('weights')} or convert again")
    group = ir_options(options).get("group_size")
    if m.get("group_size") != group:
        raise BackendError(f"{d}: the IR's int4 group is {m.get('group_size')}, not {group}; "
                           f"pass --opt group_size={m.get('group_size')} or convert again")
    if m.get("glmcore_graph") != GRAPH_VERSION:
        raise BackendError(f"{d}: the IR is from an older glmcore graph version; convert again")
    return d / IR_NAME


# ---------------------------------------------------------------- the session

def release_mapped_file(path: Path) -> int:
    """Drop this process's resident pages of the read-only mappings of `path` (Linux; elsewhere a no-op) and
    return how many bytes were mapped. read_model maps the IR's .bin; the CPU plugin packs its own copy of
    every matmul weight on the first inference and afterwards reads from the mapping only the embedding rows
    it gathers, so without this the weights stay resident twice. Dropped pages of a read-only file mapping
    are read back from the file if touched again: nothing can be lost."""
    if not sys.platform.startswith("linux"):
        return 0
    target = str(Path(path).resolve())
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    released = 0
    for line in maps:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target and "w" not in fields[1]:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if madvise(start, end - start, 4) == 0:      # MADV_DONTNEED
                released += end - start
    return released


def prefill_chunk(options: LoadOptions) -> int:
    n = options.extra.get("prefill_chunk", PREFILL_CHUNK)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise BackendError(f"invalid prefill_chunk {n!r}: tokens per inference of a prefill, a positive number "
                           "(e.g. --opt prefill_chunk=64)")
    return n


class OpenVINOSession(Session):
    """One sequence in the stateful model's variables. prefill appends to whatever the state holds (a chat
    continuation prefills only the new turn); reset() empties the state (reset_state). fork() gives another
    sequence on the same compiled model: its own infer request (own state), the same packed weights."""

    def __init__(self, cfg: ModelConfig, model: ov.Model, options: LoadOptions, capacity: int,
                 weights_file: Path | None = None):
        self.cfg = cfg
        self.capacity = capacity
        self.config = compile_config(options)
        self.prefill_chunk = prefill_chunk(options)      # checked before the compilation it would waste
        core = ov.Core()
        self.compiled = core.compile_model(graph.add_logits_start(model), "CPU", self.config)
        del model
        self.requested_precision = options.precision
        # What the plugin really runs: a bf16 hint runs as f32 on a CPU without AVX512-BF16/AMX.
        self.runtime_precision = str(self.compiled.get_property("INFERENCE_PRECISION_HINT").to_string())
        self.kv_cache_precision = self.config["KV_CACHE_PRECISION"]
        self._beam = np.zeros(1, dtype=np.int32)
        self._mask = np.ones((1, capacity), dtype=np.int64)      # read-only: shared with forks
        self._new_request()
        if weights_file is not None:
            # one token through the model makes the plugin pack its weights; then the mapped file can go
            self.decode(0)
            self.reset()
            release_mapped_file(weights_file)

    def _new_request(self) -> None:
        self.request = self.compiled.create_infer_request()
        self._len = 0
        self._inputs: dict = {}

    def fork(self) -> "OpenVINOSession":
        twin = copy.copy(self)       # shares the compiled model (and its packed weights)
        twin._new_request()
        return twin

    @property
    def kv_len(self) -> int:
        return self._len

    def prefill(self, ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        if ids.shape[1] == 0:
            raise BackendError("prefill needs at least one token")
        self._check(ids)           # all of it before the first chunk runs: a refused prefill changes nothing
        n = self.prefill_chunk
        chunks = [ids[:, i:i + n] for i in range(0, ids.shape[1], n)]
        out = [self._run(c, 0 if all_logits else c.shape[1] - 1) for c in chunks]
        return np.concatenate(out) if all_logits else out[-1][-1]

    def decode(self, token: int) -> np.ndarray:
        return self._run(np.array([[token]], dtype=np.int64), 0)[-1]

    def _check(self, ids: np.ndarray) -> None:
        if self._len + ids.shape[1] > self.capacity:
            raise BackendError(f"KV cache overflow: {self._len}+{ids.shape[1]} > {self.capacity} "
                               "(the core's overflow policy should have prevented this)")
        if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
            raise BackendError(f"token id out of range 0..{self.cfg.vocab_size - 1}")

    def _run(self, ids: np.ndarray, logits_start: int) -> np.ndarray:
        self._check(ids)
        start, end = self._len, self._len + ids.shape[1]
        # Kept on self: the request reads these arrays in place (shared memory) until the next call.
        self._inputs = {
            "input_ids": ids,
            "attention_mask": self._mask[:, :end],
            "position_ids": np.arange(start, end, dtype=np.int64).reshape(1, -1),
            "beam_idx": self._beam,
            "logits_start": np.array([logits_start], dtype=np.int64),
        }
        for name, value in self._inputs.items():
            self.request.set_tensor(name, ov.Tensor(value, shared_memory=True))
        # start_async + wait, not infer(): measured ~0.3 ms a step against ~1 ms for the synchronous call from
        # Python on the same compiled model (the time openvino_genai's C++ loop takes per step).
        self.request.start_async()
        self.request.wait()
        self._len = end
        return np.array(self.request.get_tensor("logits").data[0], dtype=np.float32)   # a copy: the next call reuses it

    def reset(self) -> None:
        self.request.reset_state()
        self._len = 0

    def close(self) -> None:
        self.request = None
        self.compiled = None

