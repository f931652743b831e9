"""The packed model mapped from disk and driven by one native call per step.

Int4BatchSession holds n_slots sequences (a KV ring of `capacity` positions each) over one mapping of
the weights; one step runs the tokens of every entry through the layers together, so each weight
matrix is read once for all of them. Int4Session, the single-sequence contract, is slot 0 of a
one-slot Int4BatchSession: the same native code path.
"""
from __future__ import annotations

import ctypes as C
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from glmcore.arch import rotary
from glmcore.backend import BatchSession, Capabilities, KVBlob, LoadOptions, SlotSession, default_capacity
from glmcore.config import ModelConfig
from glmcore.errors import BackendError, GlmcoreError

from . import native
from .quant import NEXTN, QuantOptions, nextn_refusal, read_packed

MAX_BATCH = 128      # tokens per native chunk of a step (bounds the work buffers)


def rope_tables(cfg: ModelConfig, capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """cos/sin [capacity, rotary_dim/2] and inv_freq [rotary_dim/2], fp32: the core's table (glmcore.arch.rotary)."""
    cos, sin = rotary.rotary_tables(cfg, np.arange(capacity))
    return cos, sin, rotary.inv_freq(cfg)


class Int4BatchSession(BatchSession):

    def __init__(self, cfg: ModelConfig, packed_dir: Path, options: LoadOptions, caps: Capabilities,
                 isa: int, threads: int, kv_dtype: str = "f16", n_slots: int = 1):
        if not isinstance(n_slots, int) or n_slots < 1:
            raise GlmcoreError(f"cpu_int4: n_slots must be a positive number of sequences, not {n_slots!r}")
        self.cfg, self.n_slots = cfg, n_slots
        self.capacity = default_capacity(cfg, caps, options.capacity)
        self.meta, self._blob = read_packed(packed_dir, cfg)
        self.quant = QuantOptions.from_extra(self.meta["options"])
        self.isa, self.threads, self.kv_dtype = isa, threads, kv_dtype
        self.packed_dir = Path(packed_dir)
        self._cos, self._sin, self._inv = rope_tables(cfg, self.capacity)
        self._spec, self._layers = self._build_spec()
        self._lib = native.lib()
        self._h = None
        self._create()
        self.nextn: NextNState | None = None      # what the NextN layer drafts from, kept once start_nextn is called
        # why --speculative mtp cannot run here (None: it can)
        self.nextn_refusal = None if self._nextn_struct else nextn_refusal(cfg, self.meta["nextn"])

    # ------------------------------------------------------------ wiring the mapped file to the C structs

    def _build_spec(self):
        cfg, t, base = self.cfg, self.meta["tensors"], self._blob.ctypes.data
        o = self.quant
        bf16 = int(o.scale_dtype == "bf16")
        sparse_layers = getattr(cfg, "sparse_layers", ())
        mla = hasattr(cfg, "kv_lora_rank")

        def ptr(name):
            return base + t[name]["offset"] if name in t else None

        def mat(name):
            if name not in t:
                return native.Mat()          # data NULL: absent
            i = t[name]
            return native.make_mat(None, i["n"], i["k"], i["bits"], i["group"], i["asym"], o.scale_dtype,
                                   base=ptr(name))

        self._expert_tables = []            # the per-layer expert arrays the C structs point into

        def fill(L, p: str, sparse: bool):
            """Layer struct L over the packed tensors of the decoder layer named p."""
            L.input_norm, L.post_norm = ptr(p + "input_norm.weight"), ptr(p + "post_attn_norm.weight")
            L.qkv_bias = ptr(p + "qkv.bias")
            L.post_self_attn_norm, L.post_mlp_norm = ptr(p + "post_self_attn_norm.weight"), ptr(p + "post_mlp_norm.weight")
            L.q_norm, L.k_norm = ptr(p + "q_norm.weight"), ptr(p + "k_norm.weight")
            L.qkv, L.attn_out = mat(p + "qkv.weight"), mat(p + "attn_out.weight")
            if mla:
                L.q_a, L.q_b = mat(p + "q_a.weight"), mat(p + ("q_b.weight" if cfg.q_lora_rank else "q.weight"))
                L.q_a_bias, L.q_a_norm = ptr(p + "q_a.bias"), ptr(p + "q_a_norm.weight")
                L.kv_a, L.kv_a_bias, L.kv_a_norm = mat(p + "kv_a.weight"), ptr(p + "kv_a.bias"), ptr(p + "kv_a_norm.weight")
                L.kv_uk, L.kv_uv = mat(p + "kv_b_uk.weight"), mat(p + "kv_b_uv.weight")
                L.attn_out_bias = ptr(p + "attn_out.bias")
            if sparse:
                L.sparse = 1
                L.router, L.router_bias = ptr(p + "router.weight"), ptr(p + "router.bias")
                up = (native.Mat * cfg.num_experts)(*[mat(p + f"experts.{e}.ffn_up.weight") for e in range(cfg.num_experts)])
                down = (native.Mat * cfg.num_experts)(*[mat(p + f"experts.{e}.ffn_down.weight")
                                                        for e in range(cfg.num_experts)])
                self._expert_tables += [up, down]
                L.exp_up, L.exp_down = up, down
                L.shared_up, L.shared_down = mat(p + "shared.ffn_up.weight"), mat(p + "shared.ffn_down.weight")
            else:
                L.ffn_up, L.ffn_down = mat(p + "ffn_up.weight"), mat(p + "ffn_down.weight")

        layers = (native.Layer * cfg.num_layers)()
        for i in range(cfg.num_layers):
            fill(layers[i], f"layers.{i}.", bool(sparse_layers and sparse_layers[i]))
        nextn = None
        if self.meta["nextn"]:     # a NextN layer of a MoE GLM is an MoE layer (as torch_ref's)
            nextn = native.NextN(ptr(NEXTN + "enorm.weight"), ptr(NEXTN + "hnorm.weight"),
                                 ptr(NEXTN + "final_norm.weight"), mat(NEXTN + "eh_proj.weight"))
            fill(nextn.layer, NEXTN + "layer.", bool(sparse_layers))
        self._nextn_struct = nextn
        kp = -(-cfg.hidden_size // o.group_size) * o.group_size
        emb = native.Emb(ptr("embed.scales"), ptr("embed.mins"), ptr("embed.q"),
                         cfg.vocab_size, cfg.hidden_size, kp, o.embed_bits, o.group_size,
                         int(not o.sym and o.embed_bits == 4), bf16)
        moe = dict(n_experts=cfg.num_experts, top_k=cfg.experts_per_token, n_groups=cfg.num_groups,
                   topk_groups=cfg.topk_groups, norm_topk=int(cfg.norm_topk_prob), moe_ffn=cfg.moe_ffn_hidden_size,
                   shared_ffn=cfg.moe_ffn_hidden_size * cfg.num_shared_experts,
                   routed_scaling=cfg.routed_scaling) if sparse_layers else {}
        latent = dict(mla=1, q_lora=cfg.q_lora_rank, kv_lora=cfg.kv_lora_rank, nope=cfg.qk_nope_dim,
                      v_dim=cfg.v_head_dim, latent_eps=cfg.latent_norm_eps) if mla else {}
        spec = native.Spec(
            hidden=cfg.hidden_size, n_layers=cfg.num_layers, n_heads=cfg.num_heads, n_kv=cfg.num_kv_heads,
            head_dim=cfg.head_dim, ffn=cfg.ffn_hidden_size, vocab=cfg.vocab_size, capacity=self.capacity,
            kv_f16=int(self.kv_dtype == "f16"), max_batch=MAX_BATCH, nthreads=self.threads, isa=self.isa,
            n_slots=self.n_slots, rot_dim=cfg.rotary_dim, norm_eps=cfg.norm_eps, rope_cos=self._cos.ctypes.data,
            rope_sin=self._sin.ctypes.data, inv_freq=self._inv.ctypes.data, embed=emb,
            final_norm=ptr("final_norm.weight"), head=mat("lm_head.weight"), layers=layers,
            # the NextN layer (and its ring layer in every slot) only once start_nextn asks for it
            rope_neox=int(not cfg.rotary_interleaved), nextn=None, **moe, **latent)
        return spec, layers

    def _create(self) -> None:
        """The C model for self._spec (a new one: every slot's ring starts empty)."""
        if self._h:
            self._lib.glmi4_destroy(self._h)
            self._h = None
        err = C.create_string_buffer(512)
        self._h = self._lib.glmi4_create(C.byref(self._spec), err, len(err))
        if not self._h:
            raise BackendError(f"cpu_int4: {err.value.decode(errors='replace')}")

    # ------------------------------------------------------------ the BatchSession contract

    def _alive(self):
        if not self._h:
            raise GlmcoreError("cpu_int4: this session is closed; load the model again")
        return self._h

    def _slot(self, slot) -> int:
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.n_slots:
            raise GlmcoreError(f"cpu_int4: slot {slot!r} does not exist; slots are 0..{self.n_slots - 1}")
        return int(slot)

    def kv_len(self, slot: int) -> int:
        return self._lib.glmi4_kv_len(self._alive(), self._slot(slot))

    def forward(self, entries: Sequence[tuple[int, Sequence[int]]], all_logits: Sequence[bool] | None = None):
        h = self._alive()
        V = self.cfg.vocab_size
        slots, parts = [], []
        for slot, ids in entries:        # slots, counts and capacity were checked by the core (BatchSession.step)
            arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64).reshape(-1)
            if arr.min() < 0 or arr.max() >= V:      # the C kernels index the embedding with these
                bad = int(arr[(arr < 0) | (arr >= V)][0])
                raise GlmcoreError(f"token id {bad} is outside the vocabulary (0..{V - 1}); "
                                   "the ids come from another tokenizer")
            slots.append(int(slot))
            parts.append(arr)
        counts = np.array([p.size for p in parts], np.int32)
        ids32 = np.ascontiguousarray(np.concatenate(parts), dtype=np.int32)
        slots32 = np.array(slots, np.int32)
        # logits rows of each entry: its last, or all of them where all_logits asks (None: every entry its last)
        every = None if all_logits is None else np.array(all_logits, np.uint8)
        per_entry = None if every is None else np.where(every, counts, 1)
        out = np.empty((len(parts) if every is None else int(per_entry.sum()), V), np.float32)
        starts = [self.kv_len(s) for s in slots] if self.nextn else None
        hidden = np.empty((ids32.size, self.cfg.hidden_size), np.float32) if self.nextn else None
        rc = self._lib.glmi4_step(h, ids32.ctypes.data, slots32.ctypes.data, counts.ctypes.data, len(parts),
                                  out.ctypes.data, None if every is None else every.ctypes.data,
                                  hidden.ctypes.data if self.nextn else None)
        if rc != 0:
            raise BackendError(f"cpu_int4: forward step failed (code {rc})")
        if self.nextn:
            for slot, start, arr, rows in zip(slots, starts, parts, np.split(hidden, np.cumsum(counts)[:-1])):
                self.nextn.fed(slot, start, arr, rows)
        return out if every is None else np.split(out, np.cumsum(per_entry)[:-1])

    def _where(self, slot: int) -> str:
        return f" in slot {slot}" if self.n_slots > 1 else ""

    def reset(self, slot: int) -> None:
        self._lib.glmi4_reset(self._alive(), self._slot(slot))
        if self.nextn:
            self.nextn.lens[slot] = 0

    def shift(self, slot: int, n_keep: int, n_discard: int) -> None:
        h, slot = self._alive(), self._slot(slot)
        n = self.kv_len(slot)
        if n_keep < 0 or n_discard < 0 or n_keep + n_discard > n:
            raise GlmcoreError(f"cannot shift the window{self._where(slot)}: keep {n_keep} + discard {n_discard} "
                               f"exceeds the {n} cached tokens")
        if self._lib.glmi4_shift(h, slot, int(n_keep), int(n_discard)) != 0:
            raise BackendError("cpu_int4: window shift failed")
        if self.nextn:
            self.nextn.shift(slot, n, int(n_keep), int(n_discard))

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        h, src, dst = self._alive(), self._slot(src), self._slot(dst)
        have = self.kv_len(src)
        if not 0 <= n <= have:
            raise GlmcoreError(f"cpu_int4: cannot copy {n} positions from slot {src}, which holds {have}")
        if self._lib.glmi4_copy_prefix(h, src, dst, int(n)) != 0:
            raise BackendError("cpu_int4: copying a prefix failed")
        if self.nextn:
            self.nextn.copy_prefix(src, dst, int(n))

    # ------------------------------------------------------------ the NextN (MTP) drafter

    @property
    def has_nextn(self) -> bool:
        return self._nextn_struct is not None

    def start_nextn(self) -> None:
        """From now on the step hands back the final hidden states (only then: a NULL pointer otherwise), and each
        slot's ring has a layer for the NextN layer's KV: the C model is made again with it, so this comes before
        any token is fed (the mtp drafter calls it when the scheduler is made). Without it nothing is reserved."""
        if self._nextn_struct is None:
            raise GlmcoreError(f"cpu_int4: --speculative mtp cannot run: {self.nextn_refusal}")
        if self.nextn is None:
            if any(self.kv_len(s) for s in range(self.n_slots)):
                raise BackendError("cpu_int4: start_nextn after tokens were fed; start the NextN drafter before "
                                   "the first step (load the model with --speculative mtp)")
            self._spec.nextn = C.pointer(self._nextn_struct)
            self._create()
            self.nextn = NextNState(self.n_slots, self.capacity, self.cfg.hidden_size)

    def draft_nextn(self, slot: int, token: int, k: int) -> list[int]:
        """k greedy drafts after `token` (sampled, not yet fed) from the packed NextN layer, as torch_ref's: it first
        catches up on the positions the target fed since its last draft (each with the next fed token and the
        target's hidden state there), then chains on its own output. Drafts past the ring's end are not made."""
        slot, m = self._slot(slot), self.nextn
        if m is None:
            if self._nextn_struct is None:
                raise GlmcoreError(f"cpu_int4: --speculative mtp cannot run: {self.nextn_refusal}")
            raise BackendError("cpu_int4: draft_nextn before start_nextn: the hidden states it drafts from were "
                               "not kept")
        n = self.kv_len(slot)
        if n < 1:
            raise GlmcoreError(f"cpu_int4: slot {slot} holds no tokens to draft after; prefill it first")
        if not 0 <= int(token) < self.cfg.vocab_size:
            raise GlmcoreError(f"token id {token} is outside the vocabulary (0..{self.cfg.vocab_size - 1})")
        done = min(m.lens[slot], n - 1)
        ids = np.append(m.ids[slot, done + 1:n], int(token))
        drafts, state = [], m.hidden[slot, done:n]
        for j in range(min(int(k), self.capacity - n + 1)):     # chained drafts: past n, overwritten by the next catch-up
            logits, state = self.nextn_logits(slot, done if j == 0 else n + j - 1, ids, state)
            m.lens[slot] = n           # positions < n now hold what the target's own tokens and states give
            drafts.append(int(np.argmax(logits)))
            ids, state = [drafts[-1]], state[None]
        return drafts

    def nextn_logits(self, slot: int, start: int, ids, states: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The NextN layer over positions start.. of slot (ids: the token after each, states: the hidden state at
        each): the last position's logits [vocab] and its layer output [hidden] (what a chained draft takes)."""
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        states = np.ascontiguousarray(states, dtype=np.float32)
        logits, x = np.empty(self.cfg.vocab_size, np.float32), np.empty(self.cfg.hidden_size, np.float32)
        rc = self._lib.glmi4_draft(self._alive(), self._slot(slot), int(start), ids.size, ids.ctypes.data, states.ctypes.data,
                                   logits.ctypes.data, x.ctypes.data)
        if rc != 0:
            raise BackendError(f"cpu_int4: NextN draft failed (code {rc})")
        return logits, x

    def export_prefix(self, slot: int, n: int) -> KVBlob:
        """The slot's first n positions as the C cache holds them (K/V rows or latent rows, f16 or f32)."""
        h, slot = self._alive(), self._slot(slot)
        have = self.kv_len(slot)
        if not 0 < n <= have:
            raise GlmcoreError(f"cpu_int4: cannot export {n} positions of slot {slot}, which holds {have}")
        out = np.empty(self._lib.glmi4_kv_bytes(h, int(n)), np.uint8)
        if self._lib.glmi4_kv_export(h, slot, int(n), out.ctypes.data) != 0:
            raise BackendError("cpu_int4: exporting a KV prefix failed")
        if self.nextn is None:
            return KVBlob(int(n), (out,))
        m = self.nextn        # what the NextN layer drafts from travels too (its cache rows are in `out`)
        return KVBlob(int(n), (out, m.ids[slot, :n].copy(), m.hidden[slot, :n].copy(),
                               np.array([max(min(m.lens[slot], n - 1), 0)])))

    def import_prefix(self, slot: int, blob: KVBlob) -> None:
        h = self._alive()
        self.check_blob(slot, blob, 1 if self.nextn is None else 4)
        data = blob.parts[0]
        if data.dtype != np.uint8 or data.size != self._lib.glmi4_kv_bytes(h, blob.n):
            raise BackendError(f"cpu_int4: a KV blob of {data.nbytes} bytes is not {blob.n} positions of this "
                               "model's cache; it was exported by another model or kv_dtype")
        data = np.ascontiguousarray(data)
        if self._lib.glmi4_kv_import(h, int(slot), blob.n, data.ctypes.data) != 0:
            raise BackendError("cpu_int4: importing a KV prefix failed")
        if self.nextn is not None:
            ids, hidden, held = blob.parts[1:]
            if ids.shape != (blob.n,) or hidden.shape != (blob.n, self.cfg.hidden_size) or held.shape != (1,):
                raise BackendError("cpu_int4: a KV blob's NextN state does not fit this model; it was exported by "
                                   "another model")
            self.nextn.fed(slot, 0, ids, hidden)
            self.nextn.lens[slot] = int(held[0])

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
                "quantization": self.quant.label(), "file_bytes": s["file_bytes"], "slots": self.n_slots,
                "bytes_per_token": s["bytes_per_token"], "bits_per_weight": round(s["bits_per_weight"], 3),
                "linear_bits_per_weight": round(s["linear_bits_per_weight"], 3), "packed": str(self.packed_dir)}


class NextNState:
    """The NextN layer's side of a batch session (its KV cache is a layer of each slot's ring in the C model): per
    slot the fed ids and the target's final hidden states by position, and how many positions its cache holds."""

    def __init__(self, n_slots: int, capacity: int, hidden: int):
        self.ids = np.zeros((n_slots, capacity), np.int32)
        self.hidden = np.zeros((n_slots, capacity, hidden), np.float32)
        self.lens = [0] * n_slots

    def fed(self, slot: int, start: int, ids: np.ndarray, hidden: np.ndarray) -> None:
        self.ids[slot, start:start + ids.size], self.hidden[slot, start:start + ids.size] = ids, hidden

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Position i of the NextN cache needs the target's id at i + 1: n kept positions keep n - 1 of it."""
        if src != dst:
            self.ids[dst, :n], self.hidden[dst, :n] = self.ids[src, :n], self.hidden[src, :n]
        self.lens[dst] = max(min(self.lens[src], n - 1), 0)

    def shift(self, slot: int, n: int, n_keep: int, n_discard: int) -> None:
        """The target dropped positions n_keep..n_keep+n_discard-1 of n: the ids and states move down with it. The
        NextN cache keeps only the sinks before n_keep - 1 (position n_keep - 1 paired with a dropped id); the next
        draft recomputes the rest from the kept states, so the drafts stay a function of what the target holds."""
        if n_discard:
            keep = slice(n_keep + n_discard, n)
            self.ids[slot, n_keep:n - n_discard] = self.ids[slot, keep].copy()
            self.hidden[slot, n_keep:n - n_discard] = self.hidden[slot, keep].copy()
            self.lens[slot] = max(min(self.lens[slot], n_keep - 1), 0)


class Int4Session(SlotSession):
    """One sequence: slot 0 of a one-slot Int4BatchSession."""

    # what tests and the benchmark read about the loaded model
    meta = property(lambda self: self.batch.meta)
    _blob = property(lambda self: self.batch._blob)
    isa = property(lambda self: self.batch.isa)
    packed_dir = property(lambda self: self.batch.packed_dir)

    def info(self) -> dict:
        return self.batch.info()
