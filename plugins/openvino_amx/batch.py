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

Speculative decoding's MTP drafter (a checkpoint with a NextN layer): the paged model also outputs every
position's final-normed hidden state, kept per slot once start_nextn is called, and the NextN layer runs as a
stateful model of its own (graph.build_nextn_model), one infer request (KV state) per slot (NextNState).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
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


def paged_model(model: ov.Model, hidden: bool = False) -> ov.Model:
    """Our stateful model in paged-attention form, with an input `logits_indices` i64[n] choosing the rows
    (token positions of the call) that go through the output layer; with `hidden`, an output `hidden` [tokens,
    1, H]: every position's final hidden state after the final norm (what the NextN layer drafts from)."""
    from openvino._offline_transformations import paged_attention_transformation
    paged_attention_transformation(model)
    lm_head = next(op for op in model.get_ordered_ops() if op.get_friendly_name() == graph.LM_HEAD)
    indices = ops.parameter([-1], ov.Type.i64, name="logits_indices")
    indices.output(0).get_tensor().set_names({"logits_indices"})
    normed = lm_head.input_value(0)                                      # hidden [tokens, 1, H], final-normed
    rows = ops.gather(normed, indices, graph._c(0))                      # -> [n, 1, H]
    lm_head.input(0).replace_source_output(rows.output(0))
    model.add_parameters([indices])
    if hidden:
        out = ops.result(normed)
        out.output(0).get_tensor().set_names({"hidden"})
        model.add_results([out])
    model.validate_nodes_and_infer_types()
    return model


class NextNState:
    """The NextN layer's side of a batch session: the layer compiled as a stateful model of its own
    (graph.build_nextn_model), one infer request per slot (its KV state: the positions the layer has seen, and
    past them what the last chained draft wrote), and per slot the fed ids and the target's final hidden states
    by position, and how many positions of the layer's state stand (`lens`)."""

    def __init__(self, model: ov.Model, config: dict, n_slots: int, capacity: int, hidden: int):
        self.compiled = ov.Core().compile_model(graph.add_logits_start(model), "CPU", config)
        self.requests = [self.compiled.create_infer_request() for _ in range(n_slots)]
        self.ids = np.zeros((n_slots, capacity), np.int64)
        self.hidden = np.zeros((n_slots, capacity, hidden), np.float32)
        self.lens = [0] * n_slots

    def keep(self, slot: int, n: int, source: int | None = None) -> None:
        """The slot's layer state holds the first n positions of `source`'s (default: its own)."""
        if n == 0:          # the initial (empty) state: a zero-length tensor is not one (its batch is 0)
            for s in self.requests[slot].query_state():
                s.reset()
            return
        src = self.requests[slot if source is None else source]
        states = {s.name: s.state.data[:, :, :n].copy() for s in src.query_state()}
        self.put(slot, states)

    def states(self, slot: int) -> list:
        """The slot's state variables, in a fixed order."""
        return sorted(self.requests[slot].query_state(), key=lambda st: st.name)

    def put(self, slot: int, states: dict) -> None:
        for s in self.requests[slot].query_state():
            s.state = ov.Tensor(np.ascontiguousarray(states[s.name]))

    def run(self, slot: int, ids: list[int], start: int, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """ids at positions start.. (the state holds start positions) with their hidden states [T, H]: the
        last position's logits and the layer's outputs [T, H]."""
        t = len(ids)
        request = self.requests[slot]
        request.infer({"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, start + t), np.int64),
                       "position_ids": np.arange(start, start + t, dtype=np.int64)[None],
                       "beam_idx": np.zeros(1, np.int32), "hidden": np.ascontiguousarray(hidden[None], np.float32),
                       "logits_start": np.array([t - 1], np.int64)})
        return request.get_tensor("logits").data[0, -1], request.get_tensor("hidden_out").data[0]


class OpenVINOBatchSession(BatchSession):
    def __init__(self, cfg: ModelConfig, model: ov.Model, options: LoadOptions, capacity: int, n_slots: int,
                 weights_file: Path | None = None, nextn: Callable[[], ov.Model] | None = None):
        """nextn: where the checkpoint has a NextN layer, what builds its model (at start_nextn)."""
        if n_slots < 1:
            raise BackendError(f"a batch session needs at least one slot, not {n_slots}")
        self.cfg, self.n_slots, self.capacity = cfg, n_slots, capacity
        self.config = compile_config(options)
        if self.config["KV_CACHE_PRECISION"] not in PA_KV:
            raise BackendError(f"kv_cache {self.config['KV_CACHE_PRECISION']} is not offered for batch sessions; "
                               f"use one of {', '.join(PA_KV)} (--opt kv_cache=f16)")
        self._nextn, self.mtp = nextn, None
        self.compiled = ov.Core().compile_model(paged_model(model, hidden=nextn is not None), "CPU", self.config)
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

    @property
    def has_nextn(self) -> bool:
        return self._nextn is not None

    def start_nextn(self) -> None:
        if self._nextn is None:
            raise BackendError("this checkpoint has no NextN layer to draft with")
        if self.mtp is None:     # its state in f32 (one layer), whatever the target's KV precision
            config = dict(self.config, KV_CACHE_PRECISION="f32", KEY_CACHE_PRECISION="f32",
                          VALUE_CACHE_PRECISION="f32")
            self.mtp = NextNState(self._nextn(), config, self.n_slots, self.capacity, self.cfg.hidden_size)

    def draft_nextn(self, slot: int, token: int, k: int) -> list[int]:
        """k greedy drafts after `token` (sampled, not yet fed), as the torch reference drafts: the NextN layer
        first catches up on the positions fed since its last draft (each with the next fed id and the target's
        hidden state there), then chains on its own output (written past the fed positions: the next catch-up
        drops them)."""
        if self.mtp is None:
            raise BackendError("draft_nextn before start_nextn: the hidden states it drafts from were not kept")
        m, n = self.mtp, self._len[self._check(slot)]
        done = min(m.lens[slot], n - 1)
        m.keep(slot, done)
        ids = [int(t) for t in m.ids[slot, done + 1:n]] + [int(token)]
        logits, x = m.run(slot, ids, done, m.hidden[slot, done:n])
        m.lens[slot] = n
        drafts = [int(np.argmax(logits))]
        for j in range(1, k):
            logits, x = m.run(slot, [drafts[-1]], n + j - 1, x[-1:])
            drafts.append(int(np.argmax(logits)))
        return drafts

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
        if self.mtp is not None:      # what the NextN layer drafts from: each position's id and hidden state
            hidden = self.request.get_tensor("hidden").data[:, 0]
            for (slot, chunk), first, start in zip(entries, begins, past):
                self.mtp.ids[slot, start:start + len(chunk)] = chunk
                self.mtp.hidden[slot, start:start + len(chunk)] = hidden[first:first + len(chunk)]
        for slot, chunk in entries:
            self._len[slot] += len(chunk)
        if all_logits is None:
            return logits
        bounds = np.cumsum([0] + [len(c) if w else 1 for (_, c), w in zip(entries, all_logits)])
        return [logits[a:b] for a, b in zip(bounds, bounds[1:])]

    def reset(self, slot: int) -> None:
        self._len[self._check(slot)] = 0
        if self.mtp is not None:
            self.mtp.lens[slot] = 0

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
        if self.mtp is not None:     # position i of the NextN state needs the id at i + 1: n keep n - 1 of it
            m = self.mtp
            m.lens[dst] = max(min(m.lens[src], n - 1), 0)
            if src != dst:
                m.ids[dst, :n], m.hidden[dst, :n] = m.ids[src, :n], m.hidden[src, :n]
                m.keep(dst, m.lens[dst], source=src)

    def export_prefix(self, slot: int, n: int) -> KVBlob:
        self._check(slot)
        if not 0 < n <= self._len[slot]:
            raise BackendError(f"export_prefix: slot {slot} holds {self._len[slot]} positions, not {n}")
        blocks = self._blocks(slot, n)
        parts = tuple(t.data[blocks.start:blocks.stop].copy() for t in self._caches.values())
        if self.mtp is not None:     # the NextN side: fed ids, hidden states, its state's positions (at most n - 1)
            m = self.mtp
            kept = max(min(m.lens[slot], n - 1), 0)
            parts += (m.ids[slot, :n].copy(), m.hidden[slot, :n].copy(),
                      *(st.state.data[:, :, :kept].copy() for st in m.states(slot)), np.array([kept]))
        return KVBlob(n, parts)

    def import_prefix(self, slot: int, blob: KVBlob) -> None:
        self._check(slot)
        states = [] if self.mtp is None else self.mtp.states(slot)
        self.check_blob(slot, blob, len(self._caches) + (0 if self.mtp is None else 3 + len(states)))
        blocks = self._blocks(slot, blob.n)
        for tensor, part in zip(self._caches.values(), blob.parts):
            data = tensor.data
            if data[blocks.start:blocks.stop].shape != part.shape or data.dtype != part.dtype:
                raise BackendError(f"a KV blob part {part.dtype}{list(part.shape)} does not fit this session's "
                                   "cache blocks; it was exported by another model or kv_cache precision")
            data[blocks.start:blocks.stop] = part
        self._len[slot] = blob.n
        if self.mtp is not None:
            m, n = self.mtp, blob.n
            ids, hidden, *state_parts, kept = blob.parts[len(self._caches):]
            if ids.shape != (n,) or hidden.shape != (n, self.cfg.hidden_size):
                raise BackendError("a KV blob's NextN part does not fit this session; it was exported by another model")
            m.ids[slot, :n], m.hidden[slot, :n], m.lens[slot] = ids, hidden, int(kept[0])
            if m.lens[slot]:
                m.put(slot, {st.name: part for st, part in zip(states, state_parts)})
            else:
                m.keep(slot, 0)

    def close(self) -> None:
        self.request = None
        self.compiled = None
        self._caches = {}
        self.mtp = None
