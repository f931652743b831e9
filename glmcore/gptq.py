"""Calibrated INT4: GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", ICLR 2023) as a transform of the f32 weights, so every backend's own packer stores
the result in its usual format and the kernels do not change.

Round to nearest (RTN) rounds each weight on its own. GPTQ runs the f32 model on a small calibration text,
takes each linear layer's input statistics H = E[x x^T], and quantizes the layer column by column, moving
each column's rounding error onto the columns not yet quantized (through H^-1) so that the layer's output
on those activations stays as close as it can. The result is a matrix of values that lie exactly on the
backend's int4 grid (the backend describes its grid: `Grid`), and each group keeps the two values its grid
is derived from, so the backend's unchanged round-to-nearest packer gives back exactly these codes.

Measured on the built-in model (README, "Calibrated INT4"), GPTQ beat AWQ-style per-channel scale search
(Lin et al. 2024), which was tried first: the scales gained a fraction of what GPTQ does, and AWQ's
per-group clipping raised the KL's 99th percentile (this model's outlier weights matter).
The embeddings (a lookup, no activations) and the int8 output layer stay round-to-nearest.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np

from .arch.rotary import rotary_tables
from .config import ModelConfig
from .errors import GlmcoreError

VERSION = 1                       # of the transform: part of every calibrated model's fingerprint
SEQ_LEN = 256                     # tokens per calibration sequence
MAX_SEQS = 64                     # at most this many sequences (16k tokens)
DEFAULT_TEXT = Path(__file__).parent / "data" / "calibration.txt"

Group = Callable[[str, int], int]      # (canonical name, input width) -> the backend's quantization group


# ---------------------------------------------------------------- calibration data

def calibration_text(path=None) -> tuple[str, str]:
    """(text, sha256 of it): the user's file, or the sample shipped with glmcore."""
    p = Path(path) if path else DEFAULT_TEXT
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise GlmcoreError(f"calibration text {str(p)!r} cannot be read as UTF-8 text ({e.__class__.__name__}); "
                           "give a plain text file with --opt calib=FILE") from None
    if not text.strip():
        raise GlmcoreError(f"calibration text {str(p)!r} is empty; give a plain text file with --opt calib=FILE")
    return text, hashlib.sha256(text.encode()).hexdigest()[:16]


def calibration_sequences(ids: list[int], prefix: list[int], seq_len: int = SEQ_LEN,
                          max_seqs: int = MAX_SEQS) -> np.ndarray:
    """The text's ids cut into [n, seq_len] sequences, each starting with the model's prefix ([gMASK]sop),
    as `glmcore eval` feeds text. A text shorter than one sequence gives one shorter sequence."""
    body = seq_len - len(prefix)
    if len(ids) < 8:
        raise GlmcoreError(f"the calibration text has {len(ids)} tokens; give at least a few sentences")
    n = max(1, min(max_seqs, len(ids) // body))
    body = min(body, len(ids))
    return np.array([prefix + ids[i * body:(i + 1) * body] for i in range(n)], dtype=np.int64)


# ---------------------------------------------------------------- the f32 forward, layer by layer

def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rotary(x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """x [B, T, heads, head_dim]: the first rotary_dim dims rotate in interleaved pairs (the dense GLM block),
    by the core's rotary table (glmcore.arch.rotary)."""
    dim = cfg.rotary_dim
    cos, sin = rotary_tables(cfg, np.arange(x.shape[1]))
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    x0, x1 = x[..., 0:dim:2], x[..., 1:dim:2]
    out = x.copy()
    out[..., 0:dim:2], out[..., 1:dim:2] = x0 * c - x1 * s, x1 * c + x0 * s
    return out


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Causal attention with grouped KV heads; q [B, T, heads, hd], k/v [B, T, kv_heads, hd] -> [B, T, q_size]."""
    B, T = q.shape[:2]
    group = cfg.num_heads // cfg.num_kv_heads
    mask = np.triu(np.full((T, T), -np.inf, np.float32), 1)
    out = np.empty((B, T, cfg.num_heads, cfg.head_dim), np.float32)
    for b in range(B):                       # one sequence at a time: [heads, T, T] scores stay small
        kk = np.repeat(k[b], group, axis=1).transpose(1, 2, 0)      # [heads, hd, T]
        vv = np.repeat(v[b], group, axis=1).transpose(1, 0, 2)      # [heads, T, hd]
        s = q[b].transpose(1, 0, 2) @ kk / np.float32(cfg.head_dim ** 0.5) + mask     # matmul: BLAS, not einsum
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        out[b] = (s @ vv).transpose(1, 0, 2)
    return out.reshape(B, T, cfg.q_size)


def _f32(weights, name: str) -> np.ndarray:
    return np.array(weights[name], dtype=np.float32)


def layer_inputs(cfg: ModelConfig, weights, seqs: np.ndarray) -> Iterator[tuple[int, dict[str, np.ndarray], np.ndarray]]:
    """Runs the f32 model on seqs [B, T] layer by layer, yielding (layer, {linear: its input [B*T, in]},
    the residual stream after the layer [B, T, hidden])."""
    x = _f32(weights, "embed.weight")[seqs]
    B, T = seqs.shape
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        w = {k: _f32(weights, p + k) for k in ("input_norm.weight", "qkv.weight", "attn_out.weight",
                                                 "post_attn_norm.weight", "ffn_up.weight", "ffn_down.weight")}
        h = _rms(x, w["input_norm.weight"], cfg.norm_eps)
        qkv = h @ w["qkv.weight"].T
        if cfg.qkv_bias:
            qkv += _f32(weights, p + "qkv.bias")
        q, k, v = np.split(qkv, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
        q = _rotary(q.reshape(B, T, cfg.num_heads, cfg.head_dim), cfg)
        k = _rotary(k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim), cfg)
        a = _attention(q, k, v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim), cfg)
        out = a @ w["attn_out.weight"].T
        if cfg.post_norms:
            out = _rms(out, _f32(weights, p + "post_self_attn_norm.weight"), cfg.norm_eps)
        x = x + out
        h2 = _rms(x, w["post_attn_norm.weight"], cfg.norm_eps)
        gate, up = np.split(h2 @ w["ffn_up.weight"].T, 2, axis=-1)
        act = gate / (1.0 + np.exp(-gate)) * up
        out = act @ w["ffn_down.weight"].T
        if cfg.post_norms:
            out = _rms(out, _f32(weights, p + "post_mlp_norm.weight"), cfg.norm_eps)
        x = x + out
        yield i, {"qkv.weight": h.reshape(B * T, -1), "attn_out.weight": a.reshape(B * T, -1),
                  "ffn_up.weight": h2.reshape(B * T, -1), "ffn_down.weight": act.reshape(B * T, -1)}, x


# ---------------------------------------------------------------- GPTQ

GPTQ_BLOCK = 128          # columns updated together (the lazy batch of Frantar et al.); a multiple of every group
GPTQ_DAMP = 0.01          # of the Hessian's mean diagonal, added to it (the paper's default)

# (canonical name, a group's current values [n, g]) -> (a, b, lo, hi): the backend stores a*q + b, q an integer
# in [lo, hi], a and b [n] computed from the group as its round-to-nearest packer computes them; or None
# where the backend does not store that tensor as int4 (it is then left as it is)
Grid = Callable[[str, np.ndarray], "tuple | None"]


def gptq(w: np.ndarray, h: np.ndarray, grid: Callable[[np.ndarray], tuple], g: int) -> np.ndarray:
    """GPTQ (Frantar et al., ICLR 2023): quantize w [n, k] column by column, each column's rounding error
    spread over the columns not yet quantized through the inverse Hessian h = E[x x^T] [k, k], so the layer's
    output error on the calibration activations is what is minimised, not each weight's own error.
    Each group's grid is taken from its current values when its first column comes (as the reference code
    does), and the group's two extremes keep their round-to-nearest codes: those are the values the packer
    derives the grid from, so the backend's own round-to-nearest of the result gives back exactly these codes
    -- the same packed format, and no other code change. Returns the quantized values, f32 [n, k]."""
    w = np.array(w, np.float64)
    n, k = w.shape
    h = np.array(h, np.float64)
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h[np.diag_indices(k)] += GPTQ_DAMP * np.mean(np.diag(h))
    # the upper Cholesky factor of h^-1: row i holds how column i's error moves the later columns
    hinv = np.linalg.cholesky(np.linalg.inv(h)).T
    out = np.zeros_like(w)
    rows = np.arange(n)
    block = GPTQ_BLOCK if GPTQ_BLOCK % g == 0 else g      # a group never straddles two blocks (per-channel: one)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, err1 = w[:, i1:i2].copy(), np.zeros((n, i2 - i1))
        for i in range(i2 - i1):
            c = i1 + i
            if c % g == 0:
                blk = w1[:, i:i + g]
                a, b, lo, hi = (np.asarray(v, np.float64) for v in grid(blk.astype(np.float32)))
                a_safe = np.where(a == 0, 1.0, a)
                # the group's extremes, with the codes round to nearest gives them now
                ext_cols = np.stack([c + blk.argmax(1), c + blk.argmin(1)])
                ext_codes = {"max": np.clip(np.rint((blk[rows, blk.argmax(1)] - b) / a_safe), lo, hi),
                             "min": np.clip(np.rint((blk[rows, blk.argmin(1)] - b) / a_safe), lo, hi)}
            col = w1[:, i]
            q = np.clip(np.rint((col - b) / a_safe), lo, hi)
            q = np.where(ext_cols[0] == c, ext_codes["max"], q)
            q = np.where(ext_cols[1] == c, ext_codes["min"], q)
            val = np.where(a == 0, b, a * q + b)
            out[:, c] = val
            e = (col - val) / hinv[c, c]
            w1[:, i:] -= np.outer(e, hinv[c, c:i2])
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return out.astype(np.float32)


def make_gptq_plan(cfg: ModelConfig, weights, seqs: np.ndarray, grid: Grid, group: Group, progress: Callable[[str], None] | None = None) -> dict[str, np.ndarray]:
    """GPTQ on every linear layer of every block, on the f32 model's activations: {name + ":q": values}."""
    plan: dict[str, np.ndarray] = {}
    for i, inputs, _ in layer_inputs(cfg, weights, seqs):
        p = f"layers.{i}."
        for name, x in inputs.items():
            if grid(p + name, np.zeros((1, 1), np.float32)) is None:
                continue
            x64 = x.astype(np.float64)
            h = x64.T @ x64 / len(x64)
            plan[p + name + ":q"] = gptq(_f32(weights, p + name), h, lambda blk, n=p + name: grid(n, blk),
                                         group(p + name, x.shape[1]))
        if progress:
            progress(f"calibrating (GPTQ) layer {i + 1}/{cfg.num_layers}")
    return plan


class CalibratedWeights(Mapping):
    """The source weights with the calibrated layers replaced by their GPTQ values (f32), everything else as
    it is. Its fingerprint is known before the calibration runs (source, method version, the backend's
    grid, the calibration text), so a cached conversion is found without calibrating again; the calibration
    runs on the first read of a tensor."""

    def __init__(self, source, make: Callable[[], dict[str, np.ndarray]], tag: dict):
        self.source, self._make, self._plan = source, make, None
        self.config = getattr(source, "config", None)
        self.files = getattr(source, "files", [])
        self.tag = tag

    def fingerprint(self) -> str:
        src = self.source.fingerprint() if hasattr(self.source, "fingerprint") else _content_hash(self.source)
        blob = json.dumps({"source": src, "gptq": VERSION, **self.tag}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def plan(self) -> dict[str, np.ndarray]:
        if self._plan is None:
            self._plan = self._make()
        return self._plan

    def __iter__(self):
        return iter(self.source)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, name: str) -> np.ndarray:
        plan = self.plan()
        return plan[name + ":q"] if name + ":q" in plan else self.source[name]

    def f32(self, name: str) -> np.ndarray:
        return np.asarray(self[name], dtype=np.float32)


def _content_hash(weights) -> str:
    h = hashlib.sha256()
    for name in sorted(weights):
        a = np.ascontiguousarray(weights[name])
        h.update(name.encode() + str(a.dtype).encode() + str(a.shape).encode() + a.view(np.uint8).tobytes())
    return h.hexdigest()[:16]


def calibrated(cfg: ModelConfig, weights, grid: Grid, group: Group, grid_key: str, calib_path=None,
               seqs: np.ndarray | None = None, progress=None) -> CalibratedWeights:
    """`weights` with every block's linear layers quantized by GPTQ onto the backend's int4 grid (`grid`,
    named by grid_key for the fingerprint), calibrated on `seqs` [n, T] ids, or on the text at calib_path
    (default: the sample shipped with glmcore) read with the model's tokenizer (beside its files)."""
    if seqs is not None:
        seqs = np.asarray(seqs, np.int64)
        tag = {"grid": grid_key, "ids": hashlib.sha256(seqs.tobytes()).hexdigest()[:16]}
        return CalibratedWeights(weights, lambda: make_gptq_plan(cfg, weights, seqs, grid, group, progress), tag)
    text, text_hash = calibration_text(calib_path)
    tag = {"grid": grid_key, "text": text_hash, "seq_len": SEQ_LEN, "max_seqs": MAX_SEQS}

    def make_from_text():
        from .chat import chat_format_for
        from .tokenizer import load_tokenizer
        files = getattr(weights, "files", None)
        if not files:
            raise GlmcoreError("calibrated quantization needs the model's tokenizer: load the weights from a "
                               "checkpoint directory")
        tok = load_tokenizer(Path(files[0]).parent, cfg.family)
        ids = calibration_sequences(tok.encode(text), list(chat_format_for(tok).prefix))
        if progress:
            progress(f"calibrating (GPTQ) on {ids.size} tokens of {calib_path or 'the sample shipped with glmcore'}")
        return make_gptq_plan(cfg, weights, ids, grid, group, progress)
    return CalibratedWeights(weights, make_from_text, tag)
