"""Int4Session: the packed model mapped from disk, one native call per prefill/decode step."""
from __future__ import annotations

import ctypes as C
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from glmcore.backend import Capabilities, LoadOptions, Session, default_capacity
from glmcore.config import ModelConfig
from glmcore.errors import BackendError, ContextOverflow, GlmcoreError

from . import native
from .quant import QuantOptions, read_packed

MAX_BATCH = 128      # tokens per native chunk of a prefill (bounds the work buffers)


def rope_tables(cfg: ModelConfig, capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """cos/sin [capacity, head_dim/4] in fp32, computed as the reference does; inv_freq [head_dim/4]."""
    dim = cfg.rotary_dim
    inv_freq = (np.float32(1.0) / (np.float32(cfg.rope_base) ** (np.arange(0, dim, 2, dtype=np.float32)
                                                                 / np.float32(dim)))).astype(np.float32)
    angles = np.arange(capacity, dtype=np.float32)[:, None] * inv_freq[None, :]
    return (np.cos(angles.astype(np.float64)).astype(np.float32),
            np.sin(angles.astype(np.float64)).astype(np.float32), inv_freq)


class Int4Session(Session):
    def __init__(self, cfg: ModelConfig, packed_dir: Path, options: LoadOptions, caps: Capabilities,
                 isa: int, threads: int, kv_dtype: str = "f16"):
        self.cfg = cfg
        self.capacity = default_capacity(cfg, caps, options.capacity)
        self.meta, self._blob = read_packed(packed_dir, cfg)
        self.quant = QuantOptions(**self.meta["options"])
        self.isa, self.threads, self.kv_dtype = isa, threads, kv_dtype
        self.packed_dir = Path(packed_dir)
        self._cos, self._sin, self._inv = rope_tables(cfg, self.capacity)
        self._spec, self._layers = self._build_spec()
        err = C.create_string_buffer(512)
        self._lib = native.lib()
        self._h = self._lib.glmi4_create(C.byref(self._spec), err, len(err))
        if not self._h:
            raise BackendError(f"cpu_int4: {err.value.decode(errors='replace')}")

    # ------------------------------------------------------------ wiring the mapped file to the C structs

    def _build_spec(self):
        cfg, t, base = self.cfg, self.meta["tensors"], self._blob.ctypes.data
        o = self.quant
        bf16 = int(o.scale_dtype == "bf16")

        def ptr(name):
            return base + t[name]["offset"]

        def mat(name):
            i = t[name]
            return native.make_mat(None, i["n"], i["k"], i["bits"], i["group"], i["asym"], o.scale_dtype,
                                   base=ptr(name))

        layers = (native.Layer * cfg.num_layers)()
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            L = layers[i]
            L.input_norm, L.post_norm = ptr(p + "input_norm.weight"), ptr(p + "post_attn_norm.weight")
            L.qkv_bias = ptr(p + "qkv.bias") if cfg.qkv_bias else None
            L.qkv, L.attn_out = mat(p + "qkv.weight"), mat(p + "attn_out.weight")
            L.ffn_up, L.ffn_down = mat(p + "ffn_up.weight"), mat(p + "ffn_down.weight")
        kp = -(-cfg.hidden_size // o.group_size) * o.group_size
        emb = native.Emb(ptr("embed.scales"), ptr("embed.mins") if "embed.mins" in t else None, ptr("embed.q"),
                         cfg.vocab_size, cfg.hidden_size, kp, o.embed_bits, o.group_size,
                         int(not o.sym and o.embed_bits == 4), bf16)
        spec = native.Spec(
            hidden=cfg.hidden_size, n_layers=cfg.num_layers, n_heads=cfg.num_heads, n_kv=cfg.num_kv_heads,
            head_dim=cfg.head_dim, ffn=cfg.ffn_hidden_size, vocab=cfg.vocab_size, capacity=self.capacity,
            kv_f16=int(self.kv_dtype == "f16"), max_batch=MAX_BATCH, nthreads=self.threads, isa=self.isa,
            norm_eps=cfg.norm_eps, rope_cos=self._cos.ctypes.data, rope_sin=self._sin.ctypes.data,
            inv_freq=self._inv.ctypes.data, embed=emb, final_norm=ptr("final_norm.weight"),
            head=mat("lm_head.weight"), layers=layers)
        return spec, layers

    # ------------------------------------------------------------ the Session contract

    @property
    def kv_len(self) -> int:
        return self._lib.glmi4_kv_len(self._alive())

    def _alive(self):
        if not self._h:
            raise GlmcoreError("cpu_int4: this session is closed; load the model again")
        return self._h

    def _run(self, ids: Sequence[int], all_logits: bool) -> np.ndarray:
        h = self._alive()
        arr = np.asarray(list(ids), dtype=np.int64)
        if arr.size == 0:
            raise GlmcoreError("cpu_int4: nothing to prefill (empty token list)")
        if arr.min() < 0 or arr.max() >= self.cfg.vocab_size:
            bad = int(arr[(arr < 0) | (arr >= self.cfg.vocab_size)][0])
            raise GlmcoreError(f"token id {bad} is outside the vocabulary (0..{self.cfg.vocab_size - 1}); "
                               "the ids come from another tokenizer")
        n, have = int(arr.size), self.kv_len
        if have + n > self.capacity:
            raise ContextOverflow(f"{have + n} tokens ({have} cached + {n} new) exceed the context of "
                                  f"{self.capacity}; raise --ctx or use --overflow window")
        ids32 = np.ascontiguousarray(arr, dtype=np.int32)
        out = np.empty((n, self.cfg.vocab_size) if all_logits else (self.cfg.vocab_size,), np.float32)
        rc = self._lib.glmi4_forward(h, ids32.ctypes.data, n, out.ctypes.data, int(all_logits))
        if rc != 0:
            raise BackendError(f"cpu_int4: forward step failed (code {rc})")
        return out

    def prefill(self, ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        return self._run(ids, all_logits)

    def decode(self, token: int) -> np.ndarray:
        return self._run([int(token)], False)

    def shift(self, n_keep: int, n_discard: int) -> None:
        h = self._alive()
        if n_keep < 0 or n_discard < 0 or n_keep + n_discard > self.kv_len:
            raise GlmcoreError(f"cannot shift the window: keep {n_keep} + discard {n_discard} exceeds the "
                               f"{self.kv_len} cached tokens")
        if self._lib.glmi4_shift(h, int(n_keep), int(n_discard)) != 0:
            raise BackendError("cpu_int4: window shift failed")

    def reset(self) -> None:
        self._lib.glmi4_reset(self._alive())

    def close(self) -> None:
        if getattr(self, "_h", None):
            self._lib.glmi4_destroy(self._h)
            self._h = None
        self._blob = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------ what the benchmark and probe report

    def info(self) -> dict:
        s = self.meta["stats"]
        return {"isa": native.ISAS[self.isa], "threads": self.threads, "kv_dtype": self.kv_dtype,
                "quantization": self.quant.label(), "file_bytes": s["file_bytes"],
                "bytes_per_token": s["bytes_per_token"], "bits_per_weight": round(s["bits_per_weight"], 3),
                "linear_bits_per_weight": round(s["linear_bits_per_weight"], 3), "packed": str(self.packed_dir)}
