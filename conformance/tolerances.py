"""THE tolerance table: how far a backend's logits may be from the fp32 torch reference, per format.

One row per precision/weight format. A configuration answers to the row of its looser part
(`tolerance_key`): int4 weights computed in bf16 to the int4 row, f32 compute over bf16 weights to
the bf16 row. Two comparisons use the compute precision's row instead, because the weights cancel out
of them: a backend's decode steps against its own one-shot prefill (case decode_vs_prefill), and the
reference run on the backend's own dequantized weights (optional hook conformance_weights).

Every figure is per position (one row of logits over the vocabulary), worst position reported; top-1
is the fraction of positions whose argmax agrees (metrics.py). Scale: the synthetic checkpoints are
built to be sensitive (glmcore/synth.py): sharp attention, peaked logits with std ~6 and the top
token typically 1-2 logits ahead, so max|d| is in those units and rounding shows up clearly.

Each row quotes the worst figures measured over the three tiny families (2026-11-21, this repository's
backends and `python -m glmcore_conformance.emulate`, the reference with rounded weights) and leaves
a margin of ~3x on the error figures (less for int4: see its row). Top-1 is the noisiest figure:
one near-tie flip in a 16-position case costs 0.0625, so its bounds leave room for two to three
flips per case. A positional bug is far
outside every row but int4: rotary off by one position in decode measured max|d| 16, rel L2 0.80,
cosine 0.67, top-1 0.38, KL 7.5 at worst, and rel L2 0.21, cosine 0.978, KL 0.08 in its mildest case.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from glmcore.errors import GlmcoreError


@dataclass(frozen=True)
class Tolerance:
    max_abs: float      # largest |ref - backend| logit, any position, any vocabulary entry
    rel_l2: float       # worst position's ||ref - backend|| / ||ref||
    cosine: float       # worst position's cosine(ref, backend): at least this
    top1: float         # fraction of positions whose argmax agrees: at least this
    kl: float           # worst position's KL(softmax(ref) || softmax(backend)), nats

    def bounds(self) -> dict[str, float]:
        return asdict(self)


TOLERANCES: dict[str, Tolerance] = {
    # fp32 everywhere: only the order of summation differs (blocked matmuls, fused kernels, threads).
    # 2^-24 relative per rounding over a few hundred dependent operations. Measured (openvino_amx,
    # tpu_bm1684x, ascend_npu in f32): max|d| 3.3e-5, rel L2 1.6e-6, KL 7e-11. The bounds allow ~60x
    # that, room for a 6B model's longer sums; top-1 must agree everywhere (a tie within 1e-4 logits
    # does not happen).
    "f32": Tolerance(max_abs=1e-2, rel_l2=1e-4, cosine=0.999_999, top1=1.0, kl=1e-6),
    # f16: 2^-11 ~ 5e-4 relative per rounding. Measured (f16 weights on openvino_amx and tpu_bm1684x,
    # emulated): max|d| 0.08, rel L2 3.6e-3, cosine 0.999993, top-1 0.96, KL 4.6e-4.
    "f16": Tolerance(max_abs=0.3, rel_l2=0.012, cosine=0.9999, top1=0.85, kl=2e-3),
    # bf16: 2^-8 ~ 4e-3 relative per rounding, 8x f16. Measured with bf16 compute (ascend_npu):
    # max|d| 0.82, rel L2 0.034, cosine 0.99943, top-1 0.875, KL 0.023; bf16 weights alone
    # (emulated): 0.45, 0.022, 0.99977, 0.94, 0.005.
    "bf16": Tolerance(max_abs=2.5, rel_l2=0.1, cosine=0.995, top1=0.7, kl=0.15),
    # int8 weights, one scale per output channel: step absmax/127. Measured (openvino_amx int8, and
    # emulated): max|d| 1.56, rel L2 0.079, cosine 0.9969, top-1 0.81, KL 0.11.
    "int8": Tolerance(max_abs=4.0, rel_l2=0.2, cosine=0.98, top1=0.6, kl=0.5),
    # int4 weights, one scale per group of 32: step absmax/7, 18x int8's. On these sensitive models
    # int4 is visibly lossy. Measured (cpu_int4 with its variants, the output layer at int4 among them;
    # openvino_amx int4; emulated): max|d| 20, rel L2 0.94, cosine 0.55, top-1 0.25, KL 10.4. This
    # row only rejects garbage (random logits: rel L2 1.4, cosine 0); int4 kernels are held tight by
    # decode_vs_prefill and by the reference on their own weights (conformance_weights), both at the
    # compute path's row.
    "int4": Tolerance(max_abs=40.0, rel_l2=1.25, cosine=0.35, top1=0.1, kl=25.0),
    # f16 weights on a Mixture-of-Experts model: f16's error (row "f16") and, at a token whose router scores lie
    # within f16's rounding of the top-k boundary, other experts (as bf16+experts). Measured (openvino_amx f32/f16,
    # both tiny MoE families, 3 prompts of 64 positions, 2026-11-27): no flip: max|d| 0.031, rel L2 1.3e-3, top-1
    # 0.984; one flip: max|d| 5.85, rel L2 0.29, cosine 0.958, KL 0.24. Top-1 discriminates, as in bf16+experts.
    "f16+experts": Tolerance(max_abs=40.0, rel_l2=1.25, cosine=0.35, top1=0.8, kl=25.0),
    # bf16 on a Mixture-of-Experts model (glm4_moe, glm4_moe_lite): rounding moves some tokens' router scores
    # across the top-k boundary, and such a token then runs other experts: its logits differ wholesale while
    # the others stay at bf16's error. Measured (ascend_npu bf16, eager and graph, both tiny MoE families,
    # 2026-11-27): max|d| 19.1, rel L2 0.94, cosine 0.56, top-1 0.938, KL 8.8. With bf16 arithmetic on the CPU
    # (openvino_amx bf16 on an AVX-512 BF16 Xeon, both tiny MoE families, every weight format's bf16+experts case
    # of the suite, 2026-11-28; on CPUs without it bf16 ran as f32): max|d| 18.9, rel L2 0.95, cosine 0.545,
    # KL 11.3, top-1 0.792 (reset_reuse, 24 positions: 5 differ after an early flip), next 0.833. Per-position
    # figures can only reject garbage here; top-1 is the figure that discriminates (a rotary off by one: 0.38).
    "bf16+experts": Tolerance(max_abs=40.0, rel_l2=1.25, cosine=0.35, top1=0.75, kl=25.0),
    # int8 activations (cpu_int4 against the reference on its own dequantized weights) on an MoE model: as
    # bf16+experts, a token whose router scores cross the top-k boundary runs other experts. Measured (cpu_int4,
    # its 7 variants, both tiny MoE families, prefill + decode + a 300-token prompt, 2026-11-27): max|d| 22.7,
    # rel L2 1.04, cosine 0.47, top-1 0.913, KL 18.5; in the suite's short cases top-1 0.75 (2 flips in 8).
    # Top-1 is the figure that discriminates (a rotary off by one: 0.38).
    "int8+experts": Tolerance(max_abs=40.0, rel_l2=1.25, cosine=0.3, top1=0.7, kl=25.0),
    # int4 weights on an MoE model against the fp32 reference: int4's own loss (row "int4") plus routing flips.
    # Measured (cpu_int4, its 7 variants, both tiny MoE families, as above): max|d| 27.5, rel L2 1.19, cosine 0.28,
    # top-1 0.37 (0.125 in the suite's 16-position window_shift case). Only garbage is rejected here, by rel L2 and
    # cosine (random logits: rel L2 1.4, cosine 0), not by top-1; the kernels are held by int8+experts on their own
    # weights and by decode_vs_prefill at f32.
    "int4+experts": Tolerance(max_abs=40.0, rel_l2=1.35, cosine=0.15, top1=0.0, kl=30.0),
}

# The rows above were set on random weights, a worst case for rounding. The built-in model
# (glmcore/data/demo-chatglm3-poet) is trained, and what users care about is what a format costs on
# such weights: tests/test_demo_model.py holds every non-f32 format to this second, tighter table, on
# that model's first 4 held-out poems (206 positions) teacher-forced against the torch reference.
# Measured 2026-11-25, worst per row over the formats that answer to it (openvino_amx bf16/f32,
# f32|bf16 x int8|int4; cpu_int4 g32, g128, asym, head_bits 4, embed_bits 8; tpu_bm1684x f16;
# ascend_npu eager bf16, f16):
#   f16  max|d| 0.031, rel L2 0.0026, cosine 0.999996, top-1 0.990, KL 3e-5
#   bf16 0.23, 0.023, 0.99987, 0.985, 5.5e-4 (compute only: the checkpoint's weights are bf16)
#   int8 0.34, 0.031, 0.99954, 0.990, 0.0031
#   int4 2.7 (cpu_int4 head_bits 4), 0.27, 0.963, 0.874, 0.37 (openvino_amx f32/int4)
# Bounds: 2-4x the error figures; top-1 leaves room for 5-7 more flips (0.005 each) than measured.
# f32 has no second row: its row above is already tight.
TRAINED_TOLERANCES: dict[str, Tolerance] = {
    "f16": Tolerance(max_abs=0.1, rel_l2=0.008, cosine=0.9999, top1=0.965, kl=2e-4),
    "bf16": Tolerance(max_abs=0.7, rel_l2=0.07, cosine=0.999, top1=0.96, kl=3e-3),
    "int8": Tolerance(max_abs=1.0, rel_l2=0.09, cosine=0.998, top1=0.96, kl=0.01),
    "int4": Tolerance(max_abs=6.0, rel_l2=0.6, cosine=0.9, top1=0.84, kl=1.0),
}

_ORDER = ("f32", "f16", "bf16", "int8", "int4")    # tightest to loosest


def tolerance_key(precision: str, weights: str, experts: bool = False) -> str:
    """The row a (compute precision, weight format) pair answers to: the looser of the two; on a model with
    routed experts, that row's "+experts" form where rounding can change the experts chosen (not f32)."""
    keys = []
    for what, name in (("precision", precision), ("weight format", weights)):
        if name not in TOLERANCES:
            raise GlmcoreError(f"conformance has no tolerance for {what} {name!r}; add a row to "
                               "conformance/tolerances.py (with the reasoning) or declare a known one")
        keys.append(name)
    key = max(keys, key=_ORDER.index)
    if not experts or key == "f32":
        return key
    if key + "+experts" not in TOLERANCES:
        raise GlmcoreError(f"conformance has no tolerance for {key} on a Mixture-of-Experts model (rounding changes "
                           f"which experts run); measure it and add a {key + '+experts'!r} row to "
                           "conformance/tolerances.py")
    return key + "+experts"

