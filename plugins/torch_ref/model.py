"""The reference backend's sessions: the shared torch forward (forward.py) in fp32 with plain PyTorch
kernels (ops.py), eager. The math is stated once, in forward.py, for every torch-based backend."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from glmcore import arch
from glmcore.arch.rotary import rotary_tables as _core_rotary_tables
from glmcore.backend import BatchSession, Capabilities, KVBlob, LoadOptions, Session, default_capacity
from glmcore.errors import BackendError
from glmcore.config import ModelConfig
from glmcore.parallel import LOCAL

from .forward import FORWARDS, NextN, apply_rotary
from .nextn import NextNState
from .ops import torch_ops

__all__ = ["TorchRefBatch", "TorchRefSession", "apply_rotary", "rotary_tables"]


def rotary_tables(cfg: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, rotary_dim/2] fp32 for integer positions (negative ones rotate back): the core's table."""
    cos, sin = _core_rotary_tables(cfg, positions.numpy())
    return torch.from_numpy(cos), torch.from_numpy(sin)


class TorchRefBatch(BatchSession):
    """n_slots sequences over the shared forward. One step groups its entries by length: the rows of a
    group (every decode token of the step, or prefill chunks of equal length) run through each weight
    matrix together, each row attending over its own slot's cache.

    Under tensor parallelism (`tp`, a glmcore.parallel.Shard) cfg and weights are this rank's part and
    the tp hooks join the parts; on one device they are glmcore.parallel.LOCAL and do nothing."""

    def __init__(self, cfg: ModelConfig, weights, options: LoadOptions, caps: Capabilities, n_slots: int,
                 shared: torch.nn.Module | None = None, tp=LOCAL):
        if options.threads:
            torch.set_num_threads(options.threads)
        self.cfg, self.n_slots, self.tp = cfg, n_slots, tp
        self.capacity = default_capacity(cfg, caps, options.capacity)
        cpu = torch.device("cpu")
        if shared is None:
            forward = FORWARDS[arch.of(cfg).torch_forward]
            shared = forward(cfg, weights, cpu, torch.float32, torch_ops(), self.capacity, tp).eval()
        self.model = shared
        k_shape, v_shape = self.model.cache_shapes(n_slots, self.capacity)       # per layer, as the forward keeps it
        self.k_cache = [torch.zeros(k_shape) for _ in range(cfg.num_layers)]
        self.v_cache = [torch.zeros(v_shape) for _ in range(cfg.num_layers)]
        self.lens = [0] * n_slots
        self.nextn_layer = NextN(self.model, weights, 0, cpu, torch.float32) \
            if cfg.num_mtp_layers and "mtp.0.eh_proj.weight" in weights and tp is LOCAL else None
        self.mtp: NextNState | None = None        # what the NextN layer drafts from, kept once start_nextn is called

    @property
    def has_nextn(self) -> bool:
        return self.nextn_layer is not None

    def start_nextn(self) -> None:
        if self.nextn_layer is None:
            raise BackendError("this checkpoint has no NextN layer to draft with")
        if self.mtp is None:
            self.mtp = NextNState(self.model, self.nextn_layer, self.n_slots, self.capacity)

    def draft_nextn(self, slot: int, token: int, k: int) -> list[int]:
        if self.mtp is None:
            raise BackendError("draft_nextn before start_nextn: the hidden states it drafts from were not kept")
        return self.mtp.draft(slot, self.lens[slot], token, k)

    def kv_len(self, slot: int) -> int:
        return self.lens[slot]

    def reset(self, slot: int) -> None:
        self.lens[slot] = 0
        if self.mtp is not None:
            self.mtp.reset(slot)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        if src != dst:
            for cache in self.k_cache + self.v_cache:
                cache[dst, :, :n] = cache[src, :, :n]
        self.lens[dst] = n
        if self.mtp is not None:
            self.mtp.copy_prefix(src, dst, n)

    def _cache_views(self, slot: int, n: int) -> list[torch.Tensor]:
        """What a slot's first n positions are: each layer's K and V (MLA: the latent rows and the V cache's
        one-value placeholder), and the NextN layer's cache, fed ids and hidden states where it drafts."""
        views = [c[slot, :, :n] for c in self.k_cache + self.v_cache]
        if self.mtp is not None:
            m = self.mtp
            views += [m.k_cache[slot, :, :n], m.v_cache[slot, :, :n], m.ids[slot, :n], m.hidden[slot, :n]]
        return views

    def export_prefix(self, slot: int, n: int) -> KVBlob:
        if not 0 < n <= self.lens[slot]:
            raise BackendError(f"cannot export {n} positions of slot {slot}, which holds {self.lens[slot]}")
        parts = tuple(v.numpy().copy() for v in self._cache_views(slot, n))
        if self.mtp is not None:     # how many positions the NextN cache holds (at most n - 1, as copy_prefix)
            parts += (np.array([min(self.mtp.lens[slot], n - 1)]),)
        return KVBlob(n, parts)

    def import_prefix(self, slot: int, blob: KVBlob) -> None:
        views = self._cache_views(slot, blob.n)
        self.check_blob(slot, blob, len(views) + (self.mtp is not None))
        for view, part in zip(views, blob.parts):
            if tuple(view.shape) != part.shape:
                raise BackendError(f"a KV blob part of shape {part.shape} does not fit this session's "
                                   f"{tuple(view.shape)}; it was exported by another model")
            view.copy_(torch.from_numpy(part))
        self.lens[slot] = blob.n
        if self.mtp is not None:
            self.mtp.lens[slot] = int(blob.parts[-1][0])

    def close(self) -> None:
        self.model, self.k_cache, self.v_cache = None, [], []

    @torch.inference_mode()
    def forward(self, entries: Sequence[tuple[int, Sequence[int]]], all_logits: Sequence[bool] | None = None):
        groups: dict[int, list[int]] = {}            # length -> indices of the entries of that length
        for i, (_, ids) in enumerate(entries):
            groups.setdefault(len(ids), []).append(i)
        out: list = [None] * len(entries)
        for T, members in groups.items():
            slots = [entries[i][0] for i in members]
            ids = torch.tensor([list(entries[i][1]) for i in members], dtype=torch.int64)
            start = torch.tensor([self.lens[s] for s in slots], dtype=torch.int64)
            last = torch.full((len(members),), T - 1, dtype=torch.int64)
            # attention over the positions the rows reach, not the whole capacity: views of the caches' start
            end = max(self.lens[s] for s in slots) + T
            k_cache = [c[:, :, :end] for c in self.k_cache]
            v_cache = [c[:, :, :end] for c in self.v_cache]
            logits, hidden = self.model(ids, start, torch.tensor(slots, dtype=torch.int64), last, k_cache, v_cache)
            if self.mtp is not None:     # what the NextN layer drafts from
                self.mtp.keep(slots, start.tolist(), ids, hidden)
            for row, (i, slot) in enumerate(zip(members, slots)):
                self.lens[slot] += T
                if all_logits is None:
                    out[i] = logits[row].numpy()
                else:       # the output layer over every position only for the entries that want them
                    out[i] = (self.model.logits(hidden[row]) if all_logits[i] else logits[row][None]).numpy()
        return np.stack(out) if all_logits is None else out


class TorchRefSession(Session):
    """One sequence: a one-slot TorchRefBatch (one code path for the math)."""

    def __init__(self, cfg: ModelConfig, weights, options: LoadOptions, caps: Capabilities,
                 batch: TorchRefBatch | None = None):
        self.batch = batch or TorchRefBatch(cfg, weights, options, caps, 1)
        self.capacity = self.batch.capacity
        self._args = (cfg, weights, options, caps)

    @property
    def kv_len(self) -> int:
        return self.batch.lens[0]

    def reset(self) -> None:
        self.batch.reset(0)

    def close(self) -> None:
        self.batch.close()

    def fork(self) -> "TorchRefSession":
        cfg, weights, options, caps = self._args
        return type(self)(cfg, weights, options, caps, TorchRefBatch(cfg, weights, options, caps, 1,
                                                                     shared=self.batch.model))

    def prefill(self, ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        out = self.batch.step([(0, list(ids))], all_logits=all_logits)
        return out[0]

    def decode(self, token: int) -> np.ndarray:
        return self.batch.step([(0, [token])])[0]
