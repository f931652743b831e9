"""Sessions running the GLM graph model over a static KV cache, in graph or eager mode: a single
sequence (AscendSession, the core's Session) and a native batch of sequences (AscendBatchSession,
contract v2). Both drive one StepRunner: the model, the cache of `n_slots` slots and the step.

Graph mode compiles the step with static shapes, so the compile happens once per shape, not per step:
  - decode is a step of one token per row; positions are tensor inputs, the mask is computed from them
    over each slot's whole preallocated cache;
  - prefill pads each chunk of a prompt to one of a few bucket lengths (default 16, 64, 256; longer
    prompts go in 256-token chunks);
  - a batch decodes its rows in one step padded to a batch-size bucket (default 1, 2, 4, 8, 16, ... up
    to n_slots); padding rows read and write a scratch slot.
So a single session compiles at most len(buckets) + 1 graphs, a batch session len(buckets) +
len(batch buckets). Padded tokens write their K/V at positions after the real tokens, which no real
query can see (causal mask) and the next real tokens overwrite; each slot has `max(buckets)` spare
positions past the capacity so padding never writes out of bounds.

Compilers: on an Ascend NPU torchair's NPU backend with frozen parameters and the caches' addresses
marked static (torchair frozen_parameter.md); when the attention kernels take per-row KV lengths
(SymInt[] in their schemas; ops.py passes none to a kernel whose lengths are int[]) the step compiles
with dynamic=True, every tensor input mark_static'd and tiling_schedule_optimize on where this torchair
has that option, so the lengths become graph inputs instead of
constants that would recompile every step (torchair docs, dynamic_static_graph/typical_issues.md,
"path 4"). Elsewhere inductor, dynamic=False. Eager mode runs the same module uncompiled, exact lengths.

Speculative decoding's MTP drafter (the batch session's draft_nextn) is torch_ref's (plugins/torch_ref/nextn.py):
the step's final hidden states, a graph output either way, are kept on the device per slot once start_nextn is
called, and the checkpoint's NextN layer runs eagerly on the device with this backend's kernels.
"""
from __future__ import annotations

import sys
import time
import types
from collections.abc import Sequence

import numpy as np
import torch

from glmcore import arch
from glmcore.backend import BatchSession, Capabilities, LoadOptions, Session, default_capacity
from glmcore.config import ModelConfig
from glmcore.errors import BackendError
from glmcore.parallel import LOCAL

from glmcore_plugins.torch_ref.forward import FORWARDS, NextN
from glmcore_plugins.torch_ref.nextn import NextNState

from .ops import moe_ops, select_ops

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


def raise_recompile_limit(limit: int = 256, config=None) -> str:
    """Allow `limit` compiled graphs per code object: one per shape bucket, dtype and architecture (a
    process that loads several models -- the conformance suite checks 5 families x 3 precisions -- compiles
    the shared forward for each; at 64 that run hit FailOnRecompileLimitHit under fullgraph). The setting is
    torch._dynamo.config.recompile_limit from torch 2.7 and cache_size_limit before (torch_npu builds
    exist for torch 2.1-2.6). Returns the name it set."""
    config = torch._dynamo.config if config is None else config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), limit))
    return name


def _private_copy(method):
    """The same bound method over a private copy of its code object. Dynamo keeps compiled graphs on
    the code object; torchair's frozen_parameter bakes this session's weight addresses into its
    graph, so no other session may reuse it."""
    f = method.__func__
    g = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    return types.MethodType(g, method.__self__)


def parse_buckets(value, default=DEFAULT_BUCKETS, what="buckets") -> tuple[int, ...]:
    if value is None:
        return default
    try:
        items = value.split(",") if isinstance(value, str) else list(value)
        buckets = tuple(sorted({int(b) for b in items}))
    except (TypeError, ValueError):
        buckets = ()
    if not buckets or buckets[0] < 1:
        raise BackendError(f"ascend_npu: {what}={value!r} is not a list of positive sizes; "
                           f"pass e.g. --opt {what}=" + ",".join(str(b) for b in default))
    return buckets


def parse_block_size(value, default: int = 128) -> int:
    """Positions per block of a paged cache: a multiple of 16 (page attention's fp16/bf16 constraint)."""
    try:
        size = default if value is None else int(value)
    except (TypeError, ValueError):
        size = 0
    if size < 16 or size % 16:
        raise BackendError(f"ascend_npu: block_size={value!r} is not a multiple of 16 (page attention needs one); "
                           f"pass e.g. --opt block_size={default}")
    return size


def npu_compiler(torchair_mod, dynamic_lengths: bool):
    """torchair's NPU backend as this backend configures it: frozen parameters always; with per-row KV
    lengths also tiling_schedule_optimize (the lengths stay graph inputs; see the module docstring)
    where this torchair has it. Returns (backend, the options set). torchair's config objects raise
    ValueError on an option they do not have, and tiling_schedule_optimize came after 6.0.rc1."""
    config = torchair_mod.CompilerConfig()
    config.experimental_config.frozen_parameter = True
    options = ["frozen_parameter=True"]
    if dynamic_lengths and hasattr(config.experimental_config, "tiling_schedule_optimize"):
        config.experimental_config.tiling_schedule_optimize = True
        options.append("tiling_schedule_optimize=True")
    return torchair_mod.get_npu_backend(compiler_config=config), options


class BlockTables:
    """The block tables of a paged KV cache (vLLM's block manager, small): slot s's positions j*size..(j+1)*size-1
    live in physical block table[s, j] of one pool. A prefix copy shares the source's blocks (reference counts);
    a write into a shared block first copies it (copy on write), so a slot never writes another's positions.
    Block 0 is scratch: unallocated entries point at it (the kernels need every entry in range; nothing is read
    past a row's length). The pool holds every slot's blocks unshared, so allocation never fails."""

    def __init__(self, n_slots: int, per_slot: int, size: int, copy_block):
        self.size, self.copy_block = size, copy_block          # copy_block(src, dst): the device copy
        self.table = np.zeros((n_slots, per_slot), np.int32)
        self.refs = np.zeros(1 + n_slots * per_slot, np.int64)
        self.free = list(range(len(self.refs) - 1, 0, -1))

    @property
    def n_blocks(self) -> int:
        return len(self.refs)

    def ensure(self, slot: int, lo: int, hi: int) -> None:
        """Positions lo..hi-1 of `slot` get blocks of their own, ready to be written."""
        for j in range(lo // self.size, -(-hi // self.size)):
            block = int(self.table[slot, j])
            if block and self.refs[block] == 1:
                continue
            fresh = self.free.pop()
            self.refs[fresh] = 1
            if block:                       # shared: copy on write
                self.copy_block(block, fresh)
                self.refs[block] -= 1
            self.table[slot, j] = fresh

    def release(self, slot: int) -> None:
        for block in self.table[slot]:
            if block:
                self.refs[block] -= 1
                if self.refs[block] == 0:
                    self.free.append(int(block))
        self.table[slot] = 0

    def share(self, src: int, dst: int, n: int) -> None:
        """dst's first n positions become src's, by reference: a block-table edit, no copy."""
        self.release(dst)
        for j in range(-(-n // self.size)):
            block = int(self.table[src, j])
            self.table[dst, j] = block
            self.refs[block] += block != 0

    def rows(self, slots: list[int]) -> torch.Tensor:
        return torch.from_numpy(self.table[slots])


class StepRunner:
    """The model on the device, its static KV cache of `n_slots` slots and the (compiled) step."""

    def __init__(self, cfg: ModelConfig, weights, options: LoadOptions, caps: Capabilities, device: torch.device,
                 n_slots: int, soc: str | None = None, tp=LOCAL, paged: bool = False):
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
        # Spare positions past the capacity take the padded tokens of the last bucket (graph mode only).
        spare = self.buckets[-1] if self.mode == "graph" else 0
        self.ops = select_ops(device, self.dtype, soc)
        forward = FORWARDS[arch.of(cfg).torch_forward]        # the shared torch forward (plugins/torch_ref)
        if getattr(cfg, "num_experts", 0):
            # the experts as torch_npu's fused MoE chain where it runs, else dense under capture (ops.moe_ops)
            self.ops = moe_ops(self.ops, cfg, graph=self.mode == "graph")
        positions = self.capacity + spare
        paged = paged and self.ops.paged_decode is not None
        if paged:
            size = parse_block_size(extra.get("block_size"))
            positions = -(-positions // size) * size
        self.model = forward(cfg, weights, device, self.dtype, self.ops, positions, tp).eval()
        # Static KV cache, BNSD per layer: [slots, kv_heads, positions, head_dim] (see ops.py for why), or the
        # architecture's own form (a latent cache for MLA): the forward says. Batches on kernels that read a
        # paged cache (page attention) get one instead: [blocks, kv_heads, block_size, head_dim] per layer and a
        # block table per slot, so a batched decode reads each row's blocks in place rather than gathering every
        # row's slot (BlockTables); GQA caches only (K and V alike).
        k_shape, v_shape = self.model.cache_shapes(n_slots, positions)
        self.tables = None
        if paged and k_shape == v_shape:
            self.tables = BlockTables(n_slots, positions // size, size, self._copy_block)
            k_shape = v_shape = (self.tables.n_blocks, k_shape[1], size, k_shape[3])
        self.k_cache = [torch.zeros(k_shape, dtype=self.dtype, device=device) for _ in range(cfg.num_layers)]
        self.v_cache = [torch.zeros(v_shape, dtype=self.dtype, device=device) for _ in range(cfg.num_layers)]
        self.on_npu = device.type == "npu"
        self.compiler = "none (eager)"
        self.compiles = 0                   # graphs compiled by this runner's calls
        self.compile_seconds = 0.0          # wall time of those calls (compile + first run)
        self._step = self.model.forward
        if self.mode == "graph":
            self._step = self._compile()

    def _compile(self):
        raise_recompile_limit()
        if self.on_npu:
            try:
                import torchair
            except Exception as e:      # torchair ships inside torch_npu; a broken install must say so
                raise BackendError(f"ascend_npu: graph mode on the NPU needs torchair, which ships with torch_npu "
                                   f"({type(e).__name__}: {e}); install the torch_npu matching your CANN, or pass "
                                   "--opt mode=eager") from None
            for t in self.k_cache + self.v_cache:
                # frozen_parameter.md: inputs marked with mark_static_address keep fixed addresses like
                # the parameters (torch >= 2.6), so the graph does not re-register them every step
                torch._dynamo.mark_static_address(t)
                torch._dynamo.mark_static(t)
            backend, options = npu_compiler(torchair, self.ops.seq_lens)
            backend = _counting(backend)
            if self.ops.seq_lens:
                options.append("dynamic=True with static tensor shapes")
            self.compiler = f"torchair npu backend ({', '.join(options)})"
            return torch.compile(_private_copy(self.model.forward), backend=backend, fullgraph=True,
                                 dynamic=self.ops.seq_lens)
        self.compiler = "inductor"
        return torch.compile(self.model.forward, backend=_inductor_backend(), fullgraph=True, dynamic=False)

    def _copy_block(self, src: int, dst: int) -> None:
        with torch.inference_mode():
            for cache in self.k_cache + self.v_cache:
                cache[dst].copy_(cache[src])

    def call(self, ids: torch.Tensor, start: list[int], slots: list[int], last: list[int]):
        """One step over B rows: ids [B, T] (on the device), per-row start position, cache slot and index
        of the row's last real token. Returns (float32 logits [B, vocab], hidden [B, T, hidden])."""
        dev = self.device
        start_t = torch.tensor(start, dtype=torch.long, device=dev)
        slots_t = torch.tensor(slots, dtype=torch.long, device=dev)
        last_t = torch.tensor(last, dtype=torch.long, device=dev)
        seq_lens = [s + ids.shape[1] for s in start] if self.ops.seq_lens else None
        blocks = None
        if self.tables is not None:
            for slot, s in zip(slots, start):
                self.tables.ensure(slot, s, s + ids.shape[1])
            blocks = self.tables.rows(slots).to(dev)
        static = (ids, start_t, slots_t, last_t) + ((blocks,) if blocks is not None else ())
        if self.on_npu and self.mode == "graph":
            for t in static:                              # static shapes; only the length list varies
                torch._dynamo.mark_static(t)
        # A call that compiled (new shape) is timed and counted apart from the steady-state steps.
        shapes = self.__dict__.setdefault("_shapes_seen", set())
        if self.mode == "graph" and tuple(ids.shape) not in shapes:
            shapes.add(tuple(ids.shape))     # the first call of a shape compiles: say so, it takes a while
            print(f"ascend_npu: compiling the graph for {ids.shape[0]}x{ids.shape[1]} tokens (once per shape; "
                  "about a minute on 2 cores, then cached on disk)", file=sys.stderr, flush=True)
        before = COMPILE_COUNT["graphs"]
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self._step(ids, start_t, slots_t, last_t, self.k_cache, self.v_cache, seq_lens, blocks)
        if COMPILE_COUNT["graphs"] != before:
            self.compiles += COMPILE_COUNT["graphs"] - before
            self.compile_seconds += time.perf_counter() - t0
        return out

    def bucket(self, n: int) -> int:
        return n if self.mode == "eager" else next(b for b in self.buckets if b >= n)

    def prefill_chunks(self, slot: int, start: int, ids: list[int], all_logits: bool, keep=None):
        """Append ids to `slot` from position `start` in bucket-sized chunks. Returns the last
        position's logits [vocab] and, with all_logits, every position's [len(ids), vocab]. keep: where the
        NextN drafter runs, its NextNState.keep, given each chunk's ids and final hidden states."""
        chunk = self.buckets[-1] if self.mode == "graph" else len(ids)
        rows, last = [], None
        for i in range(0, len(ids), chunk):
            part = ids[i:i + chunk]
            padded = torch.zeros((1, self.bucket(len(part))), dtype=torch.long)
            padded[0, :len(part)] = torch.tensor(part, dtype=torch.long)
            padded = padded.to(self.device)
            last, hidden = self.call(padded, [start + i], [slot], [len(part) - 1])
            if keep is not None:
                keep([slot], [start + i], padded[:, :len(part)], hidden[:, :len(part)])
            if all_logits:
                with torch.inference_mode():
                    rows.append(self.model.logits(hidden[0, :len(part)]).cpu())
        return last[0].cpu().numpy(), (torch.cat(rows).numpy() if all_logits else None)

    def report(self) -> dict:
        """What runs: device, dtype, mode, compiler and kernels (chosen once, at load)."""
        return {"device": str(self.device), "precision": self.precision, "mode": self.mode,
                "compiler": self.compiler, "kernels": self.ops.kernels, "capacity": self.capacity,
                "prefill buckets": list(self.buckets) if self.mode == "graph" else "exact lengths"}

    def close(self) -> None:
        self.k_cache, self.v_cache, self.model, self._step = [], [], None, None


def check_ids(ids, cfg: ModelConfig) -> list[int]:
    ids = [int(i) for i in ids]
    if not ids:
        raise BackendError("a step needs at least one token id")
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise BackendError(f"token id {bad[0]} is outside the vocabulary (0..{cfg.vocab_size - 1})")
    return ids


class AscendSession(Session):
    """One sequence: slot 0 of a one-slot cache."""

    def __init__(self, cfg: ModelConfig, weights, options: LoadOptions, caps: Capabilities, device: torch.device,
                 soc: str | None = None):
        self.runner = StepRunner(cfg, weights, options, caps, device, 1, soc)
        self.cfg, self.capacity = cfg, self.runner.capacity
        self._tok = torch.zeros((1, 1), dtype=torch.long, device=device)
        self._len = 0
        if self.runner.mode == "graph":
            # Compile the decode graph now, so the first generated tokens run at steady speed and the
            # compile shows as load time. It writes position 0, which the first real token overwrites.
            self.runner.call(self._tok, [0], [0], [0])

    # the runner's facts, under the names tests and benchmarks read
    mode = property(lambda self: self.runner.mode)
    buckets = property(lambda self: self.runner.buckets)
    model = property(lambda self: self.runner.model)
    ops = property(lambda self: self.runner.ops)
    k_cache = property(lambda self: self.runner.k_cache)
    v_cache = property(lambda self: self.runner.v_cache)
    compiles = property(lambda self: self.runner.compiles)
    compile_seconds = property(lambda self: self.runner.compile_seconds)

    def report(self) -> dict:
        return self.runner.report()

    @property
    def kv_len(self) -> int:
        return self._len

    def reset(self) -> None:
        self._len = 0     # stale positions are masked out (a query sees only positions <= its own)

    def close(self) -> None:
        self.runner.close()

    def prefill(self, ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        ids = check_ids(ids, self.cfg)
        self._check_room(len(ids))
        last, rows = self.runner.prefill_chunks(0, self._len, ids, all_logits)
        self._len += len(ids)
        return rows if all_logits else last

    def decode(self, token: int) -> np.ndarray:
        (token,) = check_ids([token], self.cfg)
        self._check_room(1)
        self._tok.fill_(token)
        logits, _ = self.runner.call(self._tok, [self._len], [0], [0])
        self._len += 1
        return logits[0].cpu().numpy()

    def _check_room(self, n: int) -> None:
        if self._len + n > self.capacity:
            raise BackendError(f"KV cache overflow: {self._len}+{n} > capacity {self.capacity} "
                               "(the core's overflow policy should have prevented this)")


def default_batch_buckets(n_slots: int) -> tuple[int, ...]:
    sizes = {n_slots}
    b = 1
    while b < n_slots:
        sizes.add(b)
        b *= 2
    return tuple(sorted(sizes))


class AscendBatchSession(BatchSession):
    """n_slots sequences over one [n_slots + 1]-slot cache (the extra slot takes padding rows). A step
    runs all its decode entries (one token each) as one batched graph call, so each weight matrix is
    read once for all of them, and each prefill chunk as a call of its own (prompts are
    compute-bound already)."""

    def __init__(self, cfg: ModelConfig, weights, options: LoadOptions, caps: Capabilities, device: torch.device,
                 n_slots: int, soc: str | None = None, tp=LOCAL):
        if n_slots < 1:
            raise BackendError(f"ascend_npu: a batch session needs at least one slot (got {n_slots})")
        self.runner = StepRunner(cfg, weights, options, caps, device, n_slots + 1, soc, tp, paged=True)
        self.cfg, self.n_slots, self.capacity = cfg, n_slots, self.runner.capacity
        self.batch_buckets = parse_buckets(options.extra.get("batch_buckets"), default_batch_buckets(n_slots),
                                           "batch_buckets")
        if self.runner.mode == "graph" and self.batch_buckets[-1] < n_slots:
            self.batch_buckets += (n_slots,)
        self._lens = [0] * n_slots
        # speculative decoding's drafter: the checkpoint's NextN layer, put on the device by start_nextn
        has = cfg.num_mtp_layers and "mtp.0.eh_proj.weight" in weights and tp is LOCAL
        self._nextn_layer = (lambda: NextN(self.runner.model, weights, 0, self.runner.device, self.runner.dtype)) \
            if has else None
        self.mtp: NextNState | None = None        # what the NextN layer drafts from, kept once start_nextn is called

    @property
    def has_nextn(self) -> bool:
        return self._nextn_layer is not None

    def start_nextn(self) -> None:
        """The NextN layer, its cache and the kept ids and hidden states go on the device now. The layer runs
        eagerly in either mode, with the Ops table's kernels: one small layer over a catch-up chunk whose length
        varies with each verification's accepted drafts, then single tokens at growing positions; compiling it
        would mean a graph per length (or padded buckets) for a layer that is a small part of a draft's cost
        next to the target's verification step."""
        if self._nextn_layer is None:
            raise BackendError("this checkpoint has no NextN layer to draft with")
        if self.mtp is None:
            r = self.runner
            # torch_npu's fused kernels get the whole cache, contiguous, as the target's step passes it (they bound
            # a row's work by its KV length); host kernels attend over views of the positions a draft reaches
            self.mtp = NextNState(r.model, self._nextn_layer(), self.n_slots, self.capacity, r.device, r.dtype,
                                  views=r.ops.name != "npu")

    def draft_nextn(self, slot: int, token: int, k: int) -> list[int]:
        if self.mtp is None:
            raise BackendError("draft_nextn before start_nextn: the hidden states it drafts from were not kept")
        return self.mtp.draft(self._slot(slot), self._lens[slot], token, k)

    def report(self) -> dict:
        return dict(self.runner.report(), slots=self.n_slots, **{
            "decode batch buckets": list(self.batch_buckets) if self.runner.mode == "graph" else "exact sizes"})

    def kv_len(self, slot: int) -> int:
        return self._lens[self._slot(slot)]

    def _slot(self, slot) -> int:
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.n_slots:
            raise BackendError(f"slot {slot!r} does not exist: this batch session has slots 0..{self.n_slots - 1}")
        return int(slot)

    def forward(self, entries, all_logits: Sequence[bool] | None = None):
        # slots, entry counts and capacity were checked by the core (BatchSession.step); the ids index the
        # embedding on the device, so their range is checked here
        entries = [(int(s), check_ids(ids, self.cfg)) for s, ids in entries]
        out: list = [None] * len(entries)
        decodes = [i for i, (_, ids) in enumerate(entries) if len(ids) == 1]
        every = list(all_logits) if all_logits is not None else [False] * len(entries)
        keep = self.mtp.keep if self.mtp is not None else None     # what the NextN layer drafts from
        for i, (s, ids) in enumerate(entries):
            if len(ids) > 1:
                last, rows = self.runner.prefill_chunks(s, self._lens[s], ids, every[i], keep)
                out[i] = rows if every[i] else last if all_logits is None else last[None]
        if decodes:
            logits = self._decode([entries[i][0] for i in decodes], [entries[i][1][0] for i in decodes])
            for row, i in enumerate(decodes):
                out[i] = logits[row:row + 1] if all_logits else logits[row]
        for s, ids in entries:
            self._lens[s] += len(ids)
        return np.stack(out) if all_logits is None else out

    def _decode(self, slots: list[int], tokens: list[int]) -> np.ndarray:
        """One token for each slot in one call, padded to a batch bucket with rows on the scratch slot."""
        n = len(slots)
        size = n if self.runner.mode == "eager" else next(b for b in self.batch_buckets if b >= n)
        pad = size - n
        ids = torch.tensor(tokens + [0] * pad, dtype=torch.long).reshape(size, 1).to(self.runner.device)
        starts = [self._lens[s] for s in slots]
        logits, hidden = self.runner.call(ids, starts + [0] * pad, slots + [self.n_slots] * pad, [0] * size)
        if self.mtp is not None:
            self.mtp.keep(slots, starts, ids[:n], hidden[:n])
        return logits[:n].cpu().numpy()

    def reset(self, slot: int) -> None:
        self._lens[self._slot(slot)] = 0
        if self.runner.tables is not None:
            self.runner.tables.release(slot)
        if self.mtp is not None:
            self.mtp.reset(slot)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        src, dst = self._slot(src), self._slot(dst)
        if not 0 <= n <= self._lens[src]:
            raise BackendError(f"copy_prefix: slot {src} holds {self._lens[src]} positions, cannot copy {n}")
        if src != dst and self.runner.tables is not None:
            self.runner.tables.share(src, dst, n)          # a block-table edit: the blocks are shared, not copied
        elif src != dst:
            with torch.inference_mode():
                for cache in self.runner.k_cache + self.runner.v_cache:   # keys are stored rotated at 0..n-1
                    cache[dst, :, :n].copy_(cache[src, :, :n])
        self._lens[dst] = n
        if self.mtp is not None:
            self.mtp.copy_prefix(src, dst, n)

    def close(self) -> None:
        self.runner.close()
        self.mtp = self._nextn_layer = None
