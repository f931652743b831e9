"""A GGUF's Q4_0, Q8_0 and Q4_K blocks packed for cpu_int4 as they are, without quantizing again (issue 40).

llama.cpp's Q4_0 block is 32 inputs of one row: an f16 scale d, then 16 bytes whose low nibbles are inputs 0-15
and high nibbles inputs 16-31, each w = d * (q - 8), q in 0..15. That is cpu_int4's symmetric int4 at group size
32 with f16 scales (quant.py: w = d * (q - 8)), code for code. Q8_0 is an f16 d and 32 int8 codes, w = d * q:
cpu_int4's int8 at group 32 with f16 scales, whose codes are -127..127 (a block holding -128, which llama.cpp's
quantizer never writes, is quantized from its floats instead). So the packer takes the codes and scales straight
from the blocks (`codes`), and only the tensors stored otherwise (llama-quantize's Q4_0 keeps the output layer in
Q6_K; norms are F32) go through the usual round-to-nearest from their dequantized floats.

Q4_K (what llama-quantize's Q4_K_M / Q4_K_S write for most matrices) is a super-block of 256 inputs: f16 d and
dmin, 8 six-bit scales sc_j and mins m_j, then 128 bytes of nibbles; sub-block j (inputs 32j..32j+31) means
w = (d * sc_j) * q - (dmin * m_j), q in 0..15. That is cpu_int4's asymmetric int4 at group 32 (w = s * q + m) with
s = d * sc_j and m = -dmin * m_j: the codes are kept, and only the two products are rounded, once, to f16 (d is an
f16 and sc_j has 6 bits, so the product has up to 17 significant bits to f16's 11: a relative error of at most
2^-11 in each group's scale and min). A K-quant file's matrices stored in more bits (Q4_K_M keeps some
attn_v/ffn_down in Q6_K; rows not of whole 256-input super-blocks fall back to Q5_0/Q8_0; Q5_K_M and Q6_K files
hold nothing narrower) are packed as int8 rows from their dequantized floats (`int8_matrices`, or linear_bits 8
for all), the rest (Q4_0/Q4_1, Q2_K/Q3_K, and matrices whose parts mix types) as asymmetric int4 from theirs.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from glmcore.gguf import GGUFTensor
from glmcore.weights import release

from .quant import QuantOptions, packed_names, quantize4

BITS = {"Q4_0": 4, "Q8_0": 8}                  # the symmetric types: a file all of one keeps its blocks
BLOCK_BYTES = {"Q4_0": 18, "Q8_0": 34}
# beside Q4_K: the stored types of more than 4 bits per weight, whose matrices are packed as int8 rows
WIDER = {"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "F16", "BF16", "F32"}
Q4_K_BYTES = 144                                # one super-block of 256 inputs


def q4_k_codes(blocks: np.ndarray):
    """Q4_K blocks uint8 [rows, inputs / 256 * 144] -> (q uint8 [rows, inputs] in 0..15, scales f16, mins f16
    [rows, inputs / 32]) as quant.quantize4(sym=False) gives them, or None where a product leaves f16's range."""
    from gguf.quants import Q4_K
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, Q4_K_BYTES)
    d, dmin = (np.ascontiguousarray(b[..., i:i + 2]).view(np.float16).astype(np.float32) for i in (0, 2))
    sc, m = (a.reshape(rows, -1, 8) for a in Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12)))
    with np.errstate(over="ignore"):
        scales = (d * sc).astype(np.float16).reshape(rows, -1)         # exact in f32, rounded once to f16
        mins = (-dmin * m).astype(np.float16).reshape(rows, -1)
    if not (np.isfinite(scales).all() and np.isfinite(mins).all()):
        return None
    # 32 bytes per pair of sub-blocks: the low nibbles are sub-block 2i, the high nibbles sub-block 2i + 1
    qs = b[..., 16:].reshape(rows, -1, 4, 1, 32)
    q = np.empty((*qs.shape[:3], 2, 32), np.uint8)
    np.bitwise_and(qs[..., 0, :], 15, out=q[..., 0, :])
    np.right_shift(qs[..., 0, :], 4, out=q[..., 1, :])
    return q.reshape(rows, -1), scales, mins


def block_codes(t, bits: int):
    """(q, d, None) of a stored GGUF tensor's rows as quant.quantize4/quantize8 give them (q: uint8 0..15 or
    int8, d: f16 [rows, inputs / 32]), or None when its type is not the `bits`-bit layout."""
    if BITS.get(t.qtype) != bits:
        return None
    b = t.blocks()
    blk = b.reshape(b.shape[0], -1, BLOCK_BYTES[t.qtype])
    d = np.ascontiguousarray(blk[..., :2]).view(np.float16)[..., 0]
    if t.qtype == "Q4_0":           # byte j: input j in the low nibble, input j + 16 in the high one
        q = np.empty((*blk.shape[:2], 32), np.uint8)
        np.bitwise_and(blk[..., 2:], 15, out=q[..., :16])
        np.right_shift(blk[..., 2:], 4, out=q[..., 16:])
        q = q.reshape(b.shape[0], -1)
    else:
        q = np.ascontiguousarray(blk[..., 2:]).view(np.int8).reshape(b.shape[0], -1)
        if (q == -128).any():
            return None
    d = np.ascontiguousarray(d)
    _release_parts(t)
    return q, d, None


def _release_parts(t) -> None:
    for p in t.parts:       # the file's pages, once read, leave this process (they stay in the page cache)
        release(p.data)


def q4_k_part_codes(t, bits: int):
    """(q, scales, mins) of rows of a Q4_K file's tensor, asymmetric g32 f16: each stored part's Q4_K blocks as
    they are, its other parts (a GLM-4-0414 q|k|v whose v llama-quantize stored as Q6_K) quantized from their
    floats; None where no part is Q4_K (the packer quantizes it all, as the options say)."""
    if bits != 4 or t.compose is not None or "Q4_K" not in {p.qtype for p in t.parts}:
        return None
    got = []
    for p in t.parts:
        part = GGUFTensor((p,), p.shape)
        kept = q4_k_codes(part.blocks()) if p.qtype == "Q4_K" else None
        got.append(kept or quantize4(np.asarray(part.array(), np.float32).reshape(p.shape[0], -1), 32, False, "f16"))
        _release_parts(part)
    return tuple(np.concatenate(a) for a in zip(*got))


class StoredTensors(Mapping):
    """The GGUF's canonical tensors in their stored form (row slices stay stored): what the packer streams."""

    def __init__(self, weights):
        self.weights = weights

    def __getitem__(self, name):
        return self.weights.stored(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)

    def fingerprint(self) -> str:
        return self.weights.fingerprint()


# the layer matrices whose stored type decides linear_bits (experts' end alike: experts.E.ffn_up.weight)
LAYER_MATRICES = ("qkv.weight", "attn_out.weight", "ffn_up.weight", "ffn_down.weight")


def packing(weights, extra: dict, q: QuantOptions, quant_keys) -> tuple[QuantOptions, object, object]:
    """(options, weights to pack, codes hook) for cpu_int4's packer. A GGUF whose layers are all Q4_0 or all Q8_0,
    packed with no quantization option given, keeps its blocks: group 32, symmetric, f16 scales, the layers at
    the file's bits, the embedding and output layer at theirs where they are Q4_0/Q8_0 (else int4 / int8).
    A K-quant file (llama-quantize's Q4_K_M, Q5_K_M, Q6_K... mixes) is packed at group 32 with f16 scales: every
    Q4_K block's codes kept as asymmetric int4, the matrices stored wider (WIDER) as int8 rows, the rest
    quantized to asymmetric int4; the embedding and output layer int4 where they are Q4_K, else int8."""
    if not hasattr(weights, "stored"):
        return q, weights, None
    stored = StoredTensors(weights)
    if any(k in extra for k in quant_keys):
        return q, stored, None
    layers = [stored[n] for n in stored if n.endswith(LAYER_MATRICES)]
    if K_QUANTS & {p.qtype for t in layers for p in t.parts}:
        return k_quant_options(stored), stored, lambda name, r0, r1, bits: \
            q4_k_part_codes(stored[name][r0:r1], bits) if name in stored else None
    linear = {t.qtype for t in layers}
    if len(linear) != 1 or next(iter(linear)) not in BITS:
        return q, stored, None
    q = QuantOptions(group_size=32, sym=True, scale_dtype="f16", linear_bits=BITS[next(iter(linear))],
                     embed_bits=BITS.get(stored["embed.weight"].qtype, 4),
                     head_bits=BITS.get(stored["lm_head.weight"].qtype, 8))
    # tensors the packer derives (latent attention's kv_b halves) are not in the file: quantized as usual
    return q, stored, lambda name, r0, r1, bits: block_codes(stored[name][r0:r1], bits) if name in stored else None


K_QUANTS = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}


def k_quant_options(stored: StoredTensors) -> QuantOptions:
    """A K-quant file's packing (see packing): its wider matrices as int8 rows, or every layer at int8 where
    none is narrower (Q5_K_M, Q6_K)."""
    matrices = [n for n in stored if len(stored[n].shape) == 2 and n not in ("embed.weight", "lm_head.weight")
                and not n.endswith("router.weight")]
    stored_wider = [n for n in matrices if stored[n].qtype in WIDER]
    all_wide = len(stored_wider) == len(matrices)
    # by packed name: a kv_b stored whole (older conversions of GLM-4.7-Flash) is packed as its two halves
    wider = tuple(packed for n in stored_wider for packed in packed_names(n))
    return QuantOptions(group_size=32, sym=all_wide, scale_dtype="f16", linear_bits=8 if all_wide else 4,
                        int8_matrices=() if all_wide else wider,
                        embed_bits=4 if stored["embed.weight"].qtype == "Q4_K" else 8,
                        head_bits=4 if stored["lm_head.weight"].qtype == "Q4_K" else 8)
