"""Speculative decoding's NextN (MTP) drafter over the shared torch forward, for every torch-based batch session
(torch_ref's, ascend_npu's): what the NextN layer drafts from, kept per slot, and the drafting itself. The layer's
math is the forward's (forward.py DenseGLM.nextn); this is the session side of it."""
from __future__ import annotations

import torch

from .forward import DenseGLM, NextN


class NextNState:
    """The NextN layer's side of a batch session, on the model's device: its KV cache (one layer), and per slot the
    fed ids and the target's final hidden states by position, and how many positions its cache holds (`lens`).

    views: attend over views of the caches' first positions (host kernels: less work); device kernels get the whole
    cache, contiguous, as the target's own step passes it, and per-row KV lengths where they take them."""

    def __init__(self, model: DenseGLM, layer: NextN, n_slots: int, capacity: int, device=None,
                 dtype: torch.dtype = torch.float32, views: bool = True):
        self.model, self.layer, self.views = model, layer, views
        k_shape, v_shape = model.cache_shapes(n_slots, capacity)
        self.k_cache = torch.zeros(k_shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(v_shape, dtype=dtype, device=device)
        self.ids = torch.zeros((n_slots, capacity), dtype=torch.int64, device=device)
        self.hidden = torch.zeros((n_slots, capacity, model.cfg.hidden_size), dtype=dtype, device=device)
        self.lens = [0] * n_slots

    @torch.inference_mode()
    def keep(self, slots: list[int], starts: list[int], ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """Row b of a target step fed ids[b] [T] at positions starts[b].. of slots[b], with final hidden states
        hidden[b] [T, hidden]: what the NextN layer drafts from."""
        dev = self.ids.device
        pos = torch.tensor(starts, device=dev)[:, None] + torch.arange(ids.shape[1], device=dev)
        rows = torch.tensor(slots, device=dev)[:, None].expand_as(pos)
        self.ids[rows, pos] = ids.to(dev)
        self.hidden[rows, pos] = hidden.to(self.hidden.dtype)

    @torch.inference_mode()
    def draft(self, slot: int, n: int, token: int, k: int) -> list[int]:
        """k greedy drafts for `slot`, which holds n target positions, after `token` (sampled, not yet fed): the
        layer first catches up on the positions the target fed since its last draft (each with the next fed token
        and the target's hidden state there), then chains on its own output. The drafts stay on the device until
        the last (no host round trip per draft)."""
        model, dev = self.model, self.ids.device
        done = min(self.lens[slot], n - 1)
        end = n + k if self.views else self.k_cache.shape[2]
        k_cache, v_cache = self.k_cache[:, :, :end], self.v_cache[:, :, :end]
        lengths = model.ops.seq_lens and not self.views
        one = torch.tensor([slot], device=dev)

        def run(ids, start, hidden):
            seq_lens = [start + ids.shape[1]] if lengths else None
            return model.nextn(self.layer, ids, torch.tensor([start], device=dev), one, hidden, k_cache, v_cache,
                               seq_lens)

        ids = torch.cat([self.ids[slot, done + 1:n], torch.tensor([int(token)], device=dev)])[None]
        logits, x = run(ids, done, self.hidden[slot:slot + 1, done:n])
        self.lens[slot] = n        # positions < n now hold what the target's own tokens and states give
        drafts = [logits.argmax(-1)]
        for j in range(1, k):      # chained drafts: written past n, overwritten by the next catch-up
            logits, x = run(drafts[-1][None], n + j - 1, x[:, -1:])
            drafts.append(logits.argmax(-1))
        return torch.cat(drafts).tolist()

    def reset(self, slot: int) -> None:
        self.lens[slot] = 0

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Position i of the NextN cache needs the target's id at i + 1: n kept positions keep n - 1 of it."""
        if src != dst:
            with torch.inference_mode():
                for cache in (self.k_cache, self.v_cache):
                    cache[dst, :, :n] = cache[src, :, :n]
                self.ids[dst, :n], self.hidden[dst, :n] = self.ids[src, :n], self.hidden[src, :n]
        self.lens[dst] = max(min(self.lens[src], n - 1), 0)
