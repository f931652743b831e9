"""The one place where device-specific kernels are chosen: RMSNorm, attention, KV-cache update.

`select_ops(device, dtype)` decides once, at load, and the model only ever calls the returned Ops.
On an Ascend NPU the fused torch_npu kernels are used (npu_rms_norm, npu_prompt_flash_attention for
prefill, npu_incre_flash_attention for decode, scatter_update_ for the cache); elsewhere the fused
PyTorch equivalents (F.rms_norm, scaled_dot_product_attention, index_copy_). Every function here is
branch-free on tensor values, so it traces into one graph.

Cache layout is BNSD, [1, kv_heads, slots, head_dim] per layer: the sequence is axis -2, the axis
torch_npu.scatter_update_ writes in place (its documented KV-cache use) and the layout the Ascend
flash-attention kernels read without a transpose ("BNSD"); SDPA reads the same layout on CPU/CUDA.

Masks: `allowed` [q, slots] is True where a query may attend a key. The Ascend kernels take the
opposite convention (True/1 = masked out), so the NPU functions pass ~allowed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Ops:
    name: str                                  # "npu" | "torch"
    rms_norm: Callable                         # (x fp32, weight fp32, eps) -> normalized x, fp32
    attention: Callable                        # (q [1,H,T,D], k/v cache [1,Hkv,S,D], allowed [T,S]) -> [1,H,T,D]
    cache_write: Callable                      # (cache [1,Hkv,S,D], pos [T], start [1], new [1,Hkv,T,D]) -> None
    kernels: dict = field(default_factory=dict)   # what runs, for the probe and the session report


# ---------------------------------------------------------------- host / CUDA path

def _torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # F.rms_norm is one fused kernel in eager mode and fuses into its neighbours under inductor.
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    # GQA without copying the cache: fold each KV group's query heads into the query-length axis,
    # [1, Hkv*G, T, D] -> [1, Hkv, G*T, D]; the mask rows repeat per group to match.
    _, h, t, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    qg = q.reshape(1, hkv, g * t, d)
    mask = allowed.repeat(g, 1)[None, None]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=1.0 / math.sqrt(d))
    return out.reshape(1, h, t, d)


def _torch_cache_write(cache: torch.Tensor, pos: torch.Tensor, start: torch.Tensor, new: torch.Tensor) -> None:
    cache.index_copy_(2, pos, new)


# ---------------------------------------------------------------- Ascend NPU path

def _npu_ops(dtype: torch.dtype) -> Ops:
    import torch_npu

    def rms_norm(x, w, eps):
        return torch_npu.npu_rms_norm(x, w, epsilon=eps)[0]

    def attention(q, k, v, allowed):
        _, h, t, d = q.shape
        masked = (~allowed)[None, None].contiguous()          # Ascend: True = does not participate
        common = dict(num_heads=h, scale_value=1.0 / math.sqrt(d), input_layout="BNSD",
                      num_key_value_heads=k.shape[1], atten_mask=masked)
        if t == 1:   # a static shape, decided at trace time: decode uses the incremental kernel
            return torch_npu.npu_incre_flash_attention(q.contiguous(), k, v, **common)
        # sparse_mode 0 with the full mask; pre/next_tokens wide open so the mask alone decides
        return torch_npu.npu_prompt_flash_attention(q.contiguous(), k, v, pre_tokens=2147483647,
                                                    next_tokens=2147483647, sparse_mode=0, **common)

    def cache_write(cache, pos, start, new):
        # writes new[:, :, j] at cache[:, :, start + j] for each batch row, in place (axis -2 = S of BNSD)
        torch_npu.scatter_update_(cache, start, new.contiguous(), -2)

    if dtype == torch.float32:
        # The fused flash-attention kernels take fp16/bf16/int8 only; fp32 keeps exact SDPA math.
        return Ops("npu", rms_norm, _torch_attention, cache_write,
                   {"rms_norm": "torch_npu.npu_rms_norm", "attention": "scaled_dot_product_attention (fp32: "
                    "the NPU flash-attention kernels take fp16/bf16 only)", "kv_update": "torch_npu.scatter_update_"})
    return Ops("npu", rms_norm, attention, cache_write,
               {"rms_norm": "torch_npu.npu_rms_norm",
                "attention": "torch_npu.npu_prompt_flash_attention (prefill) / npu_incre_flash_attention (decode), BNSD",
                "kv_update": "torch_npu.scatter_update_ (axis -2)"})


def select_ops(device: torch.device, dtype: torch.dtype) -> Ops:
    """Choose the kernels for this device and dtype, once."""
    if device.type == "npu":
        return _npu_ops(dtype)
    return Ops("torch", _torch_rms_norm, _torch_attention, _torch_cache_write,
               {"rms_norm": "torch.nn.functional.rms_norm (fused)",
                "attention": "torch.nn.functional.scaled_dot_product_attention",
                "kv_update": "Tensor.index_copy_ (axis 2)"})
