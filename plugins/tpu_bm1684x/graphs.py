"""The static graphs of the BM1684X deployment, written as torch modules and exported to ONNX.

The BM1684X runs only static shapes, so the GLM network becomes a fixed set of graphs, one file per
layer and kind (so no part of a 6B/9B model needs a >2 GB protobuf):

    embedding        input_ids [1, S] int32                           -> input_embed [1, S, H]
    embedding_cache  input_ids [1, 1] int32                           -> input_embed [1, 1, H]
    block_N          input_states [1, S, H], position_ids [1, S] int32,
                     attention_mask [1, 1, S, S]                      -> hidden_states, past_k, past_v
                                                                         (K/V [1, S, kv_heads, head_dim])
    block_cache_N    input_states [1, 1, H], position_ids [1, 1] int32,
                     attention_mask [1, 1, 1, S+1], history_k, history_v [1, S, kv_heads, head_dim]
                                                                      -> hidden_states, present_k, present_v
                                                                         (the cache advanced by one slot)
    lm_head          hidden_states [1, H]                             -> logits [1, V] float32
    greedy_head      m_logits [1, V] float32                          -> token [1, 1] int32 (the device's
                                                                         greedy fast path: TopK over the
                                                                         logits on the device, no weights)

S is the fixed context SEQ_LEN chosen at export. A block is the reference's own dense GLM block
(plugins/torch_ref/forward.py DenseBlock: the core's rotary table, keys cached after rotation, GQA,
SwiGLU, post norms) with this graph's kernels: transposed MatMul weights, scoped RMSNorms, a 4-D
attention over an additive mask (0 or MASK_VALUE, computed on the host). The residual stream and
RMSNorm run in float32, also in the f16 graphs (TPU-MLIR requires the norms in float32).

The modules take their weights as extra forward arguments and are traced on the meta device;
export.py then turns the weight inputs into initializers backed by shared external data. That keeps
exporting a 6B model fast and light: the TorchScript exporter's shape inference otherwise walks every
parameter byte, and a CPU trace would run the whole SEQ_LEN forward pass of every part.
"""
from __future__ import annotations

import inspect
import warnings
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from glmcore.config import ModelConfig
from glmcore_plugins.torch_ref.forward import DenseBlock, cast

from .spec import TORCH_OPSET

_TORCH_DTYPE = {"f32": torch.float32, "f16": torch.float16}
_NP_DTYPE = {"f32": np.float32, "f16": np.float16}
_TORCH_OF_NP = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}


class RMSNorm(nn.Module):
    """RMSNorm in fp32 (fp16 sums of squares overflow) as the seven ops TPU-MLIR fuses into its RMSNorm; a
    submodule so that its ONNX nodes carry a scope name (".../input_norm/...") the quantize table can list."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight


class Layer(DenseBlock):
    """The shared dense GLM block (plugins/torch_ref/forward.py) with this graph's kernels: linear weights
    arrive transposed ([in, out]) so `x @ w` is a plain MatMul, each norm is its own scoped submodule, and
    attention is the 4-D form below over an additive mask. `w` holds a part's weights by their graph names."""

    NAMES = dict(input_norm="input_norm", qkv="qkv_w", qkv_bias="qkv_b", attn_out="attn_out_w",
                 post_attn_norm="post_attn_norm", ffn_up="ffn_up_w", ffn_down="ffn_down_w",
                 post_self_attn_norm="post_self_attn_norm", post_mlp_norm="post_mlp_norm")

    def __init__(self, cfg: ModelConfig, dtype: str):
        super().__init__(cfg, _TORCH_DTYPE[dtype], ops=None)
        for name in ("input_norm", "post_attn_norm") + (("post_self_attn_norm", "post_mlp_norm") if cfg.post_norms
                                                         else ()):
            setattr(self, name, RMSNorm(cfg.norm_eps))

    def weights(self, w: dict):
        """The part's weights under the block's attribute names (absent ones None)."""
        return SimpleNamespace(**{attr: w.get(name) for attr, name in self.NAMES.items()})

    def norm(self, owner, name, x):
        return getattr(self, name)(x, getattr(owner, name))

    def linear(self, x, w, bias=None):
        return x @ w if bias is None else x @ w + bias

    def run(self, w: dict, x, position_ids, mask, history=None):
        """The block over input_states x [1, T, H] at position_ids; history (k, v) [1, S, kv_heads, hd] are
        the cached keys/values the new ones follow. Returns (hidden states, k, v) with the new K/V appended."""
        layer, kv = self.weights(w), {}
        cos, sin = w["rope_cos"][position_ids], w["rope_sin"][position_ids]     # [1, T, rot/2]

        def attend(h):
            q, k, v = self.project_qkv(layer, h, cos, sin)
            if history is not None:
                k, v = torch.cat((history[0], k), dim=1), torch.cat((history[1], v), dim=1)
            kv.update(k=k, v=v)
            return self.linear(self.attention(q, k, v, mask), layer.attn_out)

        out = self.block(layer, cast(x, torch.float32), attend)
        return cast(out, self.dtype), kv["k"], kv["v"]

    def attention(self, q, k, v, mask):
        """q [1, T, heads, hd]; k, v [1, Sk, kv_heads, hd]; mask [1, 1, T, Sk] additive.
        GQA without copying K/V: the `group` query heads of one kv head (h // group, the reference's
        repeat_interleave) are stacked along the rows. Scores, mask and softmax run in fp32 (as
        ChatGLM's attention_softmax_in_fp32); every tensor stays 4-D for TPU-MLIR."""
        cfg, td = self.cfg, self.dtype
        T, Sk, kvh, hd = q.shape[1], k.shape[1], cfg.num_kv_heads, cfg.head_dim
        group = cfg.num_heads // kvh
        q = q.reshape(1, T, kvh, group * hd).transpose(1, 2).reshape(1, kvh, T * group, hd)  # row t*group+g
        scores = cast(q @ k.permute(0, 2, 3, 1), torch.float32) / hd ** 0.5                 # [1, kvh, T*g, Sk]
        scores = scores.reshape(kvh, T, group, Sk) + cast(mask, torch.float32).reshape(1, T, 1, Sk)
        probs = cast(torch.softmax(scores, dim=-1), td).reshape(1, kvh, T * group, Sk)
        out = probs @ v.transpose(1, 2)                                                       # [1, kvh, T*g, hd]
        return out.reshape(1, kvh, T, group * hd).transpose(1, 2).reshape(1, T, cfg.q_size)


class Block(nn.Module):
    """Prefill: all S positions at once; returns every position's hidden state and K/V."""

    def __init__(self, cfg, dtype, weight_names):
        super().__init__()
        self.layer, self.names = Layer(cfg, dtype), weight_names

    def forward(self, input_states, position_ids, attention_mask, *weights):
        return self.layer.run(dict(zip(self.names, weights)), input_states, position_ids, attention_mask)


class BlockCache(nn.Module):
    """Decode: one token against the cached K/V [1, S, ...]; the new K/V are appended at the tail and
    the head slot dropped, so the returned cache is again [1, S, ...] (the KV window moves by one)."""

    def __init__(self, cfg, dtype, weight_names):
        super().__init__()
        self.layer, self.names = Layer(cfg, dtype), weight_names

    def forward(self, input_states, position_ids, attention_mask, history_k, history_v, *weights):
        out, k, v = self.layer.run(dict(zip(self.names, weights)), input_states, position_ids, attention_mask,
                                   (history_k, history_v))
        return out, k[:, 1:], v[:, 1:]


class Embedding(nn.Module):
    def forward(self, input_ids, embed):
        return embed[input_ids]


class LmHead(nn.Module):
    """Final norm (fp32) and output layer."""

    def __init__(self, cfg: ModelConfig, dtype: str):
        super().__init__()
        self.final_norm, self.dtype = RMSNorm(cfg.norm_eps), _TORCH_DTYPE[dtype]

    def forward(self, hidden_states, final_norm, lm_head_w):
        x = cast(self.final_norm(cast(hidden_states, torch.float32), final_norm), self.dtype)
        return cast(x @ lm_head_w, torch.float32)


class GreedyHead(nn.Module):
    """TopK(1) over lm_head's logits: the greedy token without a second copy of the output layer
    (LLM-TPU's greedy_head; an lm_head variant with its own TopK would hold vocab x hidden twice)."""

    def forward(self, m_logits):
        return torch.topk(m_logits, 1)[1].to(torch.int32)


# ---------------------------------------------------------------- parts

def part_specs(cfg: ModelConfig, seq_len: int, dtype: str) -> list[dict]:
    """Name, inputs and outputs (name, shape, numpy dtype) and weight group of every part, in order."""
    S, H, kvh, hd = seq_len, cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim
    f = {"f32": "float32", "f16": "float16"}[dtype]
    kv = (1, S, kvh, hd)
    parts = [
        dict(name="embedding", group="embed", inputs=[("input_ids", (1, S), "int32")],
             outputs=[("input_embed", (1, S, H), f)]),
        dict(name="embedding_cache", group="embed", inputs=[("input_ids", (1, 1), "int32")],
             outputs=[("input_embed", (1, 1, H), f)]),
    ]
    for i in range(cfg.num_layers):
        parts.append(dict(name=f"block_{i}", group=f"layer_{i}", layer=i,
                          inputs=[("input_states", (1, S, H), f), ("position_ids", (1, S), "int32"),
                                  ("attention_mask", (1, 1, S, S), f)],
                          outputs=[("hidden_states", (1, S, H), f), ("past_k", kv, f), ("past_v", kv, f)]))
        parts.append(dict(name=f"block_cache_{i}", group=f"layer_{i}", layer=i,
                          inputs=[("input_states", (1, 1, H), f), ("position_ids", (1, 1), "int32"),
                                  ("attention_mask", (1, 1, 1, S + 1), f), ("history_k", kv, f),
                                  ("history_v", kv, f)],
                          outputs=[("hidden_states", (1, 1, H), f), ("present_k", kv, f), ("present_v", kv, f)]))
    parts += [
        dict(name="lm_head", group="lm_head", inputs=[("hidden_states", (1, H), f)],
             outputs=[("logits", (1, cfg.vocab_size), "float32")]),
        dict(name="greedy_head", group="greedy", inputs=[("m_logits", (1, cfg.vocab_size), "float32")],
             outputs=[("token", (1, 1), "int32")]),
    ]
    return parts


def group_weights(cfg: ModelConfig, weights, group: str, seq_len: int, dtype: str) -> dict[str, np.ndarray]:
    """The numpy arrays a weight group's parts take, in argument order: linear weights transposed and
    in the graph dtype, norm weights in fp32, rotary tables computed in fp32 by the reference."""
    dt = _NP_DTYPE[dtype]

    def lin(name):
        return np.ascontiguousarray(weights.f32(name).T.astype(dt))

    if group == "embed":
        return {"embed": np.ascontiguousarray(weights.f32("embed.weight").astype(dt))}
    if group == "lm_head":
        return {"final_norm": weights.f32("final_norm.weight"), "lm_head_w": lin("lm_head.weight")}
    if group == "greedy":
        return {}
    from glmcore.arch.rotary import rotary_tables
    p = f"layers.{int(group.split('_')[1])}."
    cos, sin = rotary_tables(cfg, np.arange(seq_len))
    w = {"input_norm": weights.f32(p + "input_norm.weight"), "qkv_w": lin(p + "qkv.weight")}
    if cfg.qkv_bias:
        w["qkv_b"] = weights.f32(p + "qkv.bias").astype(dt)
    w.update(attn_out_w=lin(p + "attn_out.weight"), post_attn_norm=weights.f32(p + "post_attn_norm.weight"),
             ffn_up_w=lin(p + "ffn_up.weight"), ffn_down_w=lin(p + "ffn_down.weight"),
             rope_cos=cos.astype(dt), rope_sin=sin.astype(dt))
    if cfg.post_norms:
        w.update(post_self_attn_norm=weights.f32(p + "post_self_attn_norm.weight"),
                 post_mlp_norm=weights.f32(p + "post_mlp_norm.weight"))
    return w


def build_module(part: dict, cfg: ModelConfig, dtype: str, weight_names: list[str]) -> nn.Module:
    name = part["name"]
    if name.startswith("embedding"):
        return Embedding()
    if name == "lm_head":
        return LmHead(cfg, dtype)
    if name == "greedy_head":
        return GreedyHead()
    return (BlockCache if name.startswith("block_cache") else Block)(cfg, dtype, weight_names)


def example_inputs(part: dict) -> tuple:
    """Stand-ins for the graph inputs: shapes and dtypes only (meta tensors)."""
    return tuple(torch.empty(shape, dtype=getattr(torch, dt), device="meta") for _, shape, dt in part["inputs"])


def export_part(part: dict, cfg: ModelConfig, dtype: str, weights: dict[str, np.ndarray], path) -> None:
    """torch.onnx.export with the TorchScript exporter at opset 15 (what the Sophgo deployments and
    TPU-MLIR's ONNX front end use). The weights are graph inputs here; export.py turns them into
    initializers. Everything is traced on the meta device: the graph depends on shapes and dtypes
    only (the tests check it is byte-identical to a CPU trace), and a CPU trace would compute a
    full SEQ_LEN forward pass per part, in fp16 emulated by the CPU for the f16 graphs."""
    names = list(weights)
    module = build_module(part, cfg, dtype, names)
    stand_ins = tuple(torch.empty(a.shape, dtype=_TORCH_OF_NP[np.dtype(a.dtype)], device="meta")
                      for a in weights.values())
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")      # the TorchScript exporter's deprecation notice
        torch.onnx.export(module.eval(), example_inputs(part) + stand_ins, str(path), **torchscript_exporter(),
                          opset_version=TORCH_OPSET, input_names=[n for n, _, _ in part["inputs"]] + names,
                          output_names=[n for n, _, _ in part["outputs"]], do_constant_folding=True)


def torchscript_exporter() -> dict:
    """The keyword that selects the TorchScript exporter: `dynamo=False` where torch.onnx.export has
    the keyword (torch >= 2.5, where newer versions default to the dynamo exporter); older torch has
    only the TorchScript exporter and rejects the keyword."""
    return {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {}


def export_torchscript(part: dict, cfg: ModelConfig, weights: dict[str, np.ndarray], path) -> None:
    """The f32 part as TorchScript (torch.jit.trace with the weights inside) for TPU-MLIR's torch
    front end, for parts whose weights exceed what one protobuf holds (LLM-TPU's GLM4 embedding.pt and
    lm_head.pt). The traced input shape is only an example: model_transform.py takes --input_shapes."""
    names = list(weights)
    module = build_module(part, cfg, "f32", names).eval()
    tensors = [torch.from_numpy(np.array(a)) for a in weights.values()]      # a copy: mmap'd arrays are read-only

    class WithWeights(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = module
            for i, t in enumerate(tensors):
                self.register_buffer(f"w{i}", t)

        def forward(self, x):
            return self.inner(x, *(getattr(self, f"w{i}") for i in range(len(tensors))))

    (shape, dt), = [(s, d) for _, s, d in part["inputs"]]
    example = torch.zeros(shape, dtype=getattr(torch, dt))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")      # TorchScript's deprecation notices: TPU-MLIR reads exactly this format
        torch.jit.save(torch.jit.trace(WithWeights().eval(), example), str(path))


def _torchscript_graph(path):
    """The graph TPU-MLIR's torch front end reads: the saved module's inlined_graph (TorchConverter.py)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.jit.load(str(path), map_location="cpu").inlined_graph


def torchscript_op_names(path) -> tuple[set[str], list[str]]:
    """(every op name TPU-MLIR gives the TorchScript part's nodes, the names of its RMSNorm's ops).

    TorchConverter names an op after its node's first output's debugName() (TorchHelper.TorchNode) and
    lowers aten::rsqrt into a Sqrt named "{name}_sqrt" and a Reciprocal named "{name}". The norm is
    every op the output layer's MatMul input is computed by (lm_head is final norm, then MatMul); the
    quantize table lists all of them, fused into an RMSNorm op or not."""
    g = _torchscript_graph(path)

    def names(node):
        name = node.outputsAt(0).debugName()
        return [name + "_sqrt", name] if node.kind() == "aten::rsqrt" else [name]

    aten = [n for n in g.nodes() if n.kind().startswith("aten::")]
    every = {x for n in aten for x in names(n)}
    matmuls = [n for n in aten if n.kind() == "aten::matmul"]
    norm, todo = [], [matmuls[-1].inputsAt(0).node()] if matmuls else []
    while todo:
        node = todo.pop()
        if node.kind().startswith("aten::") and node not in norm:
            norm.append(node)
            todo += [i.node() for i in node.inputs()]
    order = {n: i for i, n in enumerate(aten)}
    return every, [x for n in sorted(norm, key=order.get) for x in names(n)]
