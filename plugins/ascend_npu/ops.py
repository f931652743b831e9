"""The one place where device-specific kernels are chosen: RMSNorm, attention, KV-cache update.

`select_ops(device, dtype, soc)` decides once, at load, and the model only ever calls the returned
Ops. The fused torch_npu kernels (npu_rms_norm, npu_fused_infer_attention_score -- or
npu_prompt_flash_attention where that has no SymInt lengths -- for prefill, npu_incre_flash_attention
for decode, scatter_update_ for the cache) are used only on the chips they
are documented for with this model's shapes: Atlas A2/A3 (SoC names Ascend910B1-B4, Ascend910_93xx).
Elsewhere, on other NPUs as on CUDA and the CPU, the fused PyTorch equivalents run (F.rms_norm,
scaled_dot_product_attention, index_put_); see `soc_support`. Every function here is branch-free on
tensor values, so it traces into one graph.

Shapes: a step has B rows of T tokens; each row belongs to one cache slot. Cache layout is BNSD,
[slots, kv_heads, positions, head_dim] per layer: the position axis is -2, the axis
torch_npu.scatter_update_ writes in place (its documented KV-cache use) and the layout the Ascend
flash-attention kernels read without a transpose ("BNSD"); SDPA reads the same layout on CPU/CUDA.

Masks: `allowed` [B, T, positions] is True where a query may attend a key. The Ascend kernels take
the opposite convention (True/1 = masked out), so the NPU functions pass ~allowed. Per-row KV lengths
(`seq_lens`, a host list of ints) go to the NPU kernels whose schema types them SymInt[]
(actual_seq_lengths of the incremental kernel, actual_seq_lengths_kv of the fused infer kernel), so
their work scales with the tokens a row holds and the lengths stay graph inputs; SDPA has no such
argument and masks.
"""
from __future__ import annotations

import math
import re

import torch

from glmcore_plugins.torch_ref.ops import Ops, torch_attention, torch_cache_write, torch_ops


# ---------------------------------------------------------------- which chip runs what

# torch.npu.get_device_name() reports the CANN SoC name. torch_npu's SoC table: Ascend910PremiumA,
# Ascend910ProA, Ascend910A, Ascend910ProB and plain Ascend910B are the first-generation (Atlas
# training series) chips; Ascend910B1..B4 are Atlas A2; Ascend910_93xx (Ascend910C*) Atlas A3;
# Ascend310P* the Atlas inference cards; Ascend310B* Atlas 200I/500 A2; torchair's check_platform.py
# takes "Ascend910_95" / "Ascend950" for Ascend 950.
def soc_family(name: str) -> str:
    n = (name or "").replace(" ", "")
    if re.match(r"Ascend910B\d", n):
        return "A2"
    if n.startswith("Ascend910_93") or re.match(r"Ascend910C\d", n):
        return "A3"
    if n.startswith(("Ascend910_95", "Ascend950")):
        return "950"
    if n.startswith("Ascend310P"):
        return "310P"
    if n.startswith("Ascend310B"):
        return "310B"
    if n.startswith("Ascend910"):
        return "910A"
    return "unknown"


_WHY_NOT = {
    "310P": "Atlas inference cards (310P): the fused attention kernels take fp16 only and no grouped KV heads "
            "as used here, and scatter_update_ is not offered",
    "910A": "Atlas training series (910A): prompt/incre flash attention are listed as unsupported",
    "310B": "Atlas 200I/500 A2: prompt/incre flash attention are listed as unsupported",
    "950": "Ascend 950: npu_fused_infer_attention_score is the kernel there; not wired here yet",
    "unknown": "a SoC this backend has no kernel table for",
}


def soc_support(name: str) -> tuple[bool, str]:
    """(fused kernels?, why) for the SoC name torch.npu.get_device_name() reports."""
    family = soc_family(name)
    if family in ("A2", "A3"):
        return True, f"{name}: Atlas {family}, fused torch_npu kernels"
    return False, f"{name}: {_WHY_NOT[family]}; SDPA + index_put_ instead"


# ---------------------------------------------------------------- Ascend NPU path (Atlas A2/A3)

def symbolic_lengths(kernel, arg: str) -> bool:
    """Whether a torch_npu kernel takes the length list `arg` as SymInt[] (its registered schema).
    torch_npu exposes each kernel as the torch.ops.npu packet, whose schema says how the argument is
    typed: an int[] is specialized by dynamo, so every new value compiles a new graph, a SymInt[]
    stays a graph input. Anything without a readable schema counts as int[]."""
    try:
        schema = str(kernel.default._schema)      # Argument.type prints SymInt[] as List[int]; the text keeps it
    except AttributeError:
        return False
    declared = re.search(rf"([\w\[\]?]+) {re.escape(arg)}\b", schema)
    return declared is not None and declared.group(1).startswith("SymInt")


def _npu_ops(dtype: torch.dtype) -> Ops:
    import torch_npu

    def rms_norm(x, w, eps):
        return torch_npu.npu_rms_norm(x, w, epsilon=eps)[0]

    # Prefill: npu_prompt_flash_attention types actual_seq_lengths_kv as int[] (op_plugin_functions.yaml),
    # so lengths passed to it would recompile the step for every new start + T. npu_fused_infer_attention_score
    # takes SymInt[] lengths (op-plugin 6.0.rc2 on; int[] in 6.0.rc1): use it where its schema says so,
    # otherwise the prompt kernel without lengths (the mask alone bounds each row, as torchair's samples do).
    fused = getattr(torch_npu, "npu_fused_infer_attention_score", None)
    fused_lengths = fused is not None and symbolic_lengths(fused, "actual_seq_lengths_kv")

    def attention(q, k, v, allowed, seq_lens):
        _, h, t, d = q.shape
        masked = (~allowed)[:, None].contiguous()             # Ascend: True = does not participate
        common = dict(num_heads=h, input_layout="BNSD", num_key_value_heads=k.shape[1], atten_mask=masked)
        if t == 1:   # a static shape, decided at trace time: decode uses the incremental kernel (SymInt[] lengths)
            return torch_npu.npu_incre_flash_attention(q.contiguous(), k, v, actual_seq_lengths=seq_lens,
                                                       scale_value=1.0 / math.sqrt(d), **common)
        # sparse_mode 0 with the full mask; pre/next_tokens wide open so the mask alone decides
        if fused_lengths:
            out, _lse = fused(q.contiguous(), k, v, pre_tokens=2147483647, next_tokens=2147483647, sparse_mode=0,
                              actual_seq_lengths_kv=seq_lens, scale=1.0 / math.sqrt(d), **common)
            return out
        return torch_npu.npu_prompt_flash_attention(q.contiguous(), k, v, pre_tokens=2147483647,
                                                    next_tokens=2147483647, sparse_mode=0,
                                                    scale_value=1.0 / math.sqrt(d), **common)

    def cache_write(cache, slots, pos, new):
        if cache.shape[0] == 1:
            # one sequence: writes new[:, :, j] at cache[:, :, pos[0, 0] + j] in place (axis -2 = S of BNSD)
            torch_npu.scatter_update_(cache, pos[:, 0], new.contiguous(), -2)
        else:
            # several slots: scatter_update_ writes batch row b of the cache, not slot slots[b]
            torch_cache_write(cache, slots, pos, new)

    kv = "torch_npu.scatter_update_ (axis -2; index_put_ for several slots)"
    if dtype == torch.float32:
        # The fused flash-attention kernels take fp16/bf16/int8 only; fp32 keeps exact SDPA math.
        return Ops("npu", rms_norm, torch_attention, cache_write,
                   {"rms_norm": "torch_npu.npu_rms_norm", "attention": "scaled_dot_product_attention (fp32: "
                    "the NPU flash-attention kernels take fp16/bf16 only)", "kv_update": kv})
    prefill = ("npu_fused_infer_attention_score with per-row actual_seq_lengths_kv (SymInt[])" if fused_lengths
               else "npu_prompt_flash_attention without lengths (its int[] lengths would recompile per KV length)")
    return Ops("npu", rms_norm, attention, cache_write,
               {"rms_norm": "torch_npu.npu_rms_norm",
                "attention": f"torch_npu {prefill} (prefill) / npu_incre_flash_attention with per-row "
                             "actual_seq_lengths (decode), BNSD",
                "kv_update": kv}, seq_lens=True)


def select_ops(device, dtype: torch.dtype, soc: str | None = None) -> Ops:
    """Choose the kernels for this device, dtype and (on an NPU) SoC, once."""
    if device.type == "npu":
        fused, why = soc_support(soc or "")
        return _npu_ops(dtype) if fused else torch_ops("npu-sdpa", why)
    return torch_ops()
