"""The GLM forward pass in plain fp32 PyTorch, one function per concept."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from glmcore.backend import Capabilities, LoadOptions, Session, default_capacity
from glmcore.config import ModelConfig


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotary_tables(cfg: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, rotary_dim/2], in fp32 whatever the model dtype (ChatGLM2's fp16 angles drift)."""
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]: rotate the first half of the dims in interleaved pairs (2i, 2i+1)."""
    rot = x.shape[-1] // 2
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x0, x1 = x_rot[..., 0::2], x_rot[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2)
    return torch.cat((out, x_pass), dim=-1)


class TorchRefSession(Session):
    def __init__(self, cfg: ModelConfig, weights, options: LoadOptions, caps: Capabilities):
        if options.threads:
            torch.set_num_threads(options.threads)
        self.cfg = cfg
        self.capacity = default_capacity(cfg, caps, options.capacity)
        self.w = {k: torch.from_numpy(np.array(weights[k], dtype=np.float32)) for k in weights}
        shape = (cfg.num_layers, self.capacity, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape)
        self.v_cache = torch.zeros(shape)
        self._len = 0

    @property
    def kv_len(self) -> int:
        return self._len

    def reset(self) -> None:
        self._len = 0

    def close(self) -> None:
        self.w = {}

    def prefill(self, ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        logits = self._forward(list(ids))
        return logits if all_logits else logits[-1]

    def decode(self, token: int) -> np.ndarray:
        return self._forward([token])[-1]

    @torch.inference_mode()
    def _forward(self, ids: list[int]) -> np.ndarray:
        cfg, w = self.cfg, self.w
        start, T = self._len, len(ids)
        if start + T > self.capacity:
            raise RuntimeError(f"KV cache overflow: {start}+{T} > {self.capacity} (the core should have prevented this)")
        end = start + T
        x = w["embed.weight"][torch.tensor(ids)]
        cos, sin = rotary_tables(cfg, torch.arange(start, end))
        group = cfg.num_heads // cfg.num_kv_heads
        # query i (absolute position start+i) sees keys 0..start+i
        mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            h = rms_norm(x, w[p + "input_norm.weight"], cfg.norm_eps)
            qkv = h @ w[p + "qkv.weight"].T
            if cfg.qkv_bias:
                qkv = qkv + w[p + "qkv.bias"]
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = apply_rotary(q.view(T, cfg.num_heads, cfg.head_dim), cos, sin)
            k = apply_rotary(k.view(T, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            self.k_cache[i, start:end] = k          # keys are cached after rotation
            self.v_cache[i, start:end] = v.view(T, cfg.num_kv_heads, cfg.head_dim)
            keys = self.k_cache[i, :end].repeat_interleave(group, dim=1)      # [end, heads, hd]
            values = self.v_cache[i, :end].repeat_interleave(group, dim=1)
            scores = torch.einsum("thd,shd->hts", q, keys) / cfg.head_dim ** 0.5
            scores = scores.masked_fill(~mask, float("-inf"))
            attn = torch.einsum("hts,shd->thd", scores.softmax(-1), values).reshape(T, cfg.q_size)
            x = x + attn @ w[p + "attn_out.weight"].T
            h = rms_norm(x, w[p + "post_attn_norm.weight"], cfg.norm_eps)
            gate, up = (h @ w[p + "ffn_up.weight"].T).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "ffn_down.weight"].T
        x = rms_norm(x, w["final_norm.weight"], cfg.norm_eps)
        self._len = end
        return (x @ w["lm_head.weight"].T).numpy()
