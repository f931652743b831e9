"""The host side of the BM1684X deployment: one Session logic over the static graphs, driven either
by onnxruntime on this machine (host emulation, the exact exported ONNX parts) or by the Sophon
runtime on a BM1684X (the combined bmodel compiled from those parts).

KV layout (as in the Sophgo chat.cpp): each layer's cache is a fixed [1, S, kv_heads, head_dim]
buffer whose valid entries sit at the TAIL. Prefill runs the block_N graphs over the prompt padded
to S, then moves its T valid K/V rows to slots S-T..S-1 (zeros before them). Each decode step runs
block_cache_N, which appends the new K/V at slot S and drops slot 0, so the valid rows stay at the
tail and grow by one towards the head; the mask hides the slots before them. Capacity is exactly S.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from glmcore.backend import Session
from glmcore.config import ModelConfig
from glmcore.errors import BackendError

from .spec import MASK_VALUE, io_names


class StaticGraphSession(Session):
    def __init__(self, runner, cfg: ModelConfig, seq_len: int, _users: list[int] | None = None):
        self.runner, self.cfg = runner, cfg
        self._users = _users or [1]     # sessions sharing the runner (fork); the last one closes it
        self.S = self.capacity = seq_len
        self.dtype = np.dtype(runner.float_dtype)
        shape = (1, seq_len, cfg.num_kv_heads, cfg.head_dim)
        self.k = [np.zeros(shape, self.dtype) for _ in range(cfg.num_layers)]
        self.v = [np.zeros(shape, self.dtype) for _ in range(cfg.num_layers)]
        self._len = 0

    @property
    def kv_len(self) -> int:
        return self._len

    def reset(self) -> None:
        self._len = 0        # stale rows are masked out and overwritten by the next prefill

    def fork(self) -> "StaticGraphSession":
        """Another sequence on the same loaded parts: the runner holds no per-sequence state (the KV
        cache is this session's numpy arrays), so the core's SessionAdapter does not open every part
        (or load the bmodel onto the device) once per slot."""
        self._users[0] += 1
        return StaticGraphSession(self.runner, self.cfg, self.S, self._users)

    def close(self) -> None:
        if self.k or self.v:            # once per session
            self._users[0] -= 1
            if self._users[0] == 0:
                self.runner.close()
        self.k = self.v = []

    # ------------------------------------------------------------ the contract

    def prefill(self, ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        ids = self._check(ids)
        if self._len == 0:
            hidden = self._prefill_blocks(ids)
            # The device has one lm_head graph for one position; every position's logits (asked for
            # by conformance only) run it once per position, as the device would have to.
            rows = range(len(ids)) if all_logits else [len(ids) - 1]
            logits = np.stack([self._lm_head(hidden[0, t]) for t in rows])
        else:
            # A continuation (next chat turn): the device has no graph for "T new tokens against a
            # non-empty cache", so the ids go one by one through block_cache, exactly as it would.
            logits = []
            for t, token in enumerate(ids):
                h = self._step(token)
                if all_logits or t == len(ids) - 1:
                    logits.append(self._lm_head(h))
            logits = np.stack(logits)
        return logits if all_logits else logits[-1]

    def decode(self, token: int) -> np.ndarray:
        (token,) = self._check([token])
        return self._lm_head(self._step(token))

    def decode_top1(self, token: int) -> int:
        """The device's greedy fast path: append one token and return the next token id that the
        weightless greedy_head graph picks from lm_head's logits on the device (on the TPU no [vocab]
        logits leave it). Not part of the core contract."""
        (token,) = self._check([token])
        return self.runner.top1(self._step(token).reshape(1, -1))

    # ------------------------------------------------------------ graphs

    def _check(self, ids) -> list[int]:
        ids = [int(t) for t in ids]
        if not ids:
            raise BackendError("prefill needs at least one token id")
        if self._len + len(ids) > self.S:
            raise BackendError(f"{self._len}+{len(ids)} tokens exceed the static context SEQ_LEN={self.S} of this "
                               "export; re-export with a larger --opt seq_len (the core's overflow policy should "
                               "have prevented this)")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise BackendError(f"token id {bad[0]} is outside the vocabulary (0..{self.cfg.vocab_size - 1})")
        return ids

    def _prefill_blocks(self, ids: list[int]) -> np.ndarray:
        S, T = self.S, len(ids)
        input_ids = np.zeros((1, S), np.int32)
        input_ids[0, :T] = ids
        position_ids = np.zeros((1, S), np.int32)      # padding rows reuse position 0; they are masked
        position_ids[0, :T] = np.arange(T)
        h = self.runner.run("embedding", {"input_ids": input_ids})[0]
        mask = prefill_mask(S, T).astype(self.dtype)
        for i in range(self.cfg.num_layers):
            h, k, v = self.runner.run(f"block_{i}", {"input_states": h, "position_ids": position_ids,
                                                    "attention_mask": mask})
            # move the T valid rows to the tail of the buffer (chat.cpp's move2end)
            self.k[i][:, :S - T] = 0
            self.v[i][:, :S - T] = 0
            self.k[i][:, S - T:] = k[:, :T]
            self.v[i][:, S - T:] = v[:, :T]
        self._len = T
        return h

    def _step(self, token: int) -> np.ndarray:
        n = self._len                                    # tokens already cached = the new token's position
        h = self.runner.run("embedding_cache", {"input_ids": np.array([[token]], np.int32)})[0]
        position_ids = np.array([[n]], np.int32)
        mask = decode_mask(self.S, n).astype(self.dtype)
        for i in range(self.cfg.num_layers):
            h, self.k[i], self.v[i] = self.runner.run(f"block_cache_{i}", {
                "input_states": h, "position_ids": position_ids, "attention_mask": mask,
                "history_k": self.k[i], "history_v": self.v[i]})
        self._len = n + 1
        return h[0]                                      # [1, H]

    def _lm_head(self, hidden: np.ndarray) -> np.ndarray:
        return self.runner.run("lm_head", {"hidden_states": hidden.reshape(1, -1)})[0][0].astype(np.float32)


def prefill_mask(S: int, T: int) -> np.ndarray:
    """[1, 1, S, S]: row i < T sees columns 0..i; padding rows (i >= T) see nothing useful."""
    i = np.arange(S)[:, None]
    j = np.arange(S)[None, :]
    visible = (j <= i) & (i < T)
    return np.where(visible, 0.0, MASK_VALUE).astype(np.float32).reshape(1, 1, S, S)


def decode_mask(S: int, n: int) -> np.ndarray:
    """[1, 1, 1, S+1] for one new token with n cached rows at the tail (slots S-n..S-1) and itself at S."""
    m = np.full(S + 1, MASK_VALUE, np.float32)
    m[S - n:] = 0.0
    return m.reshape(1, 1, 1, S + 1)


# ---------------------------------------------------------------- runners

class OrtRunner:
    """Host emulation: onnxruntime runs the exact exported parts."""

    kind = "host"

    def __init__(self, parts_dir, manifest: dict, threads: int | None = None):
        import onnxruntime as ort
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        # No busy-waiting between the many small runs: spinning threads starve whatever else runs on
        # the host (the torch reference during conformance, other processes) for little gain here.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.float_dtype = {"f32": np.float32, "f16": np.float16}[manifest["key"]["dtype"]]
        # Every part opens now, so a broken part fails at load.
        self.sessions = {p["name"]: ort.InferenceSession(str(parts_dir / f"{p['name']}.onnx"), opts,
                                                         providers=["CPUExecutionProvider"])
                         for p in manifest["parts"]}

    def run(self, name: str, feeds: dict) -> list[np.ndarray]:
        return self.sessions[name].run(None, feeds)

    def top1(self, hidden: np.ndarray) -> int:
        logits = self.run("lm_head", {"hidden_states": hidden})[0]
        return int(self.run("greedy_head", {"m_logits": logits})[0].reshape(-1)[0])

    def close(self) -> None:
        self.sessions = {}


class SailRunner:
    """On a BM1684X: the Sophon runtime (sophon.sail) runs the combined bmodel's graphs, the way
    sophon-demo's ChatGLM3 client drives it (sample/ChatGLM3/python/chatglm3.py): a DEVIO Engine, one
    sail.Tensor per graph input and output in device memory, `process(graph, inputs, outputs)` with
    tensor maps, `update_data` in and `asnumpy()` out.

    Not the numpy overload `process(graph, {name: ndarray})`: sail binds it as a map of
    array_t<float> (src/bind.cpp), so every array is converted to float32, F16/BF16 inputs make
    Engine::process throw "not supported" and 16-bit outputs are read with float strides
    (src/engine.cpp) -- and --quant_input/--quant_output make every part's I/O 16-bit except token
    ids and logits. pybind11 has no float16/bfloat16, so 16-bit data crosses as uint16 views
    (update_data's uint16 overload; asnumpy returns uint16 for F16/BF16 tensors).

    The KV cache round-trips through host memory once per layer and step (the session keeps it as
    numpy), which is simple and correct but slower than chat.cpp's device-to-device copies. The runtime's
    shared-memory mode (sail.EngineLLM with BM_RUNTIME_SHARE_MEM, which LLM-TPU's chat.cpp sets through
    bmrt_set_flags) is not used: sail builds EngineLLM only against a libsophon whose bmdef.h has
    addr_mode (build_unix.cmake: BUILD_ENGINELLM) and the flag only with bm_runtime_flag_t
    (SAIL_WITH_BMRT_FLAG), and its index-keyed tensors want block_cache compiled with --addr_mode io_alone;
    without shared memory each graph keeps its own activation buffers, which fits a BM1684X at the
    supported SEQ_LEN (the whole bmodel loads or the Engine raises at load)."""

    kind = "device"

    def __init__(self, bmodel: str, device_id: int = 0):
        import sophon.sail as sail
        self.sail = sail
        self.handle = sail.Handle(device_id)
        self.engine = sail.Engine(str(bmodel), device_id, sail.IOMode.DEVIO)
        self.graphs = set(self.engine.get_graph_names())
        missing = [g for g in ("embedding", "embedding_cache", "block_0", "block_cache_0", "lm_head", "greedy_head")
                   if g not in self.graphs]
        if missing:
            raise BackendError(f"{bmodel}: no graph {missing[0]!r}; it was not compiled by glmcore convert "
                               "--backend tpu_bm1684x's compile.sh (of this glmcore version)")
        import ml_dtypes
        self.np_dtype = {sail.Dtype.BM_FLOAT32: np.dtype(np.float32), sail.Dtype.BM_FLOAT16: np.dtype(np.float16),
                         sail.Dtype.BM_BFLOAT16: np.dtype(ml_dtypes.bfloat16), sail.Dtype.BM_INT32: np.dtype(np.int32)}
        # Tensors are addressed by position: part_specs' order is the graph's order, and the names are
        # TPU-MLIR's (a TorchScript part's are the traced graph's debugName()s, e.g. "x.1").
        self.names: dict[str, tuple[list, list]] = {}
        for g in self.graphs:
            ins, outs = list(self.engine.get_input_names(g)), list(self.engine.get_output_names(g))
            want = io_names(g)
            if (len(ins), len(outs)) != (len(want[0]), len(want[1])):
                raise BackendError(f"{bmodel}: graph {g!r} has {len(ins)} inputs and {len(outs)} outputs, glmcore's "
                                   f"has {len(want[0])} and {len(want[1])}; recompile it with this glmcore's compile.sh")
            self.names[g] = ins, outs
        self.float_dtype = self._dtype(self.engine.get_input_dtype("block_cache_0", self.names["block_cache_0"][0][3]))
        self._io: dict[str, tuple[dict, dict]] = {}

    def _dtype(self, sail_dtype) -> np.dtype:
        if sail_dtype not in self.np_dtype:
            raise BackendError(f"the bmodel has a {sail_dtype} tensor; glmcore's parts use F32, F16, BF16 and INT32")
        return self.np_dtype[sail_dtype]

    def _tensors(self, graph: str) -> tuple[dict, dict]:
        """The graph's input and output tensors in device memory, made on first use, then reused."""
        if graph not in self._io:
            e, sail = self.engine, self.sail

            def make(names, shape, dtype):
                return {n: sail.Tensor(self.handle, list(shape(graph, n)), dtype(graph, n), False, True) for n in names}
            self._io[graph] = (make(e.get_input_names(graph), e.get_input_shape, e.get_input_dtype),
                               make(e.get_output_names(graph), e.get_output_shape, e.get_output_dtype))
        return self._io[graph]

    def _process(self, graph: str, feeds: dict) -> list:
        """feeds: glmcore's input names (part_specs) -> arrays, or device tensors of a previous graph.
        Returns the output tensors in graph order."""
        inputs, outputs = self._tensors(graph)
        inputs = dict(inputs)
        theirs, order = self.names[graph], io_names(graph)[0]
        for k, v in feeds.items():
            name = theirs[0][order.index(k)]
            if isinstance(v, self.sail.Tensor):      # a previous graph's output, still on the device
                inputs[name] = v
                continue
            a = np.ascontiguousarray(v, dtype=self._dtype(self.engine.get_input_dtype(graph, name)))
            inputs[name].update_data(a.view(np.uint16) if a.dtype.itemsize == 2 else a)
        self.engine.process(graph, inputs, outputs)
        return [outputs[n] for n in theirs[1]]

    def _read(self, graph: str, i: int, tensor) -> np.ndarray:
        return tensor.asnumpy().view(self._dtype(self.engine.get_output_dtype(graph, self.names[graph][1][i])))

    def seq_len(self) -> int:
        """SEQ_LEN from the embedding graph's first input [1, SEQ_LEN] (LLM-TPU's chat.cpp reads it so)."""
        return int(self.engine.get_input_shape("embedding", self.names["embedding"][0][0])[1])

    def num_layers(self) -> int:
        return sum(1 for g in self.graphs if g.startswith("block_cache_"))

    def run(self, name: str, feeds: dict) -> list[np.ndarray]:
        return [self._read(name, i, t) for i, t in enumerate(self._process(name, feeds))]

    def top1(self, hidden: np.ndarray) -> int:
        (logits,) = self._process("lm_head", {"hidden_states": hidden})
        (token,) = self._process("greedy_head", {"m_logits": logits})
        return int(self._read("greedy_head", 0, token).reshape(-1)[0])

    def close(self) -> None:
        self.engine = None
        self._io = {}
