"""Group-wise INT4/INT8 quantization, the kernels' tile layout, and the packed file on disk.

Linear weights [out, in] are quantized per row in groups of `group_size` inputs:
  symmetric  (Q4_0):  w = d * (q - 8),  q in 0..15, d = (value of largest magnitude) / -8
  asymmetric (Q4_1):  w = d * q + m,    q in 0..15, d = (max - min) / 15, m = min
  int8 (output layer / embeddings): w = d * q, q in -127..127, d = absmax / 127
Scales (and minimums) are stored as f16 or bf16, and the codes are computed against the stored
(rounded) scales so the file means exactly what it says.

Tile layout (what glmi4.c reads): 16 output rows per tile; per group: 16 scales (32 bytes), for
asymmetric 16 minimums (32 bytes), then group/32 blocks. An INT4 block is 256 bytes: 8 chunks of 32,
chunk c byte 4r+e = q[r][4c+e] | q[r+8][4c+e] << 4 (r < 8), so one broadcast of 4 activations feeds
all 16 rows. An INT8 block is 512 bytes: 8 chunks of 64, chunk c byte 4r+e = q[r][4c+e] (r < 16).
Rows are padded to a multiple of 16, inputs to the group size.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from glmcore.cache import build_once
from glmcore.config import ModelConfig
from glmcore.errors import BackendError, GlmcoreError

FORMAT = "glmcore-cpu_int4"
VERSION = 3       # 3: the NextN layer packed where the checkpoint has one (2: never; still read)
SCALE_DTYPES = {"f16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}
ROWS = 16     # rows per tile
QK = 32       # inputs per activation block


@dataclass(frozen=True)
class QuantOptions:
    group_size: int = 32
    sym: bool = True
    scale_dtype: str = "f16"
    embed_bits: int = 4
    head_bits: int = 8
    linear_bits: int = 4        # the layers' matrices: int4, or int8 (what a GGUF's Q8_0 blocks are)
    # layer matrices held as int8 rows whatever linear_bits says: a K-quant GGUF's matrices stored in more than
    # 4 bits (llama-quantize's Q4_K_M keeps some attn_v/ffn_down in Q6_K); set by the GGUF import (gguf_import.py)
    int8_matrices: tuple[str, ...] = ()

    @classmethod
    def from_extra(cls, extra: dict) -> "QuantOptions":
        d = cls()
        o = cls(group_size=_as_int(extra.get("group_size", d.group_size), "group_size"),
                sym=_as_bool(extra.get("sym", d.sym)),
                scale_dtype=str(extra.get("scale_dtype", d.scale_dtype)),
                embed_bits=_as_int(extra.get("embed_bits", d.embed_bits), "embed_bits"),
                head_bits=_as_int(extra.get("head_bits", d.head_bits), "head_bits"),
                linear_bits=_as_int(extra.get("linear_bits", d.linear_bits), "linear_bits"),
                int8_matrices=_as_names(extra.get("int8_matrices", d.int8_matrices), "int8_matrices"))
        if o.group_size not in (32, 64, 128):
            raise BackendError(f"cpu_int4: group_size {o.group_size} is not supported; use 32, 64 or 128")
        if o.scale_dtype not in SCALE_DTYPES:
            raise BackendError(f"cpu_int4: scale_dtype {o.scale_dtype!r} is not supported; use f16 or bf16")
        for key in ("embed_bits", "head_bits", "linear_bits"):
            if getattr(o, key) not in (4, 8):
                raise BackendError(f"cpu_int4: {key}={getattr(o, key)} is not supported; use 4 or 8")
        return o

    def label(self) -> str:
        return (f"int{self.linear_bits} {'sym' if self.sym else 'asym'} g{self.group_size} {self.scale_dtype} scales"
                f"{f' ({len(self.int8_matrices)} matrices int8)' if self.int8_matrices else ''}, "
                f"embeddings int{self.embed_bits}, output layer int{self.head_bits}")

    def as_json(self) -> dict:
        """The options as meta.json holds them (int8_matrices a list)."""
        return {**asdict(self), "int8_matrices": list(self.int8_matrices)}


def _as_int(v, key: str) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        raise BackendError(f"cpu_int4: {key}={v!r} is not a number") from None


def _as_names(v, key: str) -> tuple[str, ...]:
    if not isinstance(v, (list, tuple)) or not all(isinstance(n, str) for n in v):
        raise BackendError(f"cpu_int4: {key} must be a list of tensor names")
    return tuple(v)


def _as_bool(v) -> bool:
    if isinstance(v, str):
        if v.lower() in ("1", "true", "yes", "sym"):
            return True
        if v.lower() in ("0", "false", "no", "asym"):
            return False
        raise BackendError(f"cpu_int4: sym={v!r} is not a boolean; use sym=true or sym=false")
    return bool(v)


# ---------------------------------------------------------------- quantization

def _pad_cols(w: np.ndarray, kp: int) -> np.ndarray:
    return w if w.shape[1] == kp else np.pad(w, ((0, 0), (0, kp - w.shape[1])))


def quantize4(w: np.ndarray, group: int, sym: bool, scale_dtype: str):
    """w [n, k] float -> (q uint8 [n, kp] in 0..15, scales [n, kp/group], mins or None), scales as stored."""
    sd = SCALE_DTYPES[scale_dtype]
    n, k = w.shape
    kp = -(-k // group) * group
    wg = _pad_cols(np.asarray(w, np.float32), kp).reshape(n, kp // group, group)
    if sym:
        idx = np.abs(wg).argmax(axis=2)[..., None]
        d = (np.take_along_axis(wg, idx, axis=2)[..., 0] / -8.0).astype(sd)
        df = d.astype(np.float32)[..., None]
        inv = np.divide(1.0, df, out=np.zeros_like(df), where=df != 0)
        q = np.clip(np.rint(wg * inv) + 8, 0, 15)
        mins = None
    else:
        lo, hi = wg.min(axis=2), wg.max(axis=2)
        d = ((hi - lo) / 15.0).astype(sd)
        mins = lo.astype(sd)
        df = d.astype(np.float32)[..., None]
        inv = np.divide(1.0, df, out=np.zeros_like(df), where=df != 0)
        q = np.clip(np.rint((wg - mins.astype(np.float32)[..., None]) * inv), 0, 15)
    return q.astype(np.uint8).reshape(n, kp), d, mins


def quantize8(w: np.ndarray, group: int, scale_dtype: str):
    """w [n, k] -> (q int8 [n, kp] in -127..127, scales [n, kp/group])."""
    sd = SCALE_DTYPES[scale_dtype]
    n, k = w.shape
    kp = -(-k // group) * group
    wg = _pad_cols(np.asarray(w, np.float32), kp).reshape(n, kp // group, group)
    d = (np.abs(wg).max(axis=2) / 127.0).astype(sd)
    df = d.astype(np.float32)[..., None]
    inv = np.divide(1.0, df, out=np.zeros_like(df), where=df != 0)
    q = np.clip(np.rint(wg * inv), -127, 127).astype(np.int8)
    return q.reshape(n, kp), d


def dequantize(q: np.ndarray, d: np.ndarray, mins: np.ndarray | None, group: int, bits: int, k: int) -> np.ndarray:
    n, kp = q.shape
    qf = q.astype(np.float32).reshape(n, kp // group, group)
    df = d.astype(np.float32)[..., None]
    if bits == 8:
        w = qf * df
    elif mins is None:
        w = (qf - 8.0) * df
    else:
        w = qf * df + mins.astype(np.float32)[..., None]
    return w.reshape(n, kp)[:, :k]


# ---------------------------------------------------------------- tile layout

def _tiled(rows: int) -> int:
    """rows rounded up to whole tiles"""
    return -(-rows // ROWS) * ROWS


def _pad_rows(a: np.ndarray, n_pad: int) -> np.ndarray:
    return a if a.shape[0] == n_pad else np.pad(a, ((0, n_pad - a.shape[0]),) + ((0, 0),) * (a.ndim - 1))


def _scale_bytes(s: np.ndarray, nt: int) -> np.ndarray:
    """scales [n_pad, ng] -> per tile and group, the 16 rows' scales: [nt, ng, 32] bytes."""
    ng = s.shape[1]
    return np.ascontiguousarray(s.view(np.uint16).reshape(nt, ROWS, ng).transpose(0, 2, 1)).view(np.uint8)


def tile4(q: np.ndarray, d: np.ndarray, mins: np.ndarray | None, group: int) -> np.ndarray:
    n, kp = q.shape
    n_pad = _tiled(n)
    nt, ng, gb = n_pad // ROWS, kp // group, group // QK
    q, d = _pad_rows(q, n_pad), _pad_rows(d, n_pad)
    qt = q.reshape(nt, ROWS, ng, gb, 8, 4)                          # [tile, row, group, block, chunk, e]
    both = qt[:, :8] | (qt[:, 8:] << 4)                             # rows r and r+8 share a byte
    blocks = both.transpose(0, 2, 3, 4, 1, 5).reshape(nt, ng, gb * 256)
    parts = [_scale_bytes(d, nt)]
    if mins is not None:
        parts.append(_scale_bytes(_pad_rows(mins, n_pad), nt))
    parts.append(blocks)
    return np.concatenate(parts, axis=2).reshape(-1)


def tile8(q: np.ndarray, d: np.ndarray, group: int) -> np.ndarray:
    n, kp = q.shape
    n_pad = _tiled(n)
    nt, ng, gb = n_pad // ROWS, kp // group, group // QK
    q, d = _pad_rows(q, n_pad), _pad_rows(d, n_pad)
    blocks = q.view(np.uint8).reshape(nt, ROWS, ng, gb, 8, 4).transpose(0, 2, 3, 4, 1, 5).reshape(nt, ng, gb * 512)
    return np.concatenate([_scale_bytes(d, nt), blocks], axis=2).reshape(-1)


def tile_nbytes(n: int, k: int, bits: int, group: int, asym: bool) -> int:
    n_pad, kp = _tiled(n), -(-k // group) * group
    per_group = 32 + (32 if asym and bits == 4 else 0) + (group // QK) * (256 if bits == 4 else 512)
    return n_pad // ROWS * (kp // group) * per_group


def untile(buf: np.ndarray, n: int, k: int, bits: int, group: int, asym: bool, scale_dtype: str) -> np.ndarray:
    """Dequantize a packed tile buffer back to float32 [n, k]: reads the file the way the kernels do."""
    sd = SCALE_DTYPES[scale_dtype]
    n_pad, kp = _tiled(n), -(-k // group) * group
    nt, ng, gb = n_pad // ROWS, kp // group, group // QK
    hdr = 32 + (32 if asym and bits == 4 else 0)
    g = np.asarray(buf, np.uint8).reshape(nt, ng, -1)

    def scales(off):
        return g[:, :, off:off + 32].copy().view(np.uint16).view(sd).astype(np.float32)   # [nt, ng, 16]

    d = scales(0)
    if bits == 4:
        both = g[:, :, hdr:].reshape(nt, ng, gb, 8, 8, 4)                     # [nt, ng, gb, c, r, e]
        q = np.concatenate([both & 15, both >> 4], axis=4).astype(np.float32)   # rows 0-7, then 8-15
        m = scales(32) if asym else -8.0 * d
    else:
        q = g[:, :, hdr:].view(np.int8).reshape(nt, ng, gb, 8, ROWS, 4).astype(np.float32)
        m = np.zeros_like(d)
    # q [nt, ng, gb, c, r, e] -> [nt, r, ng, gb*32]
    q = q.transpose(0, 4, 1, 2, 3, 5).reshape(nt, ROWS, ng, group)
    w = q * d.transpose(0, 2, 1)[..., None] + m.transpose(0, 2, 1)[..., None]
    return w.reshape(n_pad, kp)[:n, :k]


# ---------------------------------------------------------------- the packed file

# Latent attention's kv_b [heads * (nope + v), kv_lora] is packed as the two matrices the absorption multiplies
# by: per head, its key rows transposed ([kv_lora, nope], W_UK^T: the query into the latent space) and its value
# rows ([v, kv_lora], W_UV: the latent output back out), each stacked over the heads. Each head's block is padded
# with zero rows to whole tiles, so the kernels can take a head's rows as a matrix of their own at any kv_lora or v.
KV_B_PARTS = ("kv_b_uk.weight", "kv_b_uv.weight")


def packed_names(name: str) -> tuple[str, ...]:
    """The packed tensors a canonical tensor becomes: itself, or latent attention's kv_b as its two halves."""
    if name.endswith("kv_b.weight"):
        return tuple(name[: -len("kv_b.weight")] + k for k in KV_B_PARTS)
    return (name,)


def _kv_b_shapes(cfg) -> tuple[tuple[int, int], tuple[int, int]]:
    H, R = cfg.num_heads, cfg.kv_lora_rank
    return (H * _tiled(R), cfg.qk_nope_dim), (H * _tiled(cfg.v_head_dim), R)


def kv_b_parts(cfg, kv_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """kv_b [heads * (nope + v), kv_lora] -> (W_UK^T stacked [heads * kv_lora', nope], W_UV stacked [heads * v',
    kv_lora]), kv_lora' and v' rounded up to whole tiles with zero rows."""
    H, R, nope, v = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_dim, cfg.v_head_dim
    w = np.asarray(kv_b, np.float32).reshape(H, nope + v, R)
    uk = np.zeros((H, _tiled(R), nope), np.float32)
    uk[:, :R] = w[:, :nope].transpose(0, 2, 1)
    uv = np.zeros((H, _tiled(v), R), np.float32)
    uv[:, :v] = w[:, nope:]
    return uk.reshape(-1, nope), uv.reshape(-1, R)


def kv_b_join(cfg, uk: np.ndarray, uv: np.ndarray) -> np.ndarray:
    """The inverse of kv_b_parts: the kv_b the two packed matrices mean."""
    H, R, nope, v = cfg["num_heads"], cfg["kv_lora_rank"], cfg["qk_nope_dim"], cfg["v_head_dim"]
    k = uk.reshape(H, _tiled(R), nope)[:, :R].transpose(0, 2, 1)
    return np.concatenate([k, uv.reshape(H, _tiled(v), R)[:, :v]], axis=1).reshape(H * (nope + v), R)


def _packed_source(cfg, weights, name: str):
    """The array a packed tensor is made from: the canonical tensor, or a part of kv_b."""
    if name.endswith(KV_B_PARTS):
        p = name[: -len("kv_b_uk.weight")]
        return kv_b_parts(cfg, weights[p + "kv_b.weight"])[name.endswith(KV_B_PARTS[1])]
    return weights[name]


NEXTN = "mtp.0."     # the NextN layer the speculative drafter runs (the first; GLM-4.5 ships one)


def nextn_refusal(cfg: ModelConfig, present: bool) -> str | None:
    """Why a checkpoint's NextN layer is not run (None: it is packed and run); present: its tensors are there."""
    if not getattr(cfg, "num_mtp_layers", 0) or not present:
        return ("the checkpoint has no multi-token-prediction (NextN) layer (or an older cpu_int4 packed it without "
                "one: convert it again)")
    return None


def packed_layout(cfg: ModelConfig, o: QuantOptions, nextn: bool = False) -> dict[str, dict]:
    """Every tensor of the packed file: kind, shape, offset (64-byte aligned), size. 1-D tensors and MoE routers
    stay fp32 (the router chooses the experts: transformers runs it in fp32); the other matrices are tiles.
    nextn: the checkpoint's first NextN layer too (mtp.0.*: eh_proj and its decoder layer like the others)."""
    from glmcore import arch
    from glmcore.weights import canonical_shapes
    shapes = {}
    own = canonical_shapes(cfg)
    if nextn:
        own.update({n: t.shape for n, t in arch.of(cfg).optional_tensors(cfg).items() if n.startswith(NEXTN)})
    for name, shape in own.items():
        if name.endswith("kv_b.weight"):
            shapes.update(zip(packed_names(name), _kv_b_shapes(cfg)))
        else:
            shapes[name] = shape
    g, asym = o.group_size, not o.sym
    ent: dict[str, dict] = {}

    def add(name, **info):
        ent[name] = info

    V, H = shapes["embed.weight"]
    kp = -(-H // g) * g
    add("embed.scales", kind="raw", nbytes=V * (kp // g) * 2)
    if o.embed_bits == 4 and asym:
        add("embed.mins", kind="raw", nbytes=V * (kp // g) * 2)
    add("embed.q", kind="raw", nbytes=V * kp // 2 if o.embed_bits == 4 else V * kp)
    for name, shape in shapes.items():
        if name == "embed.weight":
            continue
        if len(shape) == 1 or name.endswith("router.weight"):
            add(name, kind="f32", shape=list(shape), nbytes=4 * int(np.prod(shape)))
            continue
        bits = o.head_bits if name == "lm_head.weight" else 8 if name in o.int8_matrices else o.linear_bits
        a = asym and bits == 4
        add(name, kind="tiles", n=shape[0], k=shape[1], bits=bits, group=g, asym=a,
            nbytes=tile_nbytes(shape[0], shape[1], bits, g, a))
    unknown = set(o.int8_matrices) - {n for n, i in ent.items() if i["kind"] == "tiles" and n != "lm_head.weight"}
    if unknown:
        raise BackendError(f"cpu_int4: int8_matrices names {sorted(unknown)[0]!r}, not a layer matrix of this model; "
                           "convert the model again")
    off = 0
    for info in ent.values():
        info["offset"] = off
        off += -(-info["nbytes"] // 64) * 64
    return ent


def cache_key(fingerprint: str, o: QuantOptions, cfg: ModelConfig) -> str:
    # keys of older packs stay: options at the values they had before they existed are left out
    opts = {k: v for k, v in o.as_json().items() if not (k == "linear_bits" and v == 4 or k == "int8_matrices" and not v)}
    # kv_b's halves padded per head (latent widths that are not whole tiles; earlier packs of such a model, which
    # the kernels then refused, laid them out unpadded): a key of their own, so such a pack is never reused
    if getattr(cfg, "kv_lora_rank", 0) and (cfg.kv_lora_rank % ROWS or cfg.v_head_dim % ROWS):
        opts["kv_b_tiles"] = True
    blob = json.dumps({"fp": fingerprint, "v": VERSION, **opts}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _bar(done: int, total: int, width: int = 30) -> str:
    n = int(width * done / max(total, 1))
    return "[" + "#" * n + "." * (width - n) + f"] {100 * done // max(total, 1):3d}%"


def write_packed(cfg: ModelConfig, weights, o: QuantOptions, out: Path, progress=None, fingerprint: str = "",
                 codes=None) -> dict:
    """Quantize `weights` into out/{weights.bin, meta.json}. Streams tensor by tensor, in row chunks,
    so memory stays bounded, and drops the source pages it has read (they are memory-mapped).
    codes(name, r0, r1, bits) -> (q, scales, mins) of rows r0:r1 as quantize4/quantize8 give them, where the
    source holds them already (a GGUF's Q4_0/Q8_0 blocks: plugins/cpu_int4/gguf_import.py), or None."""
    def quantized(name, r0, rows, bits, group):
        got = codes(name, r0, r0 + len(rows), bits) if codes else None
        if got is not None:
            return got
        w = np.asarray(rows, np.float32)
        return quantize4(w, group, o.sym, o.scale_dtype) if bits == 4 else (*quantize8(w, group, o.scale_dtype), None)

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    nextn = nextn_refusal(cfg, NEXTN + "eh_proj.weight" in weights) is None
    lay = packed_layout(cfg, o, nextn)
    total = max(i["offset"] + i["nbytes"] for i in lay.values())
    names = [n for n in lay if lay[n]["kind"] != "raw"]
    t0 = time.perf_counter()
    tmp = out / "weights.bin.part"
    with open(tmp, "wb") as f:
        f.truncate(total)

        def put(name, arr, at=0):
            f.seek(lay[name]["offset"] + at)
            f.write(np.ascontiguousarray(arr).tobytes())

        # embeddings: row-major, looked up one row per token
        emb = weights["embed.weight"]
        kp = -(-cfg.hidden_size // o.group_size) * o.group_size
        for r0 in range(0, emb.shape[0], 8192):
            q, d, m = quantized("embed.weight", r0, emb[r0:r0 + 8192], o.embed_bits, o.group_size)
            if o.embed_bits == 4:
                put("embed.q", q[:, 0::2] | (q[:, 1::2] << 4), r0 * kp // 2)
                if m is not None:
                    put("embed.mins", m.view(np.uint16), r0 * (kp // o.group_size) * 2)
            else:
                put("embed.q", q, r0 * kp)
            put("embed.scales", d.view(np.uint16), r0 * (kp // o.group_size) * 2)
            _release(emb[r0:r0 + 8192])
        for i, name in enumerate(names):
            info = lay[name]
            src = _packed_source(cfg, weights, name)
            if info["kind"] == "f32":
                put(name, np.asarray(src, np.float32))
            else:
                n, k, g = info["n"], info["k"], info["group"]
                step = max(ROWS, (1 << 22) // max(k, 1) // ROWS * ROWS)     # ~16 MB of f32 per chunk
                written = 0
                for r0 in range(0, n, step):
                    q, d, m = quantized(name, r0, src[r0:r0 + step], info["bits"], g)
                    buf = tile4(q, d, m, g) if info["bits"] == 4 else tile8(q, d, g)
                    put(name, buf, written)
                    written += buf.nbytes
                    _release(src[r0:r0 + step])
            if progress and (i + 1 == len(names) or name.endswith("ffn_down.weight") and ".experts." not in name):
                progress(f"quantizing {_bar(i + 1, len(names))} {name}")
    stats = packed_stats(cfg, lay, total)
    meta = {"format": FORMAT, "version": VERSION, "fingerprint": fingerprint, "nextn": nextn, "options": o.as_json(),
            "config": cfg.to_dict(), "tensors": lay, "stats": stats}
    os.replace(tmp, out / "weights.bin")
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    if progress:
        progress(f"packed {o.label()}: {stats['linear_bits_per_weight']:.3f} bits per weight in the layers, "
                 f"{stats['bits_per_weight']:.3f} overall, file {stats['file_bytes'] / 2**20:.1f} MiB "
                 f"({time.perf_counter() - t0:.1f} s)")
    return meta


def packed_stats(cfg: ModelConfig, lay: dict, total: int) -> dict:
    lay = {k: v for k, v in lay.items() if not k.startswith(NEXTN)}      # decoding never reads the NextN layer
    tiles = {k: v for k, v in lay.items() if v["kind"] == "tiles" and k != "lm_head.weight"}
    lin_bytes = sum(v["nbytes"] for v in tiles.values())
    lin_params = sum(v["n"] * v["k"] for v in tiles.values())
    # what one decode step reads: the layers' matrices (of the routed experts, the top_k chosen of each layer's
    # experts: on average that share of them), the MoE routers (fp32), and the output layer (one embedding row)
    routed = sum(v["nbytes"] for k, v in tiles.items() if ".experts." in k)
    active = getattr(cfg, "experts_per_token", 0) / max(getattr(cfg, "num_experts", 0), 1)
    routers = sum(v["nbytes"] for k, v in lay.items() if k.endswith("router.weight"))
    head = lay["lm_head.weight"]
    emb_bytes = sum(v["nbytes"] for k, v in lay.items() if k.startswith("embed."))
    return {
        "file_bytes": total,
        "params": cfg.num_params(),
        "bits_per_weight": 8 * total / cfg.num_params(),
        "linear_bits_per_weight": 8 * lin_bytes / lin_params,
        "head_bits_per_weight": 8 * head["nbytes"] / (head["n"] * head["k"]),
        "embed_bits_per_weight": 8 * emb_bytes / (cfg.vocab_size * cfg.hidden_size),
        "bytes_per_token": int(lin_bytes - routed + active * routed + routers + head["nbytes"]),
    }


def _release(arr) -> None:
    """Drop the pages of a memory-mapped source slice from this process (they stay in the page cache),
    so converting a large checkpoint does not grow the resident set by the checkpoint's size."""
    base = arr
    while base is not None and not isinstance(base, np.memmap):
        base = getattr(base, "base", None)
    if base is None or not isinstance(arr, np.ndarray) or arr.size == 0:
        return
    try:
        import ctypes
        import mmap
        libc = ctypes.CDLL(None, use_errno=True)
        start = arr.__array_interface__["data"][0]
        span = arr.nbytes if arr.flags.c_contiguous else 0
        if not span:
            return
        page = mmap.PAGESIZE
        a0 = (start + page - 1) // page * page          # only whole pages inside the slice
        a1 = (start + span) // page * page
        if a1 > a0:
            libc.madvise(ctypes.c_void_p(a0), ctypes.c_size_t(a1 - a0), 4)   # MADV_DONTNEED
    except (OSError, AttributeError):
        pass


def read_packed(path: Path, cfg: ModelConfig | None = None) -> tuple[dict, np.memmap]:
    """meta.json and the mapped weights.bin. Nothing in meta.json is trusted: the tensor table is
    recomputed from its options and config (both validated) and must match exactly, and the file must
    have the size that table implies; so the kernels only ever see offsets inside the mapping."""
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        raise BackendError(f"{path}: not a cpu_int4 packed model (meta.json missing or corrupt); "
                           "re-run `glmcore convert --backend cpu_int4`") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") not in (2, VERSION):
        raise BackendError(f"{path}: packed with another version of cpu_int4 (or not a packed model); "
                           "convert the model again")
    try:
        if isinstance(meta["options"], dict):
            meta["options"].setdefault("linear_bits", 4)    # packed before linear_bits existed: int4 layers
            meta["options"].setdefault("int8_matrices", [])
        o = QuantOptions.from_extra(meta["options"])
        packed_cfg = _config_of(meta["config"]).validated(f"{path / 'meta.json'} config")
        ok = o.as_json() == meta["options"] and json.loads(json.dumps(packed_cfg.to_dict())) == meta["config"] \
            and meta.setdefault("nextn", False) in (True, False)
        layout = packed_layout(packed_cfg, o, meta["nextn"]) if ok else None     # int8_matrices checked here
    except (KeyError, TypeError, AttributeError, GlmcoreError):
        ok = False
    if not ok:
        raise BackendError(f"{path}: meta.json has invalid options or config; convert the model again")
    if cfg is not None and packed_cfg != cfg:
        raise BackendError(f"{path}: packed from a different model (config differs); convert this model again")
    total = max(i["offset"] + i["nbytes"] for i in layout.values())
    if meta.get("tensors") != layout or not isinstance(meta.get("stats"), dict) \
            or meta["stats"].get("file_bytes") != total:
        raise BackendError(f"{path}: meta.json's tensor table does not match its options and config (edited or "
                           "corrupt); convert the model again")
    size = (path / "weights.bin").stat().st_size if (path / "weights.bin").is_file() else -1
    if size != total:
        raise BackendError(f"{path}: weights.bin is missing or truncated; delete the directory and convert again")
    meta["stats"] = packed_stats(packed_cfg, layout, total)
    return meta, np.memmap(path / "weights.bin", dtype=np.uint8, mode="r")


def _config_of(d: dict) -> ModelConfig:
    """The config a meta.json holds, as its architecture's config class (the MoE GLMs' carry more fields)."""
    from glmcore import arch
    cls = arch.get(d["arch"]).config_class or ModelConfig
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def ensure_packed(cfg: ModelConfig, weights, o: QuantOptions, cache_dir: Path, progress=None, codes=None) -> Path:
    """The packed model for these weights and options, converted once and then reused from the cache."""
    fp = weights.fingerprint() if hasattr(weights, "fingerprint") else _content_fingerprint(weights)
    final = Path(cache_dir) / f"cpu_int4-{cache_key(fp, o, cfg)}"
    return build_once(final, lambda tmp: write_packed(cfg, weights, o, tmp, progress, fingerprint=fp, codes=codes),
                      complete=lambda p: (p / "meta.json").is_file())


def _content_fingerprint(weights) -> str:
    """For a plain dict of arrays (tests): hash the contents."""
    h = hashlib.sha256()
    for name in sorted(weights):
        a = np.ascontiguousarray(weights[name])
        h.update(name.encode() + str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.view(np.uint8).reshape(-1).tobytes())
    return h.hexdigest()[:16]


def dequantized_weights(meta: dict, blob: np.ndarray) -> dict[str, np.ndarray]:
    """The float32 weights the packed file encodes (canonical names): the reference a kernel must match."""
    o = QuantOptions.from_extra(meta["options"])
    cfg = meta["config"]
    V, H = cfg["vocab_size"], cfg["hidden_size"]
    out = {}
    for name, info in meta["tensors"].items():
        view = blob[info["offset"]: info["offset"] + info["nbytes"]]
        if info["kind"] == "f32":
            out[name] = view.view(np.float32).reshape(info["shape"]).copy()
        elif info["kind"] == "tiles":
            out[name] = untile(view, info["n"], info["k"], info["bits"], info["group"], info["asym"], o.scale_dtype)
    for uk in [n for n in out if n.endswith(KV_B_PARTS[0])]:
        p = uk[: -len(KV_B_PARTS[0])]
        out[p + "kv_b.weight"] = kv_b_join(cfg, out.pop(uk), out.pop(p + KV_B_PARTS[1]))
    g = o.group_size
    kp = -(-H // g) * g
    t = meta["tensors"]

    def raw(name):
        return blob[t[name]["offset"]: t[name]["offset"] + t[name]["nbytes"]]

    d = raw("embed.scales").view(np.uint16).view(SCALE_DTYPES[o.scale_dtype]).reshape(V, kp // g)
    if o.embed_bits == 4:
        packed = raw("embed.q").reshape(V, kp // 2)
        q = np.empty((V, kp), np.uint8)
        q[:, 0::2], q[:, 1::2] = packed & 15, packed >> 4
        mins = raw("embed.mins").view(np.uint16).view(SCALE_DTYPES[o.scale_dtype]).reshape(V, kp // g) \
            if "embed.mins" in t else None
        out["embed.weight"] = dequantize(q, d, mins, g, 4, H)
    else:
        out["embed.weight"] = dequantize(raw("embed.q").view(np.int8).reshape(V, kp), d, None, g, 8, H)
    return out
