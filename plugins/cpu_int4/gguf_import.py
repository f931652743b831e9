"""A GGUF's Q4_0 and Q8_0 blocks packed for cpu_int4 as they are, without quantizing again (issue 40).

llama.cpp's Q4_0 block is 32 inputs of one row: an f16 scale d, then 16 bytes whose low nibbles are inputs 0-15
and high nibbles inputs 16-31, each w = d * (q - 8), q in 0..15. That is cpu_int4's symmetric int4 at group size
32 with f16 scales (quant.py: w = d * (q - 8)), code for code. Q8_0 is an f16 d and 32 int8 codes, w = d * q:
cpu_int4's int8 at group 32 with f16 scales, whose codes are -127..127 (a block holding -128, which llama.cpp's
quantizer never writes, is quantized from its floats instead). So the packer takes the codes and scales straight
from the blocks (`codes`), and only the tensors stored otherwise (llama-quantize's Q4_0 keeps the output layer in
Q6_K; norms are F32) go through the usual round-to-nearest from their dequantized floats.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from glmcore.weights import release

from .quant import QuantOptions

BITS = {"Q4_0": 4, "Q8_0": 8}
BLOCK_BYTES = {"Q4_0": 18, "Q8_0": 34}


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
    for p in t.parts:       # the file's pages, once read, leave this process (they stay in the page cache)
        release(p.data)
    return q, d, None


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
    the file's bits, the embedding and output layer at theirs where they are Q4_0/Q8_0 (else int4 / int8)."""
    if not hasattr(weights, "stored"):
        return q, weights, None
    stored = StoredTensors(weights)
    linear = {stored[n].qtype for n in stored if n.endswith(LAYER_MATRICES)}
    if any(k in extra for k in quant_keys) or len(linear) != 1 or next(iter(linear)) not in BITS:
        return q, stored, None
    q = QuantOptions(group_size=32, sym=True, scale_dtype="f16", linear_bits=BITS[next(iter(linear))],
                     embed_bits=BITS.get(stored["embed.weight"].qtype, 4),
                     head_bits=BITS.get(stored["lm_head.weight"].qtype, 8))
    # tensors the packer derives (latent attention's kv_b halves) are not in the file: quantized as usual
    return q, stored, lambda name, r0, r1, bits: block_codes(stored[name][r0:r1], bits) if name in stored else None
