"""The GLM forward pass written for whole-graph capture (torch.compile fullgraph / torchair).

Rules that keep it one static graph: every shape is fixed by the inputs' shapes (B rows of T tokens,
the cache's slots and positions), positions arrive as tensors (never a Python int taken from data),
masks are computed from them, and nothing branches on tensor values. One step serves B rows, each
row a chunk of one sequence (its cache slot): a single sequence is B = 1 over a one-slot cache; a
batch of sequences decodes as B rows of one token. Device kernels come from
the Ops chosen at load (ops.py). The math is plugins/torch_ref's: RMSNorm, fused QKV + bias, GQA,
rotary on the first half of each head's dims in interleaved pairs with fp32 angles, keys cached after
rotation, SwiGLU, final norm, lm_head.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from glmcore.config import ModelConfig
from glmcore.parallel import LOCAL
from glmcore.weights import BF16

from .ops import Ops


def to_device(arr: np.ndarray, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    """One checkpoint array -> a frozen parameter on `device` in `dtype`, without an fp32 detour for
    bf16/f16 checkpoints (bf16 is reinterpreted bitwise, then cast only if the dtypes differ)."""
    with warnings.catch_warnings():   # memory-mapped arrays are read-only; we copy, never write
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        if arr.dtype == BF16:
            t = torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(arr)
        t = t.to(device=device, dtype=dtype, copy=True)
    return nn.Parameter(t, requires_grad=False)


def rotary_tables(cfg: ModelConfig, positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [positions, rotary_dim/2] in fp32 for every cache position, computed once at load."""
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos().to(device), angles.sin().to(device)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, head_dim], cos/sin [..., T, rot/2]; rotate the first rot = rotary_dim dims
    (ChatGLM/GLM-4: half the head, GLM-Edge: all of it) in interleaved pairs, in fp32."""
    rot = 2 * cos.shape[-1]
    xf = x.float()
    x0, x1, x_pass = xf[..., 0:rot:2], xf[..., 1:rot:2], xf[..., rot:]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    out = torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2)
    return torch.cat((out, x_pass), dim=-1).to(x.dtype)


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, weights, i: int, device, dtype):
        super().__init__()
        p = f"layers.{i}."
        # Norm weights stay fp32 (0.01% of the parameters): norms run in fp32 on the fp32 residual.
        self.input_norm = to_device(weights[p + "input_norm.weight"], device, torch.float32)
        self.qkv = to_device(weights[p + "qkv.weight"], device, dtype)
        self.qkv_bias = to_device(weights[p + "qkv.bias"], device, dtype) if cfg.qkv_bias else None
        self.attn_out = to_device(weights[p + "attn_out.weight"], device, dtype)
        self.post_attn_norm = to_device(weights[p + "post_attn_norm.weight"], device, torch.float32)
        self.ffn_up = to_device(weights[p + "ffn_up.weight"], device, dtype)
        self.ffn_down = to_device(weights[p + "ffn_down.weight"], device, dtype)
        # glm4 (GLM-4-0414): norms of the attention and MLP outputs before each residual add
        post = cfg.post_norms
        self.post_self_attn_norm = to_device(weights[p + "post_self_attn_norm.weight"], device, torch.float32) \
            if post else None
        self.post_mlp_norm = to_device(weights[p + "post_mlp_norm.weight"], device, torch.float32) if post else None


class GLMGraphModel(nn.Module):
    """Weights on the device in the compute dtype (norm weights in fp32); `forward` is the captured step.
    Under tensor parallelism cfg and weights are this rank's part and `tp` (glmcore.parallel.Shard) joins
    the parts with collectives that trace into the graph; on one device it is LOCAL and does nothing."""

    def __init__(self, cfg: ModelConfig, weights, device: torch.device, dtype: torch.dtype, ops: Ops, positions: int,
                 tp=LOCAL):
        super().__init__()
        self.cfg, self.ops, self.dtype, self.tp = cfg, ops, dtype, tp
        self.embed = to_device(weights["embed.weight"], device, dtype)
        self.layers = nn.ModuleList(Layer(cfg, weights, i, device, dtype) for i in range(cfg.num_layers))
        self.final_norm = to_device(weights["final_norm.weight"], device, torch.float32)
        self.lm_head = to_device(weights["lm_head.weight"], device, dtype)
        cos, sin = rotary_tables(cfg, positions, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer("position_ids", torch.arange(positions, device=device), persistent=False)

    def forward(self, ids: torch.Tensor, start: torch.Tensor, slots: torch.Tensor, last: torch.Tensor,
                k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
                seq_lens: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, T] int64: row b holds tokens at positions start[b]..start[b]+T-1 of cache slot
        slots[b] (start, slots, last: [B] int64). Writes K/V into the static caches in place and returns
        (float32 logits [B, vocab] of each row's token `last[b]`, final hidden states [B, T, hidden]).
        Tokens past a row's real ones are padding; their results are unused. seq_lens: each row's KV
        length start[b]+T as host ints, for kernels that take it (Ops.seq_lens), else None."""
        cfg, ops = self.cfg, self.ops
        b, t = ids.shape
        hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        pos = start[:, None] + self.position_ids[:t]                       # [B, T] absolute positions
        cos, sin = self.cos[pos], self.sin[pos]
        allowed = self.position_ids[None, None, :] <= pos[:, :, None]      # [B, T, S]: causal over the whole slot
        one_slot = k_cache[0].shape[0] == 1                            # a static fact of the cache, not data
        # The residual stream stays fp32 in every precision; matmuls and the cache run in self.dtype.
        dt = self.dtype
        x = self.tp.embed(self.embed, ids).float()
        for i, layer in enumerate(self.layers):
            h = ops.rms_norm(x, layer.input_norm, cfg.norm_eps).to(dt)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = apply_rotary(q.view(b, t, nh, hd), cos, sin).transpose(1, 2)       # BNSD [B, H, T, D]
            k = apply_rotary(k.view(b, t, nkv, hd), cos, sin)                       # keys cached after rotation
            ops.cache_write(k_cache[i], slots, pos, k.transpose(1, 2))
            ops.cache_write(v_cache[i], slots, pos, v.view(b, t, nkv, hd).transpose(1, 2))
            # each row reads its own slot: the cache itself for one slot, else the rows' slots gathered
            kc = k_cache[i] if one_slot else k_cache[i].index_select(0, slots)
            vc = v_cache[i] if one_slot else v_cache[i].index_select(0, slots)
            attn = ops.attention(q, kc, vc, allowed, seq_lens)                     # [B, H, T, D]
            attn = attn.transpose(1, 2).reshape(b, t, cfg.q_size)
            out = self.tp.reduce(F.linear(attn, layer.attn_out).float())
            if layer.post_self_attn_norm is not None:     # on the whole (reduced) output, in fp32
                out = ops.rms_norm(out, layer.post_self_attn_norm, cfg.norm_eps)
            x = x + out
            h = ops.rms_norm(x, layer.post_attn_norm, cfg.norm_eps).to(dt)
            gate, up = F.linear(h, layer.ffn_up).chunk(2, dim=-1)
            out = self.tp.reduce(F.linear(F.silu(gate) * up, layer.ffn_down).float())
            if layer.post_mlp_norm is not None:
                out = ops.rms_norm(out, layer.post_mlp_norm, cfg.norm_eps)
            x = x + out
        x = ops.rms_norm(x, self.final_norm, cfg.norm_eps).to(dt)
        rows = x.gather(1, last[:, None, None].expand(b, 1, x.shape[-1]))[:, 0]     # [B, hidden]
        logits = self.tp.gather(F.linear(rows, self.lm_head).float())
        return logits, x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden rows (all-positions requests, outside the captured step)."""
        return self.tp.gather(F.linear(hidden, self.lm_head).float())
