"""The GLM forward pass in plain fp32 PyTorch, one function per concept."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from glmcore.backend import BatchSession, Capabilities, LoadOptions, Session, default_capacity
from glmcore.config import ModelConfig
from glmcore.parallel import LOCAL
from glmcore.weights import release


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotary_tables(cfg: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, rotary_dim/2], in fp32 whatever the model dtype (ChatGLM2's fp16 angles drift)."""
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]: rotate the first rotary_dim (= 2 * cos's last dim) dims in interleaved pairs
    (2i, 2i+1); the rest pass through (ChatGLM/GLM-4: half the head; GLM-Edge: all of it)."""
    rot = 2 * cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x0, x1 = x_rot[..., 0::2], x_rot[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2)
    return torch.cat((out, x_pass), dim=-1)


def _f32(arr: np.ndarray) -> torch.Tensor:
    """A checkpoint tensor as an fp32 copy; its mapped pages are then released (resident once, not twice)."""
    t = torch.from_numpy(np.array(arr, dtype=np.float32))
    release(arr)
    return t


class TorchRefBatch(BatchSession):
    """n_slots sequences; one step runs every entry's tokens through each weight matrix together
    (ragged: the entries' tokens are concatenated), attention per entry over its own slot's cache.

    Under tensor parallelism (`tp`, a glmcore.parallel.Shard) cfg and weights are this rank's part and
    the tp hooks join the parts; on one device they are glmcore.parallel.LOCAL and do nothing."""

    def __init__(self, cfg: ModelConfig, weights, options: LoadOptions, caps: Capabilities, n_slots: int,
                 shared: dict | None = None, tp=LOCAL):
        if options.threads:
            torch.set_num_threads(options.threads)
        self.cfg, self.n_slots, self.tp = cfg, n_slots, tp
        self.capacity = default_capacity(cfg, caps, options.capacity)
        self.w = shared if shared is not None else {k: _f32(weights[k]) for k in weights}
        shape = (n_slots, cfg.num_layers, self.capacity, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape)     # keys are cached after rotation
        self.v_cache = torch.zeros(shape)
        self.lens = [0] * n_slots

    def kv_len(self, slot: int) -> int:
        return self.lens[slot]

    def reset(self, slot: int) -> None:
        self.lens[slot] = 0

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        if src != dst:
            self.k_cache[dst, :, :n] = self.k_cache[src, :, :n]
            self.v_cache[dst, :, :n] = self.v_cache[src, :, :n]
        self.lens[dst] = n

    def close(self) -> None:
        self.w = {}

    @torch.inference_mode()
    def forward(self, entries: Sequence[tuple[int, Sequence[int]]], all_logits: bool = False):
        cfg, w = self.cfg, self.w
        spans = []                                   # (slot, start, end, offset in the step's tokens)
        offset = 0
        for slot, ids in entries:
            start, T = self.lens[slot], len(ids)
            spans.append((slot, start, start + T, offset))
            offset += T
        ids = torch.tensor([t for _, e in entries for t in e])
        positions = torch.cat([torch.arange(start, end) for _, start, end, _ in spans])
        x = self.tp.embed(w["embed.weight"], ids)
        cos, sin = rotary_tables(cfg, positions)
        group = cfg.num_heads // cfg.num_kv_heads
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            h = rms_norm(x, w[p + "input_norm.weight"], cfg.norm_eps)
            qkv = h @ w[p + "qkv.weight"].T
            if cfg.qkv_bias:
                qkv = qkv + w[p + "qkv.bias"]
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = apply_rotary(q.view(-1, cfg.num_heads, cfg.head_dim), cos, sin)
            k = apply_rotary(k.view(-1, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
            attn = torch.empty(offset, cfg.q_size)
            for slot, start, end, o in spans:
                T = end - start
                self.k_cache[slot, i, start:end] = k[o:o + T]
                self.v_cache[slot, i, start:end] = v[o:o + T]
                keys = self.k_cache[slot, i, :end].repeat_interleave(group, dim=1)      # [end, heads, hd]
                values = self.v_cache[slot, i, :end].repeat_interleave(group, dim=1)
                scores = torch.einsum("thd,shd->hts", q[o:o + T], keys) / cfg.head_dim ** 0.5
                # query j (absolute position start+j) sees keys 0..start+j
                mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
                scores = scores.masked_fill(~mask, float("-inf"))
                attn[o:o + T] = torch.einsum("hts,shd->thd", scores.softmax(-1), values).reshape(T, cfg.q_size)
            out = self.tp.reduce(attn @ w[p + "attn_out.weight"].T)
            if cfg.post_norms:      # glm4 (GLM-4-0414): the sublayer's output is normed before the add
                out = rms_norm(out, w[p + "post_self_attn_norm.weight"], cfg.norm_eps)
            x = x + out
            h = rms_norm(x, w[p + "post_attn_norm.weight"], cfg.norm_eps)
            gate, up = (h @ w[p + "ffn_up.weight"].T).chunk(2, dim=-1)
            out = self.tp.reduce((torch.nn.functional.silu(gate) * up) @ w[p + "ffn_down.weight"].T)
            if cfg.post_norms:
                out = rms_norm(out, w[p + "post_mlp_norm.weight"], cfg.norm_eps)
            x = x + out
        for slot, _, end, _ in spans:
            self.lens[slot] = end
        # the output layer only where logits are wanted
        rows = torch.arange(offset) if all_logits else torch.tensor([o + e - s - 1 for _, s, e, o in spans])
        h = rms_norm(x[rows], w["final_norm.weight"], cfg.norm_eps)
        logits = self.tp.gather(h @ w["lm_head.weight"].T).numpy()
        if all_logits:
            return [logits[o:o + e - s] for _, s, e, o in spans]
        return logits


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
                                                                     shared=self.batch.w))

    def prefill(self, ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        out = self.batch.step([(0, list(ids))], all_logits=all_logits)
        return out[0]

    def decode(self, token: int) -> np.ndarray:
        return self.batch.step([(0, [token])])[0]
