"""The GLM decoder as a stateful OpenVINO model, built node by node with the opset API.

Interface (OpenVINO GenAI's stateful-LLM convention, so openvino_genai.LLMPipeline runs the saved IR):
    input_ids i64[B,T], attention_mask i64[B,past+T], position_ids i64[B,T], beam_idx i32[B] -> logits f32[B,T,V]
The KV cache lives in the model: per layer a key and a value variable [B, kv_heads, L, head_dim], read with
ReadValue (initial value: zero length), reordered by beam_idx, concatenated with the new keys, written back with
Assign. It never crosses the model boundary.

The subgraphs are laid out exactly as OpenVINO's CPU plugin recognises them, so they compile to fused kernels:
  - attention: ReadValue -> Gather(beam_idx) -> Concat -> [Unsqueeze -> Broadcast -> Reshape for grouped KV
    heads] -> ScaledDotProductAttention, the Concat feeding only that and its Assign (StatefulSDPAFusion);
  - rotary: VariadicSplit of the fused QKV -> Reshape -> Transpose -> split rotary half -> pairs (2i, 2i+1)
    -> cos/sin from a [B, T, rot/2, 2] table (RoPEFusionChatGLM, 2-D variant of GLM-4 in the batch-first layout);
  - RMSNorm: gamma * (x * 1/Sqrt(ReduceMean(x^2) + eps)) (RMSFusion);
  - compressed weights: i8/i4 Constant -> Convert -> Multiply(Convert(f16 scale)) [-> Reshape for groups]
    -> MatMul (the CPU plugin's FullyConnected with decompression), f16 Constant -> Convert -> MatMul; the
    embedding table u8 -> Convert -> Subtract(zero point) -> Multiply(scale), gathered compressed.
tests/test_openvino_amx.py checks on the compiled runtime model that every one of these fusions happened.

The MoE GLMs (glm4_moe, glm4_moe_lite): the router in f32 in the graph, the (token, expert) pairs sorted by
expert into opset17's GroupedMatMul over each layer's stacked experts (the CPU plugin's GatherMatmul computes
only the experts present, on the i8/i4 weights); glm4_moe_lite's latent attention keeps a latent KV state with
kv_b absorbed into the query and the output (_latent_attention). tests/test_openvino_moe.py holds both to
transformers and to the torch reference.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino.op.util import Variable, VariableInfo

from glmcore.arch.rotary import rotary_tables
from glmcore.config import ModelConfig

from .quant import dequantize, dequantize_sym, quantize_asym, quantize_sym

I32, I64, F32 = ov.Type.i32, ov.Type.i64, ov.Type.f32
WEIGHT_FORMATS = ("f32", "f16", "int8", "int4")
LM_HEAD = "lm_head"          # friendly name of the output MatMul; the session slices its input


def _c(value, dtype=np.int64) -> ov.Node:
    return ops.constant(np.array(value, dtype=dtype))


# the weights stored in the chosen format (the rest, norms, biases and the MoE router, stay f32)
MATRICES = ("embed.weight", "qkv.weight", "attn_out.weight", "ffn_up.weight", "ffn_down.weight", "lm_head.weight",
            ".q.weight", "q_a.weight", "q_b.weight", "kv_a.weight", "kv_b.weight", "eh_proj.weight")


class WeightNodes:
    """Turns canonical weights into decompression subgraphs for one weight format."""

    def __init__(self, weights, fmt: str, group_size: int):
        self.w, self.fmt, self.group_size = weights, fmt, group_size

    def _const(self, array: np.ndarray) -> ov.Node:
        array = np.ascontiguousarray(array)
        if not array.flags.writeable:     # a memory-mapped checkpoint tensor: OpenVINO wants its own copy
            array = array.copy()
        return ov.op.Constant(array, shared_memory=True)

    def _int(self, names: list[str], bits: int, group: int | None, sym: bool) -> ov.Output:
        """The matrices `names` [out, in] quantized alike, as one decompression subgraph: [out, in] for one name,
        [len(names), out, in] for a stack (the experts of a layer)."""
        stack = (lambda parts: parts[0]) if len(names) == 1 else (lambda parts: np.stack(parts))
        # one f32 matrix at a time: a layer's experts are held quantized only
        if sym:     # i8 / i4 (two values a byte, low nibble first) times an f16 scale
            qs, scales = zip(*(quantize_sym(self.w.f32(n), bits, group) for n in names))
            q, scale = stack(qs), stack(scales)
            wq = self._const(q) if bits == 8 else _4bit_const(q, ov.Type.i4)
            deq = ops.multiply(ops.convert(wq, F32), ops.convert(self._const(scale), F32))
        else:       # u8 / u4 minus a zero point, times an f32 scale
            qs, scales, zeros = zip(*(quantize_asym(self.w.f32(n), bits, group) for n in names))
            q, scale, zero = stack(qs), stack(scales), stack(zeros)
            wq, zq = (self._const(q), self._const(zero)) if bits == 8 else (_4bit_const(q), _4bit_const(zero))
            deq = ops.multiply(ops.subtract(ops.convert(wq, F32), ops.convert(zq, F32)), self._const(scale))
        if group is not None:   # [.., out, groups, group] -> [.., out, in]
            deq = ops.reshape(deq, _c(q.shape[:-2] + (q.shape[-2] * q.shape[-1],)), special_zero=False)
        return deq.output(0)

    def scheme(self, name: str) -> tuple[int, int | None, bool] | str:
        """How the weight `name` is stored: "f32", "f16", or (bits, group, symmetric)."""
        return storage(name, self.w[name].shape[1], self.fmt, self.group_size)

    def matrix(self, name: str) -> ov.Output:
        """The weight [out, in] (or the embedding table [vocab, hidden]) as f32 output of its decompression."""
        return self.stack([name])

    def stack(self, names: list[str]) -> ov.Output:
        """Matrices of one shape (one name: [out, in]; several: [len(names), out, in], a layer's experts for
        GroupedMatMul), each stored as matrix() stores it alone."""
        scheme = self.scheme(names[0])
        if scheme in ("f32", "f16"):
            ws = [self.w.f32(n) for n in names]
            w = ws[0] if len(ws) == 1 else np.stack(ws)
            if scheme == "f32":
                return self._const(w).output(0)
            return ops.convert(self._const(w.astype(np.float16)), F32).output(0)
        return self._int(names, *scheme)

    def effective(self, name: str) -> np.ndarray:
        """The f32 values the compiled model computes with for `name` (for conformance)."""
        scheme = self.scheme(name) if name.endswith(MATRICES) else "f32"
        if scheme == "f32":
            return self.w.f32(name)
        if scheme == "f16":
            return self.w.f32(name).astype(np.float16).astype(np.float32)
        bits, group, sym = scheme
        w = self.w.f32(name)
        return dequantize_sym(*quantize_sym(w, bits, group)) if sym else dequantize(*quantize_asym(w, bits, group))

    def vector(self, name: str) -> ov.Node:
        return self._const(self.w.f32(name))


def storage(name: str, in_features: int, fmt: str, group_size: int) -> tuple[int, int | None, bool] | str:
    """How the matrix `name` [out, in_features] is stored in weight format `fmt`: "f32", "f16", or (bits, group,
    symmetric)."""
    if fmt in ("f32", "f16"):
        return fmt
    if name == "embed.weight":      # a row lookup: u8 per row, gathered compressed
        return 8, None, False
    # int4 keeps the output layer in int8 (as NNCF does by default): the most sensitive layer
    if fmt == "int8" or name == "lm_head.weight":
        return 8, None, True
    return 4, group_for(in_features, group_size), True


def decode_weight_bytes(cfg: ModelConfig, tensors: dict, fmt: str, group_size: int) -> int:
    """The weight bytes one decode step reads, as the graph stores them (tensors: the architecture's name ->
    TensorSpec): one embedding row; of the routed experts, the share a token chooses (GatherMatmul reads only
    those); every other matrix whole with its scales; norms, biases and the router in f32."""
    total = 0.0
    for name, spec in tensors.items():
        shape = spec.shape
        n = int(np.prod(shape))
        if not name.endswith(MATRICES):
            total += 4 * n
            continue
        scheme = storage(name, shape[1], fmt, group_size)
        if scheme in ("f32", "f16"):
            size = n * (4 if scheme == "f32" else 2)
        else:
            bits, group, sym = scheme
            scales = shape[0] * (shape[1] // group if group else 1)
            size = n * bits / 8 + scales * (2 if sym else 5)      # f16 scale, or f32 scale and a u8 zero point
        if name == "embed.weight":
            size /= shape[0]
        elif ".experts." in name:
            size *= cfg.experts_per_token / cfg.num_experts
        total += size
    return int(total)


def group_for(in_features: int, group_size: int) -> int | None:
    """The int4 group of a layer: group_size where it divides the input width (every real GLM layer), else the
    largest power-of-two fraction of it that does, at least 16 and at most half the width: group-wise means at
    least two groups a row (one group a row is per-channel int4, far lossier). None (per-channel) if none fits."""
    g = group_size
    while g > in_features // 2:    # a power of two: OpenVINO 2026.4's CPU int4 kernel computes wrong results
        g //= 2                    # for a group of 80 or 40 when few tokens go through (decode)
    while g >= 16:
        if in_features % g == 0:
            return g
        g //= 2
    return None


def _4bit_const(q: np.ndarray, kind: ov.Type = ov.Type.u4) -> ov.Node:
    # copied: a Constant sharing an ov.Tensor's memory does not keep the numpy buffer alive
    return ov.op.Constant(ov.Tensor(_pack_4bit(q), ov.Shape(list(q.shape)), kind), shared_memory=False)


def _pack_4bit(q: np.ndarray) -> np.ndarray:
    flat = q.reshape(-1).astype(np.uint8)      # i4: two's complement, so the low nibble is the value
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    return (flat[0::2] & 0xF) | (flat[1::2] << 4)


def rotary_table(cfg: ModelConfig) -> np.ndarray:
    """[max_seq_len, rot/2, 2] (cos, sin) in fp32, as the reference computes them. A table gathered by position
    (not angles computed from float positions in the graph) keeps positions exact when the plugin runs bf16."""
    cos, sin = rotary_tables(cfg, np.arange(cfg.max_seq_len))       # the core's table
    return np.stack([cos, sin], axis=-1)


def _rms_norm(x: ov.Output, gamma: ov.Node, eps: float) -> ov.Output:
    mean = ops.reduce_mean(ops.power(x, _c(2.0, np.float32)), _c([-1]), keep_dims=True)
    inv = ops.divide(_c(1.0, np.float32), ops.sqrt(ops.add(mean, _c(eps, np.float32))))
    return ops.multiply(gamma, ops.multiply(x, inv)).output(0)


def _linear(x: ov.Output, w: ov.Output, name: str = "") -> ov.Output:
    mm = ops.matmul(x, w, transpose_a=False, transpose_b=True)
    if name:
        mm.set_friendly_name(name)
    return mm.output(0)


def _rotary(split: ov.Node, index: int, heads: int, cfg: ModelConfig,
            cos_sin: ov.Output, seq_len: ov.Output) -> ov.Output:
    """Rotate the first rotary_dim dims of each head in interleaved pairs (ChatGLM/GLM-4: half the head,
    GLM-Edge: all of it); returns [B, heads, T, head_dim]."""
    rot, hd = cfg.rotary_dim, cfg.head_dim
    x = ops.reshape(split.output(index), _c([0, 0, heads, hd]), special_zero=True)
    x = ops.transpose(x, _c([0, 2, 1, 3]))
    # Split even when nothing passes through (GLM-Edge: rot == hd, a zero-width second part): the CPU plugin's
    # RoPEFusionChatGLM matches this split, and fuses the whole-head rotation too.
    halves = ops.variadic_split(x, _c(3), _c([rot, hd - rot]))
    pairs = ops.reshape(halves.output(0), _c([0, heads, 0, rot // 2, 2]), special_zero=True)
    x_even = ops.gather(pairs, _c(0), _c(-1))
    x_odd = ops.gather(pairs, _c(1), _c(-1))
    # cos/sin [B, 1, T, rot/2, 2]: the table rows of this call's positions
    table = ops.slice(cos_sin, _c([0], np.int32), seq_len, _c([1], np.int32), _c([1], np.int32))
    shape = ops.concat([_c([-1], np.int32), _c([1], np.int32), seq_len, _c([rot // 2], np.int32),
                        _c([2], np.int32)], 0)
    table = ops.reshape(table, shape, special_zero=False)
    cos = ops.gather(table, _c(0), _c(-1))
    sin = ops.gather(table, _c(1), _c(-1))
    y_even = ops.add(ops.multiply(x_even, cos), ops.multiply(ops.multiply(x_odd, sin), _c(-1.0, np.float32)))
    y_odd = ops.add(ops.multiply(x_odd, cos), ops.multiply(x_even, sin))
    y = ops.concat([ops.unsqueeze(y_even, _c(-1)), ops.unsqueeze(y_odd, _c(-1))], -1)
    y = ops.reshape(y, _c([0, heads, 0, rot]), special_zero=True)
    return ops.concat([y, halves.output(1)], -1).output(0)


class _Step:
    """What every layer of one call shares: the batch size, the rotary table rows of the input positions, the
    attention mask, beam_idx, and the state's Assign nodes (the model's sinks)."""

    def __init__(self, cfg: ModelConfig, input_ids: ov.Output, attention_mask: ov.Output, position_ids: ov.Output,
                 beam_idx: ov.Output):
        ids_shape = ops.shape_of(input_ids, I64)
        self.batch = ops.gather(ids_shape, _c([0]), _c(0))
        self.seq_len = ops.gather(ops.shape_of(input_ids, I32), _c([1], np.int32), _c(0))
        self.beam_idx, self.sinks, self._init = beam_idx, [], {}
        # cos/sin of each input position [B, T, rot/2, 2]
        self.cos_sin = ops.gather(ov.op.Constant(rotary_table(cfg), shared_memory=True), position_ids, _c(0))
        # additive attention mask [B, 1, T, L]: query t (absolute position L-T+t) sees keys 0..L-T+t not padded
        total = ops.gather(ops.shape_of(attention_mask, I64), _c(1), _c(0))
        t_len = ops.gather(ids_shape, _c(1), _c(0))
        key_pos = ops.range(_c(0), total, _c(1), I64)
        query_pos = ops.range(ops.subtract(total, t_len), total, _c(1), I64)
        causal = ops.less_equal(ops.unsqueeze(key_pos, _c(0)), ops.unsqueeze(query_pos, _c(1)))       # [T, L]
        keep = ops.logical_and(ops.unsqueeze(causal, _c([0, 1])),
                               ops.unsqueeze(ops.greater(attention_mask, _c(0)), _c([1, 2])))          # [B,1,T,L]
        self.mask = ops.select(keep, _c(0.0, np.float32), _c(np.finfo(np.float32).min, np.float32)).output(0)

    def cos_sin_heads(self) -> tuple[ov.Output, ov.Output]:
        """cos, sin [B, 1, T, rot/2]: broadcast over heads."""
        table = ops.unsqueeze(self.cos_sin, _c(1))
        return ops.gather(table, _c(0), _c(-1)).output(0), ops.gather(table, _c(1), _c(-1)).output(0)

    def kv_cache(self, new: ov.Output, layer: int, kind: str, heads: int, dim: int) -> ov.Output:
        """past (state [B, heads, L, dim]) reordered by beam_idx ++ new along the sequence axis; the result is
        written back. The state starts at zero length, so a fresh or reset state is empty."""
        if (heads, dim) not in self._init:
            self._init[heads, dim] = ops.broadcast(_c(0.0, np.float32), ops.concat([self.batch, _c([heads, 0, dim])], 0))
        info = VariableInfo()
        info.variable_id = f"past_key_values.{layer}.{kind}present.{layer}.{kind}"
        info.data_type = F32
        info.data_shape = ov.PartialShape([-1, heads, -1, dim])
        var = Variable(info)
        past = ops.read_value(self._init[heads, dim], var)
        present = ops.concat([ops.gather(past, self.beam_idx, _c(0)), new], 2)
        self.sinks.append(ops.assign(present, var))
        return present.output(0)


def _expand_kv(kv: ov.Output, heads: int, kv_heads: int, dim: int) -> ov.Output:
    """[B, kv_heads, L, dim] -> [B, heads, L, dim] (each KV head serves heads/kv_heads query heads, in order)."""
    group = heads // kv_heads
    if group == 1:
        return kv
    x = ops.unsqueeze(kv, _c(2))
    x = ops.broadcast(x, _c([1, 1, group, 1, 1]), broadcast_spec="BIDIRECTIONAL")
    return ops.reshape(x, _c([0, heads, -1, dim]), special_zero=True).output(0)


def _heads(x: ov.Output, heads: int, dim: int) -> ov.Output:
    """[B, T, heads * dim] -> [B, heads, T, dim]."""
    return ops.transpose(ops.reshape(x, _c([0, 0, heads, dim]), special_zero=True), _c([0, 2, 1, 3])).output(0)


def _merge_heads(x: ov.Output, width: int) -> ov.Output:
    """[B, heads, T, dim] -> [B, T, heads * dim]."""
    return ops.reshape(ops.transpose(x, _c([0, 2, 1, 3])), _c([0, 0, width]), special_zero=True).output(0)


def _rotate(x: ov.Output, cos: ov.Output, sin: ov.Output, dim: int, rot: int, interleaved: bool) -> ov.Output:
    """x [B, heads, T, dim] with its first `rot` dims rotated, as pairs (2i, 2i+1) where interleaved, else as the
    NeoX halves (i, i + rot/2); the rest pass through. cos/sin [B, 1, T, rot/2]."""
    parts = ops.variadic_split(x, _c(-1), _c([rot, dim - rot])) if dim > rot else None
    r = parts.output(0) if parts is not None else x
    if interleaved:
        pairs = ops.reshape(r, _c([0, 0, 0, rot // 2, 2]), special_zero=True)
        x0, x1 = ops.gather(pairs, _c(0), _c(-1)), ops.gather(pairs, _c(1), _c(-1))
    else:
        halves = ops.variadic_split(r, _c(-1), _c([rot // 2, rot // 2]))
        x0, x1 = halves.output(0), halves.output(1)
    y0 = ops.subtract(ops.multiply(x0, cos), ops.multiply(x1, sin))
    y1 = ops.add(ops.multiply(x1, cos), ops.multiply(x0, sin))
    if interleaved:
        y = ops.reshape(ops.concat([ops.unsqueeze(y0, _c(-1)), ops.unsqueeze(y1, _c(-1))], -1),
                        _c([0, 0, 0, rot]), special_zero=True)
    else:
        y = ops.concat([y0, y1], -1)
    return (ops.concat([y, parts.output(1)], -1) if parts is not None else y).output(0)


def _attention(h: ov.Output, W: WeightNodes, p: str, i: int, cfg: ModelConfig, step: _Step) -> ov.Output:
    """Grouped-query attention (dense GLM, glm4_moe): fused QKV (+ bias), glm4_moe's per-head q/k RMSNorm,
    the rotary (the dense GLM's in the pattern the CPU plugin fuses), keys cached after rotation."""
    H, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = _linear(h, W.matrix(p + "qkv.weight"))
    if cfg.qkv_bias:
        qkv = ops.add(qkv, W.vector(p + "qkv.bias")).output(0)
    split = ops.variadic_split(qkv, _c(-1), _c([cfg.q_size, cfg.kv_size, cfg.kv_size]))
    if cfg.arch == "glm":
        q = _rotary(split, 0, H, cfg, step.cos_sin, step.seq_len)
        k = _rotary(split, 1, Hkv, cfg, step.cos_sin, step.seq_len)
    else:
        q, k = _heads(split.output(0), H, hd), _heads(split.output(1), Hkv, hd)
        if getattr(cfg, "qk_norm", False):    # over each head's dims, before the rotary
            q = _rms_norm(q, W.vector(p + "q_norm.weight"), cfg.norm_eps)
            k = _rms_norm(k, W.vector(p + "k_norm.weight"), cfg.norm_eps)
        cos, sin = step.cos_sin_heads()
        q = _rotate(q, cos, sin, hd, cfg.rotary_dim, cfg.rotary_interleaved)
        k = _rotate(k, cos, sin, hd, cfg.rotary_dim, cfg.rotary_interleaved)
    v = _heads(split.output(2), Hkv, hd)
    keys = _expand_kv(step.kv_cache(k, i, "key", Hkv, hd), H, Hkv, hd)
    values = _expand_kv(step.kv_cache(v, i, "value", Hkv, hd), H, Hkv, hd)
    attn = ops.scaled_dot_product_attention(q, keys, values, step.mask, causal=False)      # [B, heads, T, hd]
    return _linear(_merge_heads(attn, cfg.q_size), W.matrix(p + "attn_out.weight"))


def _latent_attention(h: ov.Output, W: WeightNodes, p: str, i: int, cfg, step: _Step) -> ov.Output:
    """glm4_moe_lite's multi-head latent attention over a latent cache, kv_b absorbed: the cached keys are
    [c_kv | k_rope] (kv_lora_rank + qk_rope per token: one KV head every query head attends), each head's query
    is [q_nope W_uk | q_rope] and its value the latent c_kv, expanded by W_uv after attention. Equal to
    transformers' per-head k_nope = W_uk c_kv, v = W_uv c_kv; the scale stays 1/sqrt(qk_nope + qk_rope).
    The cache holds c_kv twice (in the key [c_kv | k_rope] and as the value): OpenVINO's attention takes its
    keys and values as two states. (The key state as the value too, its output's first kv_lora_rank dims kept, is
    exact but measured worse: the stateful attention is then not fused, and the paged form keeps two key-wide
    caches.)"""
    H, nope, rope, R, vd = cfg.num_heads, cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.kv_lora_rank, cfg.v_head_dim
    eps = cfg.latent_norm_eps

    def linear(x, name):
        y = _linear(x, W.matrix(p + name + ".weight"))
        return ops.add(y, W.vector(p + name + ".bias")).output(0) if p + name + ".bias" in W.w else y
    if cfg.q_lora_rank:
        q = linear(_rms_norm(linear(h, "q_a"), W.vector(p + "q_a_norm.weight"), eps), "q_b")
    else:
        q = linear(h, "q")
    q_nope, q_rope = ops.variadic_split(_heads(q, H, nope + rope), _c(-1), _c([nope, rope])).outputs()
    c_kv, k_rope = ops.variadic_split(linear(h, "kv_a"), _c(-1), _c([R, rope])).outputs()
    c_kv = ops.unsqueeze(_rms_norm(c_kv, W.vector(p + "kv_a_norm.weight"), eps), _c(1))     # [B, 1, T, R]
    cos, sin = step.cos_sin_heads()
    il = cfg.rotary_interleaved
    q_rope = _rotate(q_rope, cos, sin, rope, rope, il)
    k_rope = _rotate(ops.unsqueeze(k_rope, _c(1)).output(0), cos, sin, rope, rope, il)
    kv_b = ops.reshape(W.matrix(p + "kv_b.weight"), _c([H, nope + vd, R]), special_zero=False)
    w_uk, w_uv = ops.variadic_split(kv_b, _c(1), _c([nope, vd])).outputs()                  # [H, nope|vd, R]
    query = ops.concat([ops.matmul(q_nope, w_uk, False, False), q_rope], -1)                # [B, H, T, R+rope]
    keys = step.kv_cache(ops.concat([c_kv, k_rope], -1).output(0), i, "key", 1, R + rope)
    values = step.kv_cache(c_kv.output(0), i, "value", 1, R)
    attn = ops.scaled_dot_product_attention(query, _expand_kv(keys, H, 1, R + rope), _expand_kv(values, H, 1, R),
                                            step.mask, _c(1.0 / np.sqrt(nope + rope), np.float32), causal=False)
    out = ops.matmul(attn, w_uv, False, True)                                               # [B, H, T, vd]
    return linear(_merge_heads(out, H * vd), "attn_out")


def _mlp(h: ov.Output, W: WeightNodes, p: str, width: int) -> ov.Output:
    """SwiGLU: ffn_up holds the gate rows, then the up rows."""
    gate_up = ops.variadic_split(_linear(h, W.matrix(p + "ffn_up.weight")), _c(-1), _c([width, width]))
    act = ops.multiply(ops.swish(gate_up.output(0)), gate_up.output(1))                   # silu(gate) * up
    return _linear(act, W.matrix(p + "ffn_down.weight"))


def _moe(h: ov.Output, W: WeightNodes, p: str, cfg) -> ov.Output:
    """The MoE block as transformers computes it. The router in f32: sigmoid scores; the correction bias only for
    choosing (within the topk_group best of n_group groups, each scored by the sum of its two best); the chosen
    experts' unbiased scores, renormalised (norm_topk_prob) and scaled. The N*k (token, expert) pairs are then
    sorted by expert so that GroupedMatMul (offsets: the cumulative count per expert) runs each chosen expert
    once over its rows (the CPU plugin's GatherMatmul computes only the experts present), weighted, put back in
    (token, k) order and summed per token; the shared expert is added."""
    from openvino.opset17 import grouped_matmul     # OpenVINO 2026: supports() refuses MoE checkpoints without it
    E, k, F, G = cfg.num_experts, cfg.experts_per_token, cfg.moe_ffn_hidden_size, cfg.num_groups
    flat = ops.reshape(h, _c([-1, cfg.hidden_size]), special_zero=False).output(0)          # [N, hidden]
    scores = ops.sigmoid(_linear(flat, W.vector(p + "router.weight").output(0)))             # [N, E]
    choice = ops.add(scores, W.vector(p + "router.bias")).output(0)
    if G > 1:
        groups = ops.reshape(choice, _c([0, G, E // G]), special_zero=True)
        best = ops.reduce_sum(ops.topk(groups, _c(2), -1, "max", "value").output(0), _c(-1))      # [N, G]
        top = ops.topk(best, _c(cfg.topk_groups), -1, "max", "value").output(1)
        keep = ops.reduce_max(ops.one_hot(top, _c(G), _c(1.0, np.float32), _c(0.0, np.float32), -1), _c(1))
        keep = ops.greater(ops.unsqueeze(keep, _c(-1)), _c(0.0, np.float32))                # [N, G, 1]
        choice = ops.reshape(ops.select(keep, groups, _c(-np.inf, np.float32)),
                             _c([0, E]), special_zero=True).output(0)
    chosen = ops.topk(choice, _c(k), -1, "max", "value").output(1)                          # [N, k] i32
    weights = ops.gather_elements(scores, chosen, 1)
    if cfg.norm_topk_prob:
        weights = ops.divide(weights, ops.add(ops.reduce_sum(weights, _c([-1]), True), _c(1e-20, np.float32)))
    weights = ops.multiply(weights, _c(cfg.routed_scaling, np.float32))
    expert = ops.reshape(chosen, _c([-1]), special_zero=False)                                # [N*k]
    pairs = ops.squeeze(ops.shape_of(expert, I32), _c(0))
    order, offsets = _by_expert(expert, pairs, E)
    rows = ops.gather(flat, ops.divide(order, _c(k, np.int32)), _c(0))                      # [N*k, hidden]
    names = [p + f"experts.{e}." for e in range(E)]
    gate_up = ops.variadic_split(grouped_matmul(rows, W.stack([n + "ffn_up.weight" for n in names]), offsets),
                                 _c(-1), _c([F, F]))
    act = ops.multiply(ops.swish(gate_up.output(0)), gate_up.output(1))
    down = grouped_matmul(act, W.stack([n + "ffn_down.weight" for n in names]), offsets)   # [N*k, hidden]
    down = ops.multiply(down, ops.unsqueeze(ops.gather(ops.reshape(weights, _c([-1]), False), order, _c(0)), _c(1)))
    inverse = ops.scatter_update(ops.broadcast(_c(0, np.int32), ops.shape_of(order)), order,
                                 ops.range(_c(0, np.int32), pairs, _c(1, np.int32), I32), _c(0))
    out = ops.reduce_sum(ops.reshape(ops.gather(down, inverse, _c(0)), _c([-1, k, cfg.hidden_size]), False), _c(1))
    if cfg.num_shared_experts:
        out = ops.add(out, _mlp(flat, W, p + "shared.", F * cfg.num_shared_experts))
    return ops.reshape(out, ops.shape_of(h), special_zero=False).output(0)


def _by_expert(expert: ov.Output, pairs: ov.Output, n_experts: int) -> tuple[ov.Output, ov.Output]:
    """The (token, k) pairs' expert ids [N*k] -> (order: the pairs sorted by expert, stably; offsets [E] i64:
    GroupedMatMul's cumulative end of each expert's rows, the count of pairs with an expert <= e)."""
    order = ops.topk(expert, pairs, 0, "min", "value", stable=True).output(1)
    offsets = ops.reduce_sum(ops.convert(ops.less_equal(ops.unsqueeze(expert, _c(1)),
                                                        _c(np.arange(n_experts)[None], np.int32)), I64), _c(0))
    return order, offsets.output(0)


def _inputs() -> list:
    """The stateful model's inputs (OpenVINO GenAI's names): input_ids, attention_mask, position_ids, beam_idx."""
    params = [ops.parameter([-1, -1], I64, name="input_ids"), ops.parameter([-1, -1], I64, name="attention_mask"),
              ops.parameter([-1, -1], I64, name="position_ids"), ops.parameter([-1], I32, name="beam_idx")]
    for p in params:
        p.output(0).get_tensor().set_names({p.get_friendly_name()})
    return params


def _decoder_layer(x: ov.Output, W: WeightNodes, p: str, i: int, cfg: ModelConfig, step: _Step,
                   sparse: bool) -> ov.Output:
    """One decoder layer (weights under prefix p, state index i) on the residual x: attention of the
    architecture's kind, then the MoE block (sparse) or the dense MLP."""
    attention = _latent_attention if cfg.arch == "glm4_moe_lite" else _attention
    out = attention(_rms_norm(x, W.vector(p + "input_norm.weight"), cfg.norm_eps), W, p, i, cfg, step)
    if cfg.post_norms:      # glm4: the sublayer output is normed before the add (the same RMSNorm pattern)
        out = _rms_norm(out, W.vector(p + "post_self_attn_norm.weight"), cfg.norm_eps)
    x = ops.add(x, out).output(0)
    h = _rms_norm(x, W.vector(p + "post_attn_norm.weight"), cfg.norm_eps)
    out = _moe(h, W, p, cfg) if sparse else _mlp(h, W, p, cfg.ffn_hidden_size)
    if cfg.post_norms:
        out = _rms_norm(out, W.vector(p + "post_mlp_norm.weight"), cfg.norm_eps)
    return ops.add(x, out).output(0)


def _logits(x: ov.Output, W: WeightNodes, norm: str, eps: float) -> ov.Node:
    """The output layer on the hidden states x normed by the weight `norm`: the Result `logits`."""
    logits = _linear(_rms_norm(x, W.vector(norm), eps), W.matrix("lm_head.weight"), LM_HEAD)
    result = ops.result(logits)
    result.output(0).get_tensor().set_names({"logits"})
    return result


def build_model(cfg: ModelConfig, weights, fmt: str = "f32", group_size: int = 128,
                progress: Callable[[str], None] | None = None) -> ov.Model:
    """The decoder layers 0..num_layers-1 (a checkpoint's NextN layers, mtp.*, are not decoder layers: see
    build_nextn_model)."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}")
    W = WeightNodes(weights, fmt, group_size)
    say = progress or (lambda msg: None)
    params = _inputs()
    input_ids, attention_mask, position_ids, beam_idx = params
    step = _Step(cfg, input_ids, attention_mask, position_ids, beam_idx)
    sparse = getattr(cfg, "sparse_layers", (False,) * cfg.num_layers)

    say("embedding")
    x = ops.gather(W.matrix("embed.weight"), input_ids, _c(0)).output(0)   # [B, T, hidden]
    for i in range(cfg.num_layers):
        say(f"layer {i + 1}/{cfg.num_layers}")
        x = _decoder_layer(x, W, f"layers.{i}.", i, cfg, step, sparse[i])
    say("output layer")
    return ov.Model([_logits(x, W, "final_norm.weight", cfg.norm_eps)], step.sinks, params, f"glm-{cfg.family}")


def build_nextn_model(cfg: ModelConfig, weights, fmt: str = "f32", group_size: int = 128) -> ov.Model:
    """The checkpoint's multi-token-prediction (NextN) layer mtp.0 as a stateful model of its own, as the torch
    reference computes it (plugins/torch_ref/forward.py DenseGLM.nextn): at position i it sees the next token
    input_ids[i] and the target's final hidden state `hidden` [B, T, hidden] there (after the final norm: the
    output layer's input; for a chained draft its own output): eh_proj(concat(enorm(embed(id)), hnorm(h))) -> one decoder layer of the model's kind (the MoE
    block on the MoE GLMs; its own KV state) -> its final norm -> the model's lm_head. The embedding at position
    0 is zero. Outputs: logits [B, T, vocab], and the layer's output [B, T, hidden] before the norm (`hidden`)."""
    W = WeightNodes(weights, fmt, group_size)
    params = _inputs()
    input_ids, attention_mask, position_ids, beam_idx = params
    hidden = ops.parameter([-1, -1, cfg.hidden_size], F32, name="hidden")
    hidden.output(0).get_tensor().set_names({"hidden"})
    step = _Step(cfg, input_ids, attention_mask, position_ids, beam_idx)
    p = "mtp.0."
    e = ops.gather(W.matrix("embed.weight"), input_ids, _c(0))
    e = ops.select(ops.unsqueeze(ops.equal(position_ids, _c(0)), _c(-1)), _c(0.0, np.float32), e)
    joined = ops.concat([_rms_norm(e.output(0), W.vector(p + "enorm.weight"), cfg.norm_eps),
                         _rms_norm(hidden.output(0), W.vector(p + "hnorm.weight"), cfg.norm_eps)], -1)
    x = _linear(joined.output(0), W.matrix(p + "eh_proj.weight"))
    x = _decoder_layer(x, W, p + "layer.", cfg.num_layers, cfg, step, getattr(cfg, "num_experts", 0) > 0)
    out = ops.result(x)
    out.output(0).get_tensor().set_names({"hidden_out"})
    return ov.Model([_logits(x, W, p + "final_norm.weight", cfg.norm_eps), out], step.sinks, params + [hidden], "glm-nextn")


def add_logits_start(model: ov.Model) -> ov.Model:
    """Add an input `logits_start` i64[1] that slices the hidden states before the output layer, so a prefill
    that needs only the last position's logits pays for one row of the (large) output layer, while
    conformance still gets every position's logits (logits_start=0). Done in memory on the IR read from disk:
    the saved IR keeps the GenAI interface (GenAI inserts the same slice itself)."""
    lm_head = next(op for op in model.get_ordered_ops() if op.get_friendly_name() == LM_HEAD)
    start = ops.parameter([1], I64, name="logits_start")
    start.output(0).get_tensor().set_names({"logits_start"})
    hidden = lm_head.input_value(0)
    sliced = ops.slice(hidden, start, _c([np.iinfo(np.int64).max]), _c([1]), _c([1]))
    lm_head.input(0).replace_source_output(sliced.output(0))
    model.add_parameters([start])
    model.validate_nodes_and_infer_types()
    return model
