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
from dataclasses import dataclass

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

# The op-plugin schemas this selection was checked against (op_plugin/config/*/op_plugin_functions.yaml): master
# 517f2e7, and the 6.0.rc1 / 6.0.rc2 branches' v2r1..v2r4 files (torch_npu 2.1..2.4 of those releases). They differ
# in exactly what matters here: v2r2/v2r3/v2r4 (e.g. torch_npu v2.3.1-6.0.rc2) have no fused infer kernel, a
# prompt kernel without sparse_mode / pse_shift / actual_seq_lengths_kv, and int[] lengths on the incremental kernel;
# 6.0.rc1's v2r1 types the fused kernel's lengths int[]; master and 6.0.rc2's v2r1 have SymInt[] throughout.
CHECKED_SCHEMAS = "op-plugin master 517f2e7, 6.0.rc1 and 6.0.rc2 (v2r1-v2r4 schemas)"

_COMMON = {"atten_mask", "num_heads", "input_layout", "num_key_value_heads"}
# what each call below passes, besides query/key/value and the lengths
_DECODE = _COMMON | {"scale_value"}
_PROMPT = _COMMON | {"scale_value", "pre_tokens", "next_tokens"}
_FUSED = _COMMON | {"scale", "pre_tokens", "next_tokens", "sparse_mode"}


def schema_args(kernel) -> dict[str, str]:
    """Argument name -> declared type (`SymInt[]?`, `int`, ...) of a torch_npu kernel, from its registered schema.
    torch_npu exposes each kernel as the torch.ops.npu packet, whose schema is what dynamo traces against; a
    kernel without a readable schema has no arguments we may pass ({})."""
    try:
        schema = str(kernel.default._schema)      # Argument.type prints SymInt[] as List[int]; the text keeps it
    except AttributeError:
        return {}
    inner = schema[schema.index("(") + 1:schema.rindex(") ->")]
    return {m.group(2): m.group(1) for m in re.finditer(r"([\w\[\]?()!]+) (\w+)(?:=[^,]*)?(?:,|$)", inner)}


@dataclass(frozen=True)
class AttentionPlan:
    """The attention calls a torch_npu's registered schemas allow: prefill by the fused infer kernel with SymInt[]
    KV lengths (else the prompt kernel without lengths); decode lengths only where they are SymInt[]."""
    fused_prefill: bool
    decode_lengths: bool
    paged_decode: bool = False      # the incremental kernel reads a paged cache through block_table (page attention)


def npu_attention_plan(torch_npu) -> tuple[AttentionPlan | None, str | None]:
    """Which attention call prefill and decode make, from the schemas this torch_npu registers: every argument
    passed is one the kernel declares, and per-row lengths go only where they are SymInt[]. Returns (plan, None)
    or (None, why the fused kernels cannot be used)."""
    incre = schema_args(getattr(torch_npu, "npu_incre_flash_attention", None))
    prompt = schema_args(getattr(torch_npu, "npu_prompt_flash_attention", None))
    fused_args = schema_args(getattr(torch_npu, "npu_fused_infer_attention_score", None))
    if not _DECODE <= set(incre):
        return None, f"npu_incre_flash_attention lacks {sorted(_DECODE - set(incre))} in this torch_npu"
    fused_prefill = _FUSED <= set(fused_args) and fused_args.get("actual_seq_lengths_kv", "").startswith("SymInt")
    if not fused_prefill and not _PROMPT <= set(prompt):
        return None, f"npu_prompt_flash_attention lacks {sorted(_PROMPT - set(prompt))} in this torch_npu"
    decode_lengths = incre.get("actual_seq_lengths", "").startswith("SymInt")
    # page attention needs block_table, block_size and each row's actual_seq_lengths (op-plugin's
    # torch_npu-npu_incre_flash_attention.md, "page attention使用限制"): only where those lengths are SymInt[]
    paged = decode_lengths and {"block_table", "block_size"} <= set(incre)
    return AttentionPlan(fused_prefill, decode_lengths, paged), None


def _npu_ops(dtype: torch.dtype, plan: AttentionPlan) -> Ops:
    import torch_npu

    def rms_norm(x, w, eps):
        return torch_npu.npu_rms_norm(x, w, epsilon=eps)[0]

    # Prefill: npu_prompt_flash_attention types actual_seq_lengths_kv as int[] (where it has it at all), so
    # lengths passed to it would recompile the step for every new start + T: npu_fused_infer_attention_score
    # with SymInt[] lengths where the schema has them, otherwise the prompt kernel without lengths (the mask alone
    # bounds each row, as torchair's samples do). Decode: the incremental kernel, its lengths only where SymInt[].
    fused, decode_lengths = plan.fused_prefill, plan.decode_lengths

    def attention(q, k, v, allowed, seq_lens):
        _, h, t, d = q.shape
        masked = (~allowed)[:, None].contiguous()             # Ascend: True = does not participate
        common = dict(num_heads=h, input_layout="BNSD", num_key_value_heads=k.shape[1], atten_mask=masked)
        if t == 1:   # a static shape, decided at trace time: decode uses the incremental kernel
            lengths = dict(actual_seq_lengths=seq_lens) if decode_lengths else {}
            return torch_npu.npu_incre_flash_attention(q.contiguous(), k, v, scale_value=1.0 / math.sqrt(d),
                                                       **lengths, **common)
        # pre/next_tokens wide open (sparse_mode 0, the default) so the full mask alone decides
        if fused:
            out, _lse = torch_npu.npu_fused_infer_attention_score(
                q.contiguous(), k, v, pre_tokens=2147483647, next_tokens=2147483647, sparse_mode=0,
                actual_seq_lengths_kv=seq_lens, scale=1.0 / math.sqrt(d), **common)
            return out
        return torch_npu.npu_prompt_flash_attention(q.contiguous(), k, v, pre_tokens=2147483647,
                                                    next_tokens=2147483647, scale_value=1.0 / math.sqrt(d), **common)

    def paged_decode(q, k_cache, v_cache, blocks, seq_lens):
        # page attention: the cache is [blocknum, numKvHeads, blocksize, headDims] with a BNSD query, block_table
        # [B, maxBlockNumPerSeq] int32, every row's actual_seq_lengths; no mask (the lengths bound each row)
        _, h, _, d = q.shape
        return torch_npu.npu_incre_flash_attention(q.contiguous(), k_cache, v_cache, num_heads=h, input_layout="BNSD",
                                                   num_key_value_heads=k_cache.shape[1], scale_value=1.0 / math.sqrt(d),
                                                   block_table=blocks, block_size=k_cache.shape[2],
                                                   actual_seq_lengths=seq_lens)

    def cache_write(cache, rows, pos, new):
        if cache.shape[0] == 1:
            # one sequence: writes new[:, :, j] at cache[:, :, pos[0, 0] + j] in place (axis -2 = S of BNSD)
            torch_npu.scatter_update_(cache, pos[:, 0], new.contiguous(), -2)
        else:
            # several slots or blocks: scatter_update_ writes batch row b of the cache, not row rows[b]
            torch_cache_write(cache, rows, pos, new)

    kv = "torch_npu.scatter_update_ (axis -2; index_put_ for several slots)"
    if dtype == torch.float32:
        # The fused flash-attention kernels take fp16/bf16/int8 only; fp32 keeps exact SDPA math.
        return Ops("npu", rms_norm, torch_attention, cache_write,
                   {"rms_norm": "torch_npu.npu_rms_norm", "attention": "scaled_dot_product_attention (fp32: "
                    "the NPU flash-attention kernels take fp16/bf16 only)", "kv_update": kv})
    prefill = ("npu_fused_infer_attention_score with per-row actual_seq_lengths_kv (SymInt[])" if fused
               else "npu_prompt_flash_attention without lengths (its int[] lengths would recompile per KV length)")
    decode = ("npu_incre_flash_attention with per-row actual_seq_lengths (SymInt[])" if decode_lengths else
              "npu_incre_flash_attention without lengths (int[] in this torch_npu: they would recompile per step)")
    if plan.paged_decode:
        decode += "; batched decode over a paged cache through block_table (page attention)"
    return Ops("npu", rms_norm, attention, cache_write,
               {"rms_norm": "torch_npu.npu_rms_norm", "attention": f"torch_npu {prefill} (prefill) / {decode} "
                "(decode), BNSD", "kv_update": kv, "schemas": CHECKED_SCHEMAS}, seq_lens=fused or decode_lengths,
               paged_decode=paged_decode if plan.paged_decode else None)


def select_ops(device, dtype: torch.dtype, soc: str | None = None) -> Ops:
    """Choose the kernels for this device, dtype and (on an NPU) SoC, once."""
    if device.type == "npu":
        fused, why = soc_support(soc or "")
        if not fused:
            return torch_ops("npu-sdpa", why)
        import torch_npu
        plan, why_not = npu_attention_plan(torch_npu)
        return _npu_ops(dtype, plan) if plan else torch_ops("npu-sdpa", f"{soc}: {why_not}; SDPA + index_put_ instead")
    return torch_ops()
