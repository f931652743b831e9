"""A Session running the GLM graph model with a static KV cache, in graph or eager mode.

Graph mode compiles the step (torch.compile fullgraph=True, dynamic=False): with the torchair NPU
backend (frozen parameters) on an Ascend NPU, with inductor elsewhere. Shapes are static so the
compile happens once per shape, not per step:
  - decode is a 1-token step; its position is a tensor input, its mask is computed from it over the
    whole preallocated cache;
  - prefill pads each chunk of the prompt to one of a few bucket lengths (default 16, 64, 256; longer
    prompts go in 256-token chunks), so a session compiles at most len(buckets) + 1 graphs.
Padded rows write their K/V at slots after the real tokens, which no real query can see (causal
mask) and the next real tokens overwrite; the cache has `max(buckets)` spare slots past the
capacity so padding never writes out of bounds.

The decode graph is compiled at load; each prefill bucket on its first use. Eager mode runs the same
module, uncompiled, with exact lengths (no padding).
"""
from __future__ import annotations

import time
import types
from collections.abc import Sequence

import numpy as np
import torch

from glmcore.backend import Capabilities, LoadOptions, Session, default_capacity
from glmcore.config import ModelConfig
from glmcore.errors import BackendError

from .model import GLMGraphModel
from .ops import select_ops

DEFAULT_BUCKETS = (16, 64, 256)
MODES = ("graph", "eager")
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}

# Compiles seen by this process's counting backends (tests and benchmarks read it).
COMPILE_COUNT = {"graphs": 0}


def _counting(inner):
    def backend(gm, example_inputs):
        COMPILE_COUNT["graphs"] += 1
        return inner(gm, example_inputs)
    return backend


_INDUCTOR = None


def _inductor_backend():
    # One backend object for the process: dynamo reuses a graph across sessions of the same shapes
    # and dtypes (weights and caches are graph inputs under inductor, so sharing is safe).
    global _INDUCTOR
    if _INDUCTOR is None:
        from torch._inductor.compile_fx import compile_fx
        _INDUCTOR = _counting(compile_fx)
    return _INDUCTOR


def _private_copy(method):
    """The same bound method over a private copy of its code object. Dynamo keeps compiled graphs on
    the code object; torchair's frozen_parameter bakes this session's weight addresses into its
    graph, so no other session may reuse it."""
    f = method.__func__
    g = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    return types.MethodType(g, method.__self__)


def parse_buckets(value) -> tuple[int, ...]:
    if value is None:
        return DEFAULT_BUCKETS
    try:
        items = value.split(",") if isinstance(value, str) else list(value)
        buckets = tuple(sorted({int(b) for b in items}))
    except (TypeError, ValueError):
        buckets = ()
    if not buckets or buckets[0] < 1:
        raise BackendError(f"ascend_npu: buckets={value!r} is not a list of positive lengths; "
                           "pass e.g. --opt buckets=16,64,256")
    return buckets


class AscendSession(Session):
    def __init__(self, cfg: ModelConfig, weights, options: LoadOptions, caps: Capabilities, device: torch.device):
        extra = options.extra
        self.mode = str(extra.get("mode", "graph")).lower()
        if self.mode not in MODES:
            raise BackendError(f"ascend_npu: mode {self.mode!r} is unknown; pass --opt mode=graph or mode=eager")
        if options.threads:
            torch.set_num_threads(options.threads)
        self.cfg, self.device = cfg, device
        self.precision = options.precision or caps.default_precision
        self.dtype = DTYPES[self.precision]
        self.capacity = default_capacity(cfg, caps, options.capacity)
        self.buckets = parse_buckets(extra.get("buckets"))
        # Spare slots past the capacity take the padded rows of the last bucket (graph mode only).
        spare = self.buckets[-1] if self.mode == "graph" else 0
        self.slots = self.capacity + spare
        self.ops = select_ops(device, self.dtype)
        self.model = GLMGraphModel(cfg, weights, device, self.dtype, self.ops, self.slots).eval()
        # Static KV cache, BNSD per layer: [1, kv_heads, slots, head_dim] (see ops.py for why).
        shape = (1, cfg.num_kv_heads, self.slots, cfg.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(cfg.num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(cfg.num_layers)]
        # Preallocated step inputs, refilled in place: decode creates no tensors of its own.
        self._tok = torch.zeros(1, dtype=torch.long, device=device)
        self._start = torch.zeros(1, dtype=torch.long, device=device)
        self._zero = torch.zeros(1, dtype=torch.long, device=device)
        self._len = 0
        self.compiler = "none (eager)"
        self.compiles = 0                   # graphs compiled by this session's calls
        self.compile_seconds = 0.0          # wall time of those calls (compile + first run)
        self._step = self.model.forward
        if self.mode == "graph":
            self._step = self._compile()
            # Compile the decode graph now, so the first generated tokens run at steady speed and the
            # compile shows as load time. It writes slot 0, which the first real token overwrites.
            self._call(self._tok, self._start, self._zero)

    # ------------------------------------------------------------ compile

    def _compile(self):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        if self.device.type == "npu":
            try:
                import torchair
                from torchair.configs.compiler_config import CompilerConfig
            except ImportError as e:
                raise BackendError(f"ascend_npu: graph mode on the NPU needs torchair ({e}); install the "
                                   "torchair matching your torch_npu, or pass --opt mode=eager") from None
            config = CompilerConfig()
            config.experimental_config.frozen_parameter = True   # weight addresses fixed for the session
            backend = _counting(torchair.get_npu_backend(compiler_config=config))
            self.compiler = "torchair npu backend (frozen_parameter=True)"
            return torch.compile(_private_copy(self.model.forward), backend=backend, fullgraph=True, dynamic=False)
        self.compiler = "inductor"
        return torch.compile(self.model.forward, backend=_inductor_backend(), fullgraph=True, dynamic=False)

    def report(self) -> dict:
        """What this session runs: device, dtype, mode, compiler and kernels (chosen once, at load)."""
        return {"device": str(self.device), "precision": self.precision, "mode": self.mode,
                "compiler": self.compiler, "kernels": self.ops.kernels, "capacity": self.capacity,
                "prefill buckets": list(self.buckets) if self.mode == "graph" else "exact lengths"}

    # ------------------------------------------------------------ Session contract

    @property
    def kv_len(self) -> int:
        return self._len

    def reset(self) -> None:
        self._len = 0     # stale slots are masked out (a query sees only slots <= its position)

    def close(self) -> None:
        self.k_cache, self.v_cache, self.model, self._step = [], [], None, None

    def prefill(self, ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        ids = [int(i) for i in ids]
        if not ids:
            raise BackendError("prefill needs at least one token id")
        self._check_room(len(ids))
        chunk = self.buckets[-1] if self.mode == "graph" else len(ids)
        rows, last = [], None
        for i in range(0, len(ids), chunk):
            part = ids[i:i + chunk]
            last, hidden = self._run(part)
            if all_logits:
                with torch.inference_mode():
                    rows.append(self.model.logits(hidden[:len(part)]).cpu())
        if all_logits:
            return torch.cat(rows).numpy()
        return last[0].cpu().numpy()

    def decode(self, token: int) -> np.ndarray:
        self._check_room(1)
        self._tok.fill_(int(token))
        self._start.fill_(self._len)
        logits, _ = self._call(self._tok, self._start, self._zero)
        self._len += 1
        return logits[0].cpu().numpy()

    # ------------------------------------------------------------ internals

    def _check_room(self, n: int) -> None:
        if self._len + n > self.capacity:
            raise BackendError(f"KV cache overflow: {self._len}+{n} > capacity {self.capacity} "
                               "(the core's overflow policy should have prevented this)")

    def _bucket(self, n: int) -> int:
        if self.mode == "eager":
            return n
        return next(b for b in self.buckets if b >= n)

    def _run(self, part: list[int]):
        n = len(part)
        size = self._bucket(n)
        ids = torch.zeros(size, dtype=torch.long)
        ids[:n] = torch.tensor(part, dtype=torch.long)
        self._start.fill_(self._len)
        last = torch.tensor([n - 1], dtype=torch.long, device=self.device)
        out = self._call(ids.to(self.device), self._start, last)
        self._len += n
        return out

    def _call(self, ids, start, last):
        # A call that compiled (new shape) is timed and counted apart from the steady-state steps.
        before = COMPILE_COUNT["graphs"]
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self._step(ids, start, last, self.k_cache, self.v_cache)
        if COMPILE_COUNT["graphs"] != before:
            self.compiles += COMPILE_COUNT["graphs"] - before
            self.compile_seconds += time.perf_counter() - t0
        return out
