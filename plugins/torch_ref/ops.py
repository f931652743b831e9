"""The kernel table the shared torch forward (forward.py) calls: RMSNorm, attention, KV-cache update.

The plain PyTorch kernels live here (the reference runs them; so do CUDA and NPUs without fused kernels);
ascend_npu builds its table of torch_npu kernels with the same signatures (its ops.py). Every function is
branch-free on tensor values, so it traces into one graph.

Shapes: a step has B rows of T tokens; each row belongs to one cache slot. Cache layout is BNSD,
[slots, kv_heads, positions, head_dim] per layer. `allowed` [B, T, positions] is True where a query may
attend a key. Per-row KV lengths (`seq_lens`, a host list of ints) go only to kernels that take them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Ops:
    name: str                                  # "torch" | "npu" | "npu-sdpa"
    rms_norm: Callable                         # (x fp32, weight fp32, eps) -> normalized x, fp32
    attention: Callable                        # (q [B,H,T,D], k/v [B,Hkv,S,D], allowed [B,T,S], seq_lens) -> [B,H,T,D]
    cache_write: Callable                      # (cache [slots,Hkv,S,D], rows [B,T], pos [B,T], new [B,Hkv,T,D]) -> None
    kernels: dict = field(default_factory=dict)   # what runs, for the probe and the session report
    seq_lens: bool = False                     # attention wants per-row KV lengths (a host list of ints)
    # MoE experts: (h [N, hidden], chosen [N, k] expert ids, weights [N, k] fp32, up [E, 2F, hidden],
    # down [E, hidden, F]) -> the weighted sum of the chosen experts' SwiGLU outputs [N, hidden]
    experts: Callable = None
    # MoE routing: (cfg, h [N, hidden], router [E, hidden] fp32, correction bias [E] fp32) -> (chosen [N, k],
    # weights [N, k] fp32); torch_route is transformers' computation
    route: Callable = None
    # Decode over a paged cache in place: (q [B,H,1,D], k/v cache [blocks,Hkv,block_size,D], block table [B,M]
    # int32, seq_lens) -> [B,H,1,D]. None: the rows' blocks are gathered (Step.read) for `attention`.
    paged_decode: Callable | None = None

    def __post_init__(self):
        if self.experts is None:
            object.__setattr__(self, "experts", torch_experts)
        if self.route is None:
            object.__setattr__(self, "route", torch_route)


# ---------------------------------------------------------------- plain PyTorch (the reference, CUDA, NPUs without fused kernels)

def torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # F.rms_norm is one fused kernel in eager mode and fuses into its neighbours under inductor.
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def torch_attention(q, k, v, allowed, seq_lens=None):
    # GQA without copying the cache: fold each KV group's query heads into the query-length axis,
    # [B, Hkv*G, T, D] -> [B, Hkv, G*T, D] (rows g-major); the mask rows repeat per group to match.
    b, h, t, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    qg = q.reshape(b, hkv, g * t, d)
    mask = allowed.repeat(1, g, 1)[:, None]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=1.0 / math.sqrt(d))
    return out.reshape(b, h, t, v.shape[-1])          # latent attention's V heads may differ from Q/K's


def torch_cache_write(cache, rows, pos, new):
    # cache[rows[b, t], :, pos[b, t]] = new[b, :, t]: one index_put_ for every row and token, in place (rows: the
    # token's slot, or its physical block on a paged cache). The advanced indices are split by a slice, so the
    # indexed view is [B, T, Hkv, D].
    cache[rows, :, pos] = new.transpose(1, 2)


def torch_experts(h, chosen, weights, up, down):
    # Each chosen expert once, over the tokens that chose it (transformers' loop): reads only the chosen
    # experts, but its shapes depend on the routing, so it runs eager, not under whole-graph capture.
    out = torch.zeros_like(h)
    used = weights != 0             # a row weighing 0 adds nothing (tensor parallel: another rank's expert)
    for e in torch.unique(chosen[used]).tolist():
        token, k = torch.where((chosen == e) & used)
        gate, up_part = F.linear(h[token], up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up_part, down[e]) * weights[token, k, None].to(h.dtype)
        out.index_add_(0, token, y)
    return out


def dense_experts(h, chosen, weights, up, down):
    # Capture-safe: every expert over every token, weighted by a dense [N, E] matrix that is zero where an
    # expert was not chosen. Static shapes at E/k times the expert work: for graphs on hosts without fused
    # MoE kernels (the device path takes torch_npu's grouped-matmul MoE ops instead).
    # scatter_add: rows of other ranks' experts (weight 0) may share an index with a chosen one
    dense = torch.zeros(h.shape[0], up.shape[0], dtype=weights.dtype, device=h.device).scatter_add(1, chosen, weights)
    out = torch.zeros_like(h)
    for e in range(up.shape[0]):
        gate, up_part = F.linear(h, up[e]).chunk(2, dim=-1)
        out = out + F.linear(F.silu(gate) * up_part, down[e]) * dense[:, e, None].to(h.dtype)
    return out


TORCH_KERNELS = {"rms_norm": "torch.nn.functional.rms_norm (fused)",
                 "attention": "torch.nn.functional.scaled_dot_product_attention (masked over the whole cache)",
                 "kv_update": "indexed assignment (index_put_) into the static cache"}


def torch_ops(name: str = "torch", why: str = "") -> Ops:
    kernels = dict(TORCH_KERNELS, **({"why": why} if why else {}))
    return Ops(name, torch_rms_norm, torch_attention, torch_cache_write, kernels)


def torch_route(cfg, h: torch.Tensor, router: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE GLMs' router, as transformers computes it, in fp32: sigmoid scores; the correction bias only for
    choosing (within the topk_group best of n_group groups, each scored by its two best); the chosen experts'
    unbiased scores, renormalised (norm_topk_prob) and scaled. Returns (chosen [N, k], weights [N, k])."""
    scores = torch.sigmoid(F.linear(h.float(), router))                       # [N, E]
    choice = scores + bias
    if cfg.num_groups > 1:
        n, e = choice.shape
        groups = choice.view(n, cfg.num_groups, e // cfg.num_groups)
        best = groups.topk(2, dim=-1)[0].sum(dim=-1)                           # [N, groups]
        keep = torch.zeros_like(best).scatter(1, best.topk(cfg.topk_groups, dim=-1)[1], 1.0).bool()
        choice = groups.masked_fill(~keep[..., None], float("-inf")).view(n, e)
    chosen = choice.topk(cfg.experts_per_token, dim=-1)[1]
    weights = scores.gather(1, chosen)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return chosen, weights * cfg.routed_scaling
