"""Native batch session (contract v2): continuous batching over the paged-attention form of our own graph.

OpenVINO's paged-attention transformation (the one OpenVINO GenAI's continuous-batching pipeline applies to a
stateful SDPA model) turns the stateful graph into one whose attention reads and writes KV caches given as
inputs, `key_cache.N` / `value_cache.N` [blocks, kv_heads, block_size, head_dim], addressed per sequence by
a block table. One call then runs any mix of prefill chunks and decode tokens of different sequences, each
weight matrix read once for all of them. Here the scheduler and sampler are glmcore's; this class only lays
out the tokens and the block tables:

- each slot owns a fixed run of `ceil(capacity / block_size)` blocks of the cache tensors (allocated once);
- step(): the entries' ids concatenated, their positions, `past_lens` (what each slot holds),
  `subsequence_begins`, the slots' blocks, and `logits_indices` (an input added here: the rows whose
  logits are wanted, so the output layer runs only for those);
- copy_prefix(): the blocks holding the first n positions are copied in memory (a partly filled last block
  whole: past_lens keeps what lies beyond n unread, and the next step overwrites it);
- reset(): the slot's length goes to 0 (its blocks are simply overwritten later);
- export_prefix()/import_prefix(): the blocks holding the first n positions copied to or from host arrays,
  one per cache tensor (the prompt cache; whole blocks, as copy_prefix).
The caches are plain f32/f16/bf16 (no u8: its blocks carry quantization scales of their own).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from glmcore.backend import BatchSession, Entry, KVBlob, LoadOptions
from glmcore.config import ModelConfig
from glmcore.errors import BackendError

from . import graph
from .session import compile_config, release_mapped_file

PA_KV = ("f32", "f16", "bf16")      # plain caches: whole blocks can be copied (u8 caches carry block scales)


def paged_model(model: ov.Model) -> ov.Model:
    """Our stateful model in paged-attention form, with an input `logits_indices` i64[n] choosing the rows
    (token positions of the call) that go through the output layer."""
    from openvino._offline_transformations import paged_attention_transformation
    paged_attention_transformation(model)
    lm_head = next(op for op in model.get_ordered_ops() if op.get_friendly_name() == graph.LM_HEAD)
    indices = ops.parameter([-1], ov.Type.i64, name="logits_indices")
    indices.output(0).get_tensor().set_names({"logits_indices"})
    rows = ops.gather(lm_head.input_value(0), indices, graph._c(0))      # hidden [tokens, 1, H] -> [n, 1, H]
    lm_head.input(0).replace_source_output(rows.output(0))
    model.add_parameters([indices])
    model.validate_nodes_and_infer_types()
    return model


class OpenVINOBatchSession(BatchSession):
    def __init__(self, cfg: ModelConfig, model: ov.Model, options: LoadOptions, capacity: int, n_slots: int,
                 weights_file: Path | None = None):
        if n_slots < 1:
            raise BackendError(f"a batch session needs at least one slot, not {n_slots}")
        self.cfg, self.n_slots, self.capacity = cfg, n_slots, capacity
        self.config = compile_config(options)
        if self.config["KV_CACHE_PRECISION"] not in PA_KV:
            raise BackendError(f"kv_cache {self.config['KV_CACHE_PRECISION']} is not offered for batch sessions; "
                               f"use one of {', '.join(PA_KV)} (--opt kv_cache=f16)")
        self.compiled = ov.Core().compile_model(paged_model(model), "CPU", self.config)
        self.request = self.compiled.create_infer_request()
        caches = [i for i in self.compiled.inputs if i.get_any_name().endswith(tuple(
            f"_cache.{n}" for n in range(cfg.num_layers)))]
        self.block_size = caches[0].get_partial_shape()[2].get_length()
        self.blocks_per_slot = -(-capacity // self.block_size)
        blocks = n_slots * self.blocks_per_slot
        self._caches = {}
        for port in caches:
            shape = [blocks] + [d.get_length() for d in list(port.get_partial_shape())[1:]]
            tensor = ov.Tensor(port.get_element_type(), ov.Shape(shape))
            self.request.set_tensor(port.get_any_name(), tensor)
            self._caches[port.get_any_name()] = tensor
        self._len = [0] * n_slots
        if weights_file is not None:     # as OpenVINOSession: pack the weights, then let the mapped file go
            self.step([(0, [0])])
            self.reset(0)
            release_mapped_file(weights_file)

    def _blocks(self, slot: int, n_positions: int) -> range:
        first = slot * self.blocks_per_slot
        return range(first, first + -(-n_positions // self.block_size))

    def kv_len(self, slot: int) -> int:
        return self._len[self._check(slot)]

    def _check(self, slot: int) -> int:
        if not 0 <= slot < self.n_slots:
            raise BackendError(f"slot {slot} out of range 0..{self.n_slots - 1}")
        return slot

    def forward(self, entries: Sequence[Entry], all_logits: Sequence[bool] | None = None):
        entries = [(slot, [int(t) for t in ids]) for slot, ids in entries]   # checked by BatchSession.step
        ids, pos, past, begins, table, table_begins, wanted = [], [], [], [0], [], [0], []
        for i, (slot, chunk) in enumerate(entries):
            start, end = self._len[slot], self._len[slot] + len(chunk)
            if min(chunk) < 0 or max(chunk) >= self.cfg.vocab_size:
                raise BackendError(f"token id out of range 0..{self.cfg.vocab_size - 1}")
            first = len(ids)
            ids += chunk
            pos += range(start, end)
            past.append(start)
            begins.append(len(ids))
            table += self._blocks(slot, end)
            table_begins.append(len(table))
            wanted += range(first, len(ids)) if all_logits is not None and all_logits[i] else [len(ids) - 1]
        inputs = {
            "input_ids": np.array(ids, np.int64), "position_ids": np.array(pos, np.int64),
            "past_lens": np.array(past, np.int32), "subsequence_begins": np.array(begins, np.int32),
            "block_indices": np.array(table, np.int32), "block_indices_begins": np.array(table_begins, np.int32),
            "max_context_len": np.array(max(p + len(c) for p, (_, c) in zip(past, entries)), np.int32),
            "logits_indices": np.array(wanted, np.int64),
        }
        for name, value in inputs.items():
            self.request.set_tensor(name, ov.Tensor(value))
        self.request.infer()
        logits = np.array(self.request.get_tensor("logits").data[:, 0], dtype=np.float32)   # [n, vocab], a copy
        for slot, chunk in entries:
            self._len[slot] += len(chunk)
        if all_logits is None:
            return logits
        bounds = np.cumsum([0] + [len(c) if w else 1 for (_, c), w in zip(entries, all_logits)])
        return [logits[a:b] for a, b in zip(bounds, bounds[1:])]

    def reset(self, slot: int) -> None:
        self._len[self._check(slot)] = 0

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self._check(src)
        self._check(dst)
        if not 0 <= n <= self._len[src]:
            raise BackendError(f"copy_prefix: slot {src} holds {self._len[src]} positions, not {n}")
        if src != dst:
            s, d = self._blocks(src, n), self._blocks(dst, n)
            for tensor in self._caches.values():
                data = tensor.data
                data[d.start:d.stop] = data[s.start:s.stop]
        self._len[dst] = n

    def export_prefix(self, slot: int, n: int) -> KVBlob:
        self._check(slot)
        if not 0 < n <= self._len[slot]:
            raise BackendError(f"export_prefix: slot {slot} holds {self._len[slot]} positions, not {n}")
        blocks = self._blocks(slot, n)
        return KVBlob(n, tuple(t.data[blocks.start:blocks.stop].copy() for t in self._caches.values()))

    def import_prefix(self, slot: int, blob: KVBlob) -> None:
        self._check(slot)
        self.check_blob(slot, blob, len(self._caches))
        blocks = self._blocks(slot, blob.n)
        for tensor, part in zip(self._caches.values(), blob.parts):
            data = tensor.data
            if data[blocks.start:blocks.stop].shape != part.shape or data.dtype != part.dtype:
                raise BackendError(f"a KV blob part {part.dtype}{list(part.shape)} does not fit this session's "
                                   "cache blocks; it was exported by another model or kv_cache precision")
            data[blocks.start:blocks.stop] = part
        self._len[slot] = blob.n

    def close(self) -> None:
        self.request = None
        self.compiled = None
        self._caches = {}
