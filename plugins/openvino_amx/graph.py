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


MATRICES = ("embed.weight", "qkv.weight", "attn_out.weight", "ffn_up.weight", "ffn_down.weight", "lm_head.weight")


class WeightNodes:
    """Turns canonical weights into decompression subgraphs for one weight format."""

    def __init__(self, weights, fmt: str, group_size: int):
        self.w, self.fmt, self.group_size = weights, fmt, group_size

    def _const(self, array: np.ndarray) -> ov.Node:
        array = np.ascontiguousarray(array)
        if not array.flags.writeable:     # a memory-mapped checkpoint tensor: OpenVINO wants its own copy
            array = array.copy()
        return ov.op.Constant(array, shared_memory=True)

    def _int(self, name: str, bits: int, group: int | None, sym: bool) -> ov.Output:
        w = self.w.f32(name)
        if sym:     # i8 / i4 (two values a byte, low nibble first) times an f16 scale
            q, scale = quantize_sym(w, bits, group)
            wq = self._const(q) if bits == 8 else _4bit_const(q, ov.Type.i4)
            deq = ops.multiply(ops.convert(wq, F32), ops.convert(self._const(scale), F32))
        else:       # u8 / u4 minus a zero point, times an f32 scale
            q, scale, zero = quantize_asym(w, bits, group)
            wq, zq = (self._const(q), self._const(zero)) if bits == 8 else (_4bit_const(q), _4bit_const(zero))
            deq = ops.multiply(ops.subtract(ops.convert(wq, F32), ops.convert(zq, F32)), self._const(scale))
        if q.ndim == 3:   # [out, groups, group] -> [out, in]
            deq = ops.reshape(deq, _c(w.shape), special_zero=False)
        return deq.output(0)

    def scheme(self, name: str) -> tuple[int, int | None, bool] | str:
        """How the weight `name` is stored: "f32", "f16", or (bits, group, symmetric)."""
        if self.fmt in ("f32", "f16"):
            return self.fmt
        if name == "embed.weight":      # a row lookup: u8 per row, gathered compressed
            return 8, None, False
        # int4 keeps the output layer in int8 (as NNCF does by default): the most sensitive layer
        if self.fmt == "int8" or name == "lm_head.weight":
            return 8, None, True
        return 4, group_for(self.w[name].shape[1], self.group_size), True

    def matrix(self, name: str) -> ov.Output:
        """The weight [out, in] (or the embedding table [vocab, hidden]) as f32 output of its decompression."""
        scheme = self.scheme(name)
        if scheme == "f32":
            return self._const(self.w.f32(name)).output(0)
        if scheme == "f16":
            return ops.convert(self._const(self.w.f32(name).astype(np.float16)), F32).output(0)
        return self._int(name, *scheme)

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


def _kv_cache(new: ov.Output, layer: int, kind: str, cfg: ModelConfig, beam_idx: ov.Output,
              init: ov.Output, sinks: list) -> ov.Output:
    """past (state) reordered by beam_idx ++ new along the sequence axis; the result is written back."""
    info = VariableInfo()
    info.variable_id = f"past_key_values.{layer}.{kind}present.{layer}.{kind}"
    info.data_type = F32
    info.data_shape = ov.PartialShape([-1, cfg.num_kv_heads, -1, cfg.head_dim])
    var = Variable(info)
    past = ops.read_value(init, var)
    present = ops.concat([ops.gather(past, beam_idx, _c(0)), new], 2)
    sinks.append(ops.assign(present, var))
    return present.output(0)


def _expand_kv(kv: ov.Output, cfg: ModelConfig) -> ov.Output:
    """[B, kv_heads, L, hd] -> [B, heads, L, hd] (each KV head serves `group` query heads, in order)."""
    group = cfg.num_heads // cfg.num_kv_heads
    if group == 1:
        return kv
    x = ops.unsqueeze(kv, _c(2))
    x = ops.broadcast(x, _c([1, 1, group, 1, 1]), broadcast_spec="BIDIRECTIONAL")
    return ops.reshape(x, _c([0, cfg.num_heads, -1, cfg.head_dim]), special_zero=True).output(0)


def build_model(cfg: ModelConfig, weights, fmt: str = "f32", group_size: int = 128,
                progress: Callable[[str], None] | None = None) -> ov.Model:
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}")
    W = WeightNodes(weights, fmt, group_size)
    say = progress or (lambda msg: None)

    input_ids = ops.parameter([-1, -1], I64, name="input_ids")
    attention_mask = ops.parameter([-1, -1], I64, name="attention_mask")
    position_ids = ops.parameter([-1, -1], I64, name="position_ids")
    beam_idx = ops.parameter([-1], I32, name="beam_idx")
    params = [input_ids, attention_mask, position_ids, beam_idx]
    for p in params:
        p.output(0).get_tensor().set_names({p.get_friendly_name()})

    ids_shape = ops.shape_of(input_ids, I64)
    batch = ops.gather(ids_shape, _c([0]), _c(0))
    seq_len = ops.gather(ops.shape_of(input_ids, I32), _c([1], np.int32), _c(0))
    # zero-length initial KV value [B, kv_heads, 0, hd], so a fresh or reset state starts empty
    init = ops.broadcast(_c(0.0, np.float32), ops.concat([batch, _c([cfg.num_kv_heads, 0, cfg.head_dim])], 0))

    # cos/sin of each input position [B, T, rot/2, 2]
    cos_sin = ops.gather(ov.op.Constant(rotary_table(cfg), shared_memory=True), position_ids, _c(0))

    # additive attention mask [B, 1, T, L]: query t (absolute position L-T+t) sees keys 0..L-T+t not padded
    mask_shape = ops.shape_of(attention_mask, I64)
    total = ops.gather(mask_shape, _c(1), _c(0))
    t_len = ops.gather(ids_shape, _c(1), _c(0))
    key_pos = ops.range(_c(0), total, _c(1), I64)
    query_pos = ops.range(ops.subtract(total, t_len), total, _c(1), I64)
    causal = ops.less_equal(ops.unsqueeze(key_pos, _c(0)), ops.unsqueeze(query_pos, _c(1)))       # [T, L]
    keep = ops.logical_and(ops.unsqueeze(causal, _c([0, 1])),
                           ops.unsqueeze(ops.greater(attention_mask, _c(0)), _c([1, 2])))          # [B,1,T,L]
    mask = ops.select(keep, _c(0.0, np.float32), _c(np.finfo(np.float32).min, np.float32))

    say("embedding")
    x = ops.gather(W.matrix("embed.weight"), input_ids, _c(0)).output(0)   # [B, T, hidden]
    sinks: list = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        say(f"layer {i + 1}/{cfg.num_layers}")
        h = _rms_norm(x, W.vector(p + "input_norm.weight"), cfg.norm_eps)
        qkv = _linear(h, W.matrix(p + "qkv.weight"))
        if cfg.qkv_bias:
            qkv = ops.add(qkv, W.vector(p + "qkv.bias")).output(0)
        split = ops.variadic_split(qkv, _c(-1), _c([cfg.q_size, cfg.kv_size, cfg.kv_size]))
        q = _rotary(split, 0, cfg.num_heads, cfg, cos_sin, seq_len)
        k = _rotary(split, 1, cfg.num_kv_heads, cfg, cos_sin, seq_len)      # keys cached after rotation
        v = ops.transpose(ops.reshape(split.output(2), _c([0, 0, cfg.num_kv_heads, cfg.head_dim]),
                                      special_zero=True), _c([0, 2, 1, 3])).output(0)
        keys = _expand_kv(_kv_cache(k, i, "key", cfg, beam_idx, init, sinks), cfg)
        values = _expand_kv(_kv_cache(v, i, "value", cfg, beam_idx, init, sinks), cfg)
        attn = ops.scaled_dot_product_attention(q, keys, values, mask, causal=False)      # [B, heads, T, hd]
        attn = ops.reshape(ops.transpose(attn, _c([0, 2, 1, 3])), _c([0, 0, cfg.q_size]), special_zero=True)
        out = _linear(attn, W.matrix(p + "attn_out.weight"))
        if cfg.post_norms:      # glm4: the sublayer output is normed before the add (the same RMSNorm pattern)
            out = _rms_norm(out, W.vector(p + "post_self_attn_norm.weight"), cfg.norm_eps)
        x = ops.add(x, out).output(0)
        h = _rms_norm(x, W.vector(p + "post_attn_norm.weight"), cfg.norm_eps)
        gate_up = ops.variadic_split(_linear(h, W.matrix(p + "ffn_up.weight")), _c(-1),
                                     _c([cfg.ffn_hidden_size, cfg.ffn_hidden_size]))
        act = ops.multiply(ops.swish(gate_up.output(0)), gate_up.output(1))                # silu(gate) * up
        out = _linear(act, W.matrix(p + "ffn_down.weight"))
        if cfg.post_norms:
            out = _rms_norm(out, W.vector(p + "post_mlp_norm.weight"), cfg.norm_eps)
        x = ops.add(x, out).output(0)
    say("output layer")
    x = _rms_norm(x, W.vector("final_norm.weight"), cfg.norm_eps)
    logits = _linear(x, W.matrix("lm_head.weight"), LM_HEAD)
    result = ops.result(logits)
    result.output(0).get_tensor().set_names({"logits"})
    model = ov.Model([result], sinks, params, f"glm-{cfg.family}")
    return model


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
