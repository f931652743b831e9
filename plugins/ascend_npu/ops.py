"""The one place where device-specific kernels are chosen: RMSNorm, attention, KV-cache update, MoE experts.

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

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from glmcore_plugins.torch_ref.ops import Ops, dense_experts, torch_attention, torch_cache_write, torch_ops


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


# ---------------------------------------------------------------- MoE experts (glm4_moe, glm4_moe_lite)

# torch_npu's MoE kernels, as op-plugin's op_plugin_functions.yaml registers them: 6.0.rc3 / 6.0.0 (b99362e, ddb7ed2)
# have npu_grouped_matmul with group_list typed int[] (host values: a graph per routing), npu_moe_init_routing (v1),
# npu_moe_finalize_routing and npu_swiglu; 7.0.0 (7b9ce1c) adds npu_moe_gating_top_k, npu_moe_init_routing_v2 and a
# grouped matmul whose group_list is a Tensor; 7.1.0 (57c5266) adds npu_moe_token_unpermute; 7.3.0 (b3065ed) and
# master (517f2e7) keep these signatures (master adds arguments we do not pass).
MOE_SCHEMAS = "op-plugin 6.0.rc3, 6.0.0, 7.0.0, 7.1.0, 7.3.0 and master 517f2e7"

# what each MoE call below passes, besides its tensors
_GATING = {"k", "bias", "k_group", "group_count", "group_select_mode", "renorm", "norm_type", "routed_scaling_factor",
           "eps"}
_INIT_ROUTING = {"active_num", "expert_num", "expert_tokens_num_type", "expert_tokens_num_flag", "quant_mode",
                 "active_expert_range", "row_idx_type"}
_GROUPED = {"group_list", "split_item", "group_type", "group_list_type"}


def gating_refusal(cfg) -> str | None:
    """Why npu_moe_gating_top_k cannot compute this config's routing exactly (None: it can). Its documented range
    (op-plugin docs, torch_npu-npu_moe_gating_top_k.md, 7.2.0 on): norm_type 1 (sigmoid) renormalises the chosen
    scores always (renorm takes only 0: vllm-ascend's check_npu_moe_gating_top_k refuses sigmoid without
    renormalisation too); group_count divides the experts into groups of more than 2; at most 2048 experts, and
    the groups padded to 32 experts at most 2048; 1 <= k_group <= group_count; k <= k_group * experts per group.
    7.1.0's page allows only 256 experts in 8 groups, 4 chosen, on Atlas A2/A3 (older CANN kernels)."""
    experts, groups = cfg.num_experts, cfg.num_groups
    per_group = experts // groups
    if not cfg.norm_topk_prob:
        return "norm_topk_prob is false and the kernel's sigmoid gating always renormalises"
    if experts % groups or per_group <= 2:
        return f"{experts} experts in {groups} groups: the kernel needs more than 2 experts per group"
    if experts > 2048 or -(-per_group // 32) * 32 * groups > 2048:
        return f"{experts} experts in {groups} groups exceed the kernel's 2048"
    if not (1 <= cfg.topk_groups <= groups and cfg.experts_per_token <= cfg.topk_groups * per_group):
        return f"top-{cfg.experts_per_token} of {cfg.topk_groups} groups of {per_group} is outside the kernel's range"
    return None


@dataclass(frozen=True)
class MoePlan:
    """The MoE calls a torch_npu's registered schemas allow: the experts as init_routing_v2 -> grouped matmul
    (gate+up) -> swiglu -> grouped matmul (down) -> combine; the routing by npu_moe_gating_top_k where the config
    lies in its range; the combine by npu_moe_token_unpermute where this torch_npu has it."""
    gating: bool
    unpermute: bool
    why_host_routing: str = ""


def npu_moe_plan(torch_npu, cfg=None) -> tuple[MoePlan | None, str | None]:
    """Which MoE calls this torch_npu's schemas allow for cfg (None: for a config the gating kernel can compute):
    (plan, None), or (None, why the experts cannot be torch_npu's)."""
    init = schema_args(getattr(torch_npu, "npu_moe_init_routing_v2", None))
    grouped = schema_args(getattr(torch_npu, "npu_grouped_matmul", None))
    if not _INIT_ROUTING <= set(init):
        return None, "this torch_npu has no npu_moe_init_routing_v2 (op-plugin 7.0.0 on)"
    if not _GROUPED <= set(grouped) or not grouped["group_list"].startswith("Tensor"):
        # 6.0.x: int[] group lists are host values, so every routing would compile a graph of its own
        return None, "npu_grouped_matmul takes no Tensor group_list in this torch_npu (op-plugin 7.0.0 on)"
    if "dim" not in schema_args(getattr(torch_npu, "npu_swiglu", None)):
        return None, "this torch_npu has no npu_swiglu"
    unpermute = "probs" in schema_args(getattr(torch_npu, "npu_moe_token_unpermute", None))
    has_gating = _GATING <= set(schema_args(getattr(torch_npu, "npu_moe_gating_top_k", None)))
    refusal = "this torch_npu has no npu_moe_gating_top_k" if not has_gating else cfg and gating_refusal(cfg)
    return MoePlan(not refusal, unpermute, refusal or ""), None


# the MoE line of the kernel table (`glmcore backends`); the session report names the choice made for a model
MOE_RULE = ("experts as torch_npu's MoE chain where the kernels' schemas take our arguments (op-plugin 7.0.0 on): "
            "npu_moe_gating_top_k routes where it computes the config exactly (norm_topk_prob on, more than 2 experts "
            "per group, at most 2048 experts; otherwise the host routing runs on the device), then "
            "npu_moe_init_routing_v2 -> npu_grouped_matmul -> npu_swiglu -> npu_grouped_matmul -> "
            "npu_moe_token_unpermute (7.1.0 on; a gather and weighted sum before; npu_moe_finalize_routing not used: "
            "vllm-ascend reports accuracy issues). Elsewhere (6.0.x: group_list int[], a graph per routing; hosts) "
            "every expert with dense routing weights under capture, the chosen experts in eager mode")


def moe_summary(torch_npu=None) -> str:
    """MOE_RULE, and on an NPU what this torch_npu offers."""
    if torch_npu is None:
        return MOE_RULE
    plan, why = npu_moe_plan(torch_npu)
    if plan is None:
        return f"{MOE_RULE}. This torch_npu: dense experts ({why})"
    return (f"{MOE_RULE}. This torch_npu: the fused chain, " + ("gating kernel" if plan.gating else plan.why_host_routing)
            + (", npu_moe_token_unpermute" if plan.unpermute else ", gather combine"))


def npu_gating(torch_npu, cfg) -> Callable:
    """Ops.route by npu_moe_gating_top_k: sigmoid of the fp32 router logits, the correction bias
    only for choosing, groups scored by their best two (group_select_mode 1), the chosen unbiased scores
    renormalised (+eps 1e-20) and scaled by routed_scaling_factor. Returns (chosen int32 [N, k], weights fp32)."""

    def route(cfg, h, router, bias):
        logits = F.linear(h.float(), router)          # fp32, as transformers computes the router; bias fp32 too
        weights, chosen, _norm = torch_npu.npu_moe_gating_top_k(
            logits, cfg.experts_per_token, bias=bias, k_group=cfg.topk_groups, group_count=cfg.num_groups,
            group_select_mode=1, renorm=0, norm_type=1, routed_scaling_factor=cfg.routed_scaling, eps=1e-20)
        return chosen, weights
    return route


def npu_grouped_experts(torch_npu, unpermute: bool) -> Callable:
    """Ops.experts by torch_npu's grouped-matmul chain, every shape static (N*k expanded rows), so it captures into
    one graph: npu_moe_init_routing_v2 sorts the N*k (token, choice) rows by expert (dropless, no quantisation,
    gather-type row index: row t*k+j of the routing sits at expanded[rows[t*k+j]]) and counts each expert's rows;
    npu_grouped_matmul multiplies each expert's run of rows by its weight ([E, in, out]: our [E, out, in] stacks
    transposed, a layout the kernel reads); npu_swiglu takes the gate half first, as the checkpoints store it.
    The combine weighs each row by its routing weight in the compute dtype (as the reference does) and sums a token's
    k rows: npu_moe_token_unpermute where this torch_npu has it, else a gather and sum (npu_moe_finalize_routing is
    not used: vllm-ascend's moe_comm_method.py reports accuracy issues with it)."""

    def experts(h, chosen, weights, up, down):
        n, k = chosen.shape
        e = up.shape[0]
        expanded, rows, counts, _scale = torch_npu.npu_moe_init_routing_v2(
            h, chosen.to(torch.int32), active_num=n * k, expert_num=e, expert_tokens_num_type=1,
            expert_tokens_num_flag=True, quant_mode=-1, active_expert_range=[0, e], row_idx_type=0)
        grouped = dict(group_list=counts, split_item=2, group_type=0, group_list_type=1)
        gate_up = torch_npu.npu_grouped_matmul([expanded], [up.transpose(1, 2)], **grouped)[0]
        y = torch_npu.npu_grouped_matmul([torch_npu.npu_swiglu(gate_up, dim=-1)], [down.transpose(1, 2)], **grouped)[0]
        probs = weights.to(h.dtype)
        if unpermute:
            return torch_npu.npu_moe_token_unpermute(y, rows, probs=probs)
        return (y[rows.long()].view(n, k, -1) * probs[..., None]).sum(1)
    return experts


def moe_ops(ops: Ops, cfg, graph: bool) -> Ops:
    """The experts (and, where its kernel computes this config exactly, the routing) of a MoE model on this Ops
    table, chosen once: torch_npu's fused MoE chain where the NPU kernels are in use and their schemas take what
    we pass (npu_moe_plan); otherwise every expert with dense routing weights under whole-graph capture (static
    shapes) and the chosen experts only in eager mode."""
    # torch_npu's MoE kernels are documented for Atlas A2/A3, the chips select_ops gives the fused kernels ("npu")
    why = ops.kernels.get("why", "no Ascend NPU: the host path")
    if ops.name == "npu":
        import torch_npu
        plan, why = npu_moe_plan(torch_npu, cfg)
        if plan:
            route = npu_gating(torch_npu, cfg) if plan.gating else None
            routing = ("torch_npu npu_moe_gating_top_k (sigmoid, bias for choosing, group_select_mode 1, "
                       "routed_scaling_factor)" if route else f"host routing (torch_route): {plan.why_host_routing}")
            combine = "npu_moe_token_unpermute" if plan.unpermute else \
                "gather + weighted sum (no npu_moe_token_unpermute before op-plugin 7.1.0)"
            kernels = dict(ops.kernels, moe_routing=routing, experts=(
                f"torch_npu npu_moe_init_routing_v2 -> npu_grouped_matmul -> npu_swiglu -> npu_grouped_matmul -> "
                f"{combine}"), moe_schemas=MOE_SCHEMAS)
            return dataclasses.replace(ops, experts=npu_grouped_experts(torch_npu, plan.unpermute),
                                       route=route or ops.route, kernels=kernels)
    if graph:
        experts, how = dense_experts, "every expert with dense routing weights (static shapes for the graph)"
    else:
        experts, how = ops.experts, "the chosen experts, token groups per expert (eager)"
    return dataclasses.replace(ops, experts=experts, kernels=dict(ops.kernels, experts=f"{how}; {why}"))
