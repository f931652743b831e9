"""The torch forward of each architecture, shared by the torch-based backends: the reference (`torch`,
plain kernels, eager) and `ascend_npu` (torch_npu kernels, captured by torchair or inductor). One module
per architecture's block, looked up by glmcore.arch's `torch_forward` name in FORWARDS; the kernels come
from an Ops table (ops.py), never from the device.

Written for whole-graph capture (torch.compile fullgraph / torchair).

Rules that keep it one static graph: every shape is fixed by the inputs' shapes (B rows of T tokens,
the cache's slots and positions), positions arrive as tensors (never a Python int taken from data),
masks are computed from them, and nothing branches on tensor values. One step serves B rows, each
row a chunk of one sequence (its cache slot): a single sequence is B = 1 over a one-slot cache; a
batch of sequences decodes as B rows of one token. The dense GLM block: RMSNorm, fused QKV + bias, GQA, rotary on the first rotary_dim dims of each head
(interleaved pairs, or NeoX halves where the config says so) from the core's fp32 table, keys cached
after rotation, SwiGLU, the glm4 post norms, final norm, lm_head.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from glmcore.arch.rotary import rotary_tables
from glmcore.config import ModelConfig
from glmcore.parallel import LOCAL
from glmcore.weights import BF16, release

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
    release(arr)        # the mapped pages leave this process's resident memory: the copy is what runs
    return nn.Parameter(t, requires_grad=False)


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype, recording no cast where it is one already (an exported graph gets no no-op Cast nodes)."""
    return x if x.dtype == dtype else x.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """x [..., T, heads, head_dim], cos/sin [..., T, rot/2]; rotate the first rot = rotary_dim dims (ChatGLM/
    GLM-4: half the head, GLM-Edge: all of it) in fp32, as pairs (2i, 2i+1) when interleaved (split by a
    reshape, as the original ChatGLM code does and TPU-MLIR's front end expects), else as the NeoX halves
    (i, i + rot/2); the rest pass through."""
    rot = 2 * cos.shape[-1]
    xf = cast(x, torch.float32)
    if interleaved:
        pairs = xf[..., :rot].reshape(*xf.shape[:-1], rot // 2, 2)
        x0, x1 = pairs[..., 0], pairs[..., 1]
    else:
        x0, x1 = xf[..., :rot // 2], xf[..., rot // 2:rot]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    y0, y1 = x0 * c - x1 * s, x1 * c + x0 * s
    out = torch.stack((y0, y1), dim=-1).reshape(*xf.shape[:-1], rot) if interleaved else torch.cat((y0, y1), dim=-1)
    return cast(torch.cat((out, xf[..., rot:]), dim=-1), x.dtype)


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, weights, p: str, i: int, device, dtype):
        super().__init__()
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


@dataclass
class Step:
    """What every layer's attention of one step shares: positions [B, T], the rows' slots [B], the rotary
    rows of those positions, the causal mask over each slot [B, T, S], per-row KV lengths where the kernels
    take them, whether the cache has one slot (a static fact of its shape, not data), and where each token's
    K/V go: (rows, at) [B, T] index the cache's first and position axes -- the slot and position, or on a paged
    cache (blocks: each row's block table [B, M] int32, block_size positions per block) the physical block and
    the offset in it."""
    pos: torch.Tensor
    slots: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    allowed: torch.Tensor
    seq_lens: list[int] | None
    one_slot: bool
    rows: torch.Tensor
    at: torch.Tensor
    blocks: torch.Tensor | None = None

    def read(self, cache: torch.Tensor) -> torch.Tensor:
        """Each row's own slot of a cache: the cache itself for one slot, else the rows' slots gathered; on a
        paged cache the rows' blocks in order, [B, Hkv, M * block_size, D] (host kernels: a paged kernel reads
        the blocks in place)."""
        if self.blocks is not None:
            b, m = self.blocks.shape
            pages = cache[self.blocks.long()]                                      # [B, M, Hkv, block, D]
            return pages.transpose(1, 2).reshape(b, cache.shape[1], m * cache.shape[2], cache.shape[3])
        return cache if self.one_slot else cache.index_select(0, self.slots)


class DenseBlock(nn.Module):
    """The dense GLM decoder layer's math, once for every torch runtime: the torch forwards below run it over
    their weights and caches, tpu_bm1684x's static graphs export it (with their own norm, linear and attention
    kernels: the hooks `norm` and `linear`). A layer is any object holding the layer's weights under Layer's
    attribute names. The residual stream stays fp32 in every precision; matmuls run in self.dtype."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, ops: Ops | None, tp=LOCAL):
        super().__init__()
        self.cfg, self.dtype, self.ops, self.tp = cfg, dtype, ops, tp

    def block(self, layer, x: torch.Tensor, attend) -> torch.Tensor:
        """One decoder layer on the fp32 residual x [B, T, hidden]; attend(h) is its attention of the normed h."""
        dt, f32 = self.dtype, torch.float32
        out = self.tp.reduce(cast(attend(cast(self.norm(layer, "input_norm", x), dt)), f32))
        if layer.post_self_attn_norm is not None:     # glm4 (GLM-4-0414): on the whole (reduced) output, in fp32
            out = self.norm(layer, "post_self_attn_norm", out)
        x = x + out
        out = self.tp.reduce(cast(self.mlp(layer, cast(self.norm(layer, "post_attn_norm", x), dt)), f32))
        if layer.post_mlp_norm is not None:
            out = self.norm(layer, "post_mlp_norm", out)
        return x + out

    def norm(self, owner, name: str, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm of fp32 x by owner's weight `name`, in fp32."""
        return self.ops.rms_norm(x, getattr(owner, name), self.cfg.norm_eps)

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ w.T (+ bias), w [out, in] as checkpoints store it."""
        return F.linear(x, w, bias)

    def project_qkv(self, layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [B, T, hidden] -> q [B, T, H, D], k and v [B, T, Hkv, D]: fused QKV (+ bias), the q/k norms where
        the architecture has them, the rotary on q and k (keys are cached after rotation)."""
        cfg = self.cfg
        b, t, _ = h.shape
        hd, il = cfg.head_dim, cfg.rotary_interleaved
        q, k, v = self.linear(h, layer.qkv, layer.qkv_bias).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q, k = self.qk_norm(layer, q.reshape(b, t, cfg.num_heads, hd), k.reshape(b, t, cfg.num_kv_heads, hd))
        return apply_rotary(q, cos, sin, il), apply_rotary(k, cos, sin, il), v.reshape(b, t, cfg.num_kv_heads, hd)

    def qk_norm(self, layer, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, T, H, D], k [B, T, Hkv, D] before the rotary: the dense GLM block has no q/k norm."""
        return q, k

    def mlp(self, layer, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear(h, layer.ffn_up).chunk(2, dim=-1)
        return self.linear(F.silu(gate) * up, layer.ffn_down)


class DenseGLM(DenseBlock):
    """Weights on the device in the compute dtype (norm weights in fp32); `forward` is the captured step.
    Under tensor parallelism cfg and weights are this rank's part and `tp` (glmcore.parallel.Shard) joins
    the parts with collectives that trace into the graph; on one device it is LOCAL and does nothing."""

    layer_class = Layer

    def __init__(self, cfg: ModelConfig, weights, device: torch.device, dtype: torch.dtype, ops: Ops, positions: int,
                 tp=LOCAL):
        super().__init__(cfg, dtype, ops, tp)
        self.embed = to_device(weights["embed.weight"], device, dtype)
        self.layers = nn.ModuleList(self.layer_class(cfg, weights, f"layers.{i}.", i, device, dtype)
                                    for i in range(cfg.num_layers))
        self.final_norm = to_device(weights["final_norm.weight"], device, torch.float32)
        self.lm_head = to_device(weights["lm_head.weight"], device, dtype)
        cos, sin = rotary_tables(cfg, np.arange(positions))     # the core's table, fp32
        self.register_buffer("cos", torch.from_numpy(cos).to(device), persistent=False)
        self.register_buffer("sin", torch.from_numpy(sin).to(device), persistent=False)
        self.register_buffer("position_ids", torch.arange(positions, device=device), persistent=False)

    def forward(self, ids: torch.Tensor, start: torch.Tensor, slots: torch.Tensor, last: torch.Tensor,
                k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
                seq_lens: list[int] | None = None, blocks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, T] int64: row b holds tokens at positions start[b]..start[b]+T-1 of cache slot
        slots[b] (start, slots, last: [B] int64). Writes K/V into the static caches in place and returns
        (float32 logits [B, vocab] of each row's token `last[b]`, final hidden states [B, T, hidden]).
        Tokens past a row's real ones are padding; their results are unused. seq_lens: each row's KV
        length start[b]+T as host ints, for kernels that take it (Ops.seq_lens), else None. blocks: on a paged
        cache ([blocks, Hkv, block_size, D] per layer), each row's block table [B, M] int32."""
        b, t = ids.shape
        step = self.make_step(start, slots, t, k_cache[0], seq_lens, blocks)     # what every layer's attention shares
        x = self.tp.embed(self.embed, ids).float()
        for layer, k, v in zip(self.layers, k_cache, v_cache):
            x = self.block(layer, x, lambda h: self.attention(layer, h, step, k, v))
        x = self.norm(self, "final_norm", x).to(self.dtype)
        rows = x.gather(1, last[:, None, None].expand(b, 1, x.shape[-1]))[:, 0]     # [B, hidden]
        logits = self.tp.gather(F.linear(rows, self.lm_head).float())
        return logits, x

    def make_step(self, start: torch.Tensor, slots: torch.Tensor, t: int, cache: torch.Tensor,
             seq_lens: list[int] | None = None, blocks: torch.Tensor | None = None) -> Step:
        """The Step of B rows of t tokens from positions start over a layer's cache (its shape: static facts)."""
        pos = start[:, None] + self.position_ids[:t]                       # [B, T] absolute positions
        if blocks is None:
            rows, at = slots[:, None].expand_as(pos), pos
            positions = cache.shape[2]     # a caller may pass views of the first S positions: every row's keys lie there
        else:
            size = cache.shape[2]          # positions per block
            rows, at = blocks.long().gather(1, pos // size), pos % size
            positions = blocks.shape[1] * size
        allowed = self.position_ids[None, None, :positions] <= pos[:, :, None]     # [B, T, S]: causal over the slot
        one_slot = cache.shape[0] == 1                               # a static fact of the cache, not data
        return Step(pos, slots, self.cos[pos], self.sin[pos], allowed, seq_lens, one_slot, rows, at, blocks)

    def nextn(self, mtp: "NextN", ids: torch.Tensor, start: torch.Tensor, slots: torch.Tensor, hidden: torch.Tensor,
              k_cache: torch.Tensor, v_cache: torch.Tensor,
              seq_lens: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The multi-token-prediction (NextN) layer, as vLLM's glm4_moe_mtp and llama.cpp's glm4-moe MTP compute
        it: at position i it sees the next token ids[i] and the target's final hidden state hidden[i] there
        (its own output for a chained draft), eh_proj(concat(enorm(embed(id)), hnorm(h))) -> one decoder layer
        (its own KV cache) -> the shared head (its own final norm, the model's lm_head). The embedding at
        position 0 is zero (nothing precedes it). Returns (float32 logits [B, vocab] of each row's last
        position, the layer's output [B, T, hidden] before the norm, what a chained draft takes as h). seq_lens: as
        forward's, each row's KV length for kernels that take it."""
        step = self.make_step(start, slots, ids.shape[1], k_cache, seq_lens)
        e = self.tp.embed(self.embed, ids).float().masked_fill((step.pos == 0)[..., None], 0.0)
        joined = torch.cat([self.norm(mtp, "enorm", e), self.norm(mtp, "hnorm", hidden.float())], dim=-1)
        x = self.linear(joined.to(self.dtype), mtp.eh_proj).float()
        x = self.block(mtp.layer, x, lambda h: self.attention(mtp.layer, h, step, k_cache, v_cache))
        out = self.norm(mtp, "final_norm", x[:, -1]).to(self.dtype)
        return self.tp.gather(F.linear(out, self.lm_head).float()), x

    def cache_shapes(self, n_slots: int, positions: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Each layer's K and V cache: BNSD [slots, kv_heads, positions, head_dim], keys stored rotated."""
        shape = (n_slots, self.cfg.num_kv_heads, positions, self.cfg.head_dim)
        return shape, shape

    def attention(self, layer, h: torch.Tensor, step: "Step", k_cache: torch.Tensor, v_cache: torch.Tensor):
        """Grouped-query attention of h [B, T, hidden] over each row's slot; writes the new K/V first."""
        b, t, _ = h.shape
        q, k, v = self.project_qkv(layer, h, step.cos, step.sin)
        self.ops.cache_write(k_cache, step.rows, step.at, k.transpose(1, 2))
        self.ops.cache_write(v_cache, step.rows, step.at, v.transpose(1, 2))
        if t == 1 and step.blocks is not None and self.ops.paged_decode is not None:     # reads the blocks in place
            attn = self.ops.paged_decode(q.transpose(1, 2), k_cache, v_cache, step.blocks, step.seq_lens)
        else:
            attn = self.ops.attention(q.transpose(1, 2), step.read(k_cache), step.read(v_cache), step.allowed,
                                      step.seq_lens)
        return self.linear(attn.transpose(1, 2).reshape(b, t, self.cfg.q_size), layer.attn_out)

    def rerotate(self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Cached keys [P, kv_heads, head_dim] rotated further by the angles cos/sin [P or 1, rot/2] (a StreamingLLM
        shift moves kept keys to their new positions this way)."""
        return apply_rotary(keys, cos, sin, self.cfg.rotary_interleaved)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden rows (all-positions requests, outside the captured step)."""
        return self.tp.gather(F.linear(hidden, self.lm_head).float())


class NextN(nn.Module):
    """A checkpoint's multi-token-prediction layer j (glm4_moe's mtp.j.*, placed by glmcore.arch.glm4_moe):
    its norms of the embedding and of the hidden state, their projection, one decoder layer of the model's
    kind and the shared head's norm (the head is the model's lm_head)."""

    def __init__(self, model: "DenseGLM", weights, j: int, device, dtype):
        super().__init__()
        p, f32 = f"mtp.{j}.", torch.float32
        self.enorm = to_device(weights[p + "enorm.weight"], device, f32)
        self.hnorm = to_device(weights[p + "hnorm.weight"], device, f32)
        self.final_norm = to_device(weights[p + "final_norm.weight"], device, f32)
        self.eh_proj = to_device(weights[p + "eh_proj.weight"], device, dtype)
        self.layer = model.layer_class(model.cfg, weights, p + "layer.", model.cfg.num_layers + j, device, dtype)


class MoeLayer(nn.Module):
    """A glm4_moe decoder layer: attention as the dense block's (plus q/k norms), then a dense MLP or the
    experts (stacked [E, 2F, hidden] / [E, hidden, F], in the compute dtype), the router in fp32."""

    def __init__(self, cfg, weights, p: str, i: int, device, dtype):
        super().__init__()
        f32 = torch.float32
        self.input_norm = to_device(weights[p + "input_norm.weight"], device, f32)
        self.qkv = to_device(weights[p + "qkv.weight"], device, dtype)
        self.qkv_bias = to_device(weights[p + "qkv.bias"], device, dtype) if cfg.qkv_bias else None
        self.attn_out = to_device(weights[p + "attn_out.weight"], device, dtype)
        self.q_norm = to_device(weights[p + "q_norm.weight"], device, f32) if cfg.qk_norm else None
        self.k_norm = to_device(weights[p + "k_norm.weight"], device, f32) if cfg.qk_norm else None
        self.post_attn_norm = to_device(weights[p + "post_attn_norm.weight"], device, f32)
        self.post_self_attn_norm = self.post_mlp_norm = None
        self._mlp(cfg, weights, p, i, device, dtype)

    def _mlp(self, cfg, weights, p: str, i: int, device, dtype):
        f32 = torch.float32
        self.sparse = cfg.sparse_layers[i] if i < cfg.num_layers else True     # past them: a NextN layer
        if not self.sparse:
            self.ffn_up = to_device(weights[p + "ffn_up.weight"], device, dtype)
            self.ffn_down = to_device(weights[p + "ffn_down.weight"], device, dtype)
            return
        self.router = to_device(weights[p + "router.weight"], device, f32)
        self.router_bias = to_device(weights[p + "router.bias"], device, f32)
        # every expert, or under tensor parallelism this rank's run of them (the weights hold only those)
        experts = [e for e in range(cfg.num_experts) if p + f"experts.{e}.ffn_up.weight" in weights]
        self.first_expert = experts[0]
        self.experts_up = nn.Parameter(torch.stack([to_device(weights[p + f"experts.{e}.ffn_up.weight"], device,
                                                              dtype) for e in experts]), requires_grad=False)
        self.experts_down = nn.Parameter(torch.stack([to_device(weights[p + f"experts.{e}.ffn_down.weight"], device,
                                                                dtype) for e in experts]), requires_grad=False)
        shared = cfg.num_shared_experts > 0
        self.shared_up = to_device(weights[p + "shared.ffn_up.weight"], device, dtype) if shared else None
        self.shared_down = to_device(weights[p + "shared.ffn_down.weight"], device, dtype) if shared else None


class Glm4Moe(DenseGLM):
    """GLM-4.5/4.6/4.7: the dense block's attention with q/k norms and NeoX-order rotary (both from the
    config), and the MoE block (the Ops table's route and experts, plus the shared expert)."""
    layer_class = MoeLayer

    def qk_norm(self, layer, q, k):
        if layer.q_norm is None:
            return q, k
        eps = self.cfg.norm_eps
        return (self.ops.rms_norm(q.float(), layer.q_norm, eps).to(q.dtype),
                self.ops.rms_norm(k.float(), layer.k_norm, eps).to(k.dtype))

    def mlp(self, layer, h):
        if not layer.sparse:
            return super().mlp(layer, h)
        shape = h.shape
        flat = h.reshape(-1, shape[-1])
        chosen, weights = self.ops.route(self.cfg, flat, layer.router, layer.router_bias)
        held = layer.experts_up.shape[0]
        if held < self.cfg.num_experts:     # tensor parallel: my experts only, the others' rows weigh 0
            chosen = chosen - layer.first_expert
            mine = (chosen >= 0) & (chosen < held)
            chosen, weights = chosen.clamp(0, held - 1), weights * mine
        out = self.ops.experts(flat, chosen, weights, layer.experts_up, layer.experts_down)
        if layer.shared_up is not None:
            gate, up = F.linear(flat, layer.shared_up).chunk(2, dim=-1)
            out = out + F.linear(F.silu(gate) * up, layer.shared_down)
        return out.view(shape)


class MlaLayer(MoeLayer):
    """A glm4_moe_lite layer: latent attention's projections and norms, then glm4_moe's MLP or experts."""

    def __init__(self, cfg, weights, p: str, i: int, device, dtype):
        get = (lambda name, dt=dtype: to_device(weights[p + name], device, dt) if p + name in weights else None)
        f32 = torch.float32
        nn.Module.__init__(self)
        self.input_norm, self.post_attn_norm = get("input_norm.weight", f32), get("post_attn_norm.weight", f32)
        self.post_self_attn_norm = self.post_mlp_norm = None
        self.q, self.q_a, self.q_a_bias, self.q_b = get("q.weight"), get("q_a.weight"), get("q_a.bias"), get("q_b.weight")
        self.q_a_norm = get("q_a_norm.weight", f32)
        self.kv_a, self.kv_a_bias, self.kv_b = get("kv_a.weight"), get("kv_a.bias"), get("kv_b.weight")
        self.kv_a_norm = get("kv_a_norm.weight", f32)
        self.attn_out, self.attn_out_bias = get("attn_out.weight"), get("attn_out.bias")
        self._mlp(cfg, weights, p, i, device, dtype)


class Glm4MoeLite(Glm4Moe):
    """GLM-4.7-Flash: multi-head latent attention over a latent cache (the normed compressed KV and the
    rotated rope key per token: kv_lora_rank + qk_rope values), expanded through kv_b each step as
    transformers computes it; glm4_moe's MoE block."""
    layer_class = MlaLayer

    def cache_shapes(self, n_slots: int, positions: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        # One latent "head"; V comes from the same latent, so the V cache is a placeholder of one value per slot.
        return (n_slots, 1, positions, self.cfg.latent_size), (n_slots, 1, 1, 1)

    def attention(self, layer, h, step, k_cache, v_cache):
        cfg, ops, dt = self.cfg, self.ops, self.dtype
        b, t, _ = h.shape
        H, nope, rope, R, vd = cfg.num_heads, cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.kv_lora_rank, cfg.v_head_dim
        eps, il = cfg.latent_norm_eps, cfg.rotary_interleaved
        if layer.q_a is not None:
            q_a = ops.rms_norm(F.linear(h, layer.q_a, layer.q_a_bias).float(), layer.q_a_norm, eps).to(dt)
            q = F.linear(q_a, layer.q_b)
        else:
            q = F.linear(h, layer.q)
        q_nope, q_rot = q.view(b, t, H, nope + rope).split([nope, rope], dim=-1)
        c_kv, k_rot = F.linear(h, layer.kv_a, layer.kv_a_bias).split([R, rope], dim=-1)
        c_kv = ops.rms_norm(c_kv.float(), layer.kv_a_norm, eps).to(dt)
        q_rot = apply_rotary(q_rot, step.cos, step.sin, il)
        k_rot = apply_rotary(k_rot.view(b, t, 1, rope), step.cos, step.sin, il)
        ops.cache_write(k_cache, step.rows, step.at, torch.cat((c_kv.view(b, t, 1, R), k_rot), dim=-1).transpose(1, 2))
        latent = step.read(k_cache)[:, 0]                                        # [B, S, R + rope]
        s = latent.shape[1]
        k_nope, v = F.linear(latent[..., :R], layer.kv_b).view(b, s, H, nope + vd).split([nope, vd], dim=-1)
        k = torch.cat((k_nope, latent[:, :, None, R:].expand(b, s, H, rope)), dim=-1)
        q = torch.cat((q_nope, q_rot), dim=-1)
        attn = ops.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), step.allowed, step.seq_lens)
        return F.linear(attn.transpose(1, 2).reshape(b, t, H * vd), layer.attn_out, layer.attn_out_bias)

    def rerotate(self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Cached latents [P, 1, R + rope] re-rotated: only the rope key turns; the compressed KV has no position."""
        R = self.cfg.kv_lora_rank
        return torch.cat((keys[..., :R], apply_rotary(keys[..., R:], cos, sin, self.cfg.rotary_interleaved)), dim=-1)


# The torch forward of each architecture's block, by glmcore.arch's Architecture.torch_forward.
FORWARDS = {"glm": DenseGLM, "glm4_moe": Glm4Moe, "glm4_moe_lite": Glm4MoeLite}
