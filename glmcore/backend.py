"""The contract between the core and a backend plugin, and plugin discovery.

A plugin is a module registered under the entry-point group ``glmcore.backends`` that implements the
``glmcore_backends`` hook, returning Backend objects. The built-in backends register exactly this way.
A plugin sees token ids in and float32 logits out; it never sees text, sampling or chat roles.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pluggy

from .config import ModelConfig
from .errors import BackendError, StepError

hookspec = pluggy.HookspecMarker("glmcore")
hookimpl = pluggy.HookimplMarker("glmcore")
ENTRY_POINT_GROUP = "glmcore.backends"


class BackendSpec:
    @hookspec
    def glmcore_backends(self) -> list["Backend"]:
        """Return the Backend objects this plugin provides."""


@dataclass
class Probe:
    """What a cheap availability check found. `reason` says why not ready; `install` fixes it."""
    ready: bool
    device: str = "cpu"
    reason: str = ""
    install: str = ""
    details: dict = field(default_factory=dict)   # versions, ISA, runtime in use (device or host emulation)


@dataclass(frozen=True)
class Capabilities:
    precisions: tuple[str, ...] = ("f32",)          # compute precisions: f32, bf16, f16
    weight_formats: tuple[str, ...] = ("f32",)      # f32, f16, bf16, int8, int4 ...
    default_precision: str = "f32"
    default_weights: str = "f32"
    max_context: int | None = None                  # None: bounded only by the model
    can_shift: bool = False                         # shift(n_keep, n_discard) in place
    speed_rank: int = 0                             # higher is preferred as the default backend
    native_batch: bool = False                      # load_batch returns a native BatchSession: one step reads
                                                    # the weights once for all entries, and copy_prefix copies
    max_slots: int | None = None                    # sequences one BatchSession can hold; None: memory-bound
    kv_export: bool = False                         # BatchSession.export_prefix/import_prefix work: a slot's KV
                                                    # can be kept in host RAM (the prompt cache, --cache-ram)


@dataclass
class LoadOptions:
    precision: str | None = None     # None: the backend's default
    weights: str | None = None       # weight format; None: the backend's default
    capacity: int | None = None      # KV slots; None: min(model max, backend max, 4096)
    threads: int | None = None
    cache_dir: Path | None = None    # where conversion results (IR, ONNX, packed int4) live
    extra: dict = field(default_factory=dict)   # backend-specific: group_size, seq_len, mode ...
    tp: int = 1                      # tensor-parallel ranks: load_model splits the model (glmcore/parallel.py)


class _Closable:
    """Sessions hold memory (weights, KV caches, device buffers): close() frees it; usable in `with`."""

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Session(_Closable, ABC):
    """One sequence's KV cache. Positions are 0..kv_len-1 of what the cache holds."""

    capacity: int

    @property
    @abstractmethod
    def kv_len(self) -> int: ...

    @abstractmethod
    def prefill(self, ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Append ids (starting the sequence when empty) and return float32 logits: [vocab] for the
        last position, or [len(ids), vocab] with all_logits."""

    @abstractmethod
    def decode(self, token: int) -> np.ndarray:
        """Append one token, return its float32 logits [vocab]."""

    def shift(self, n_keep: int, n_discard: int) -> None:
        """Drop cache slots n_keep..n_keep+n_discard-1 and re-rotate the rest so positions stay
        contiguous. Only backends declaring can_shift implement it."""
        raise NotImplementedError

    @abstractmethod
    def reset(self) -> None: ...

    def fork(self) -> "Session":
        """Optional: a new, empty session sharing this one's loaded weights or compiled model, with its
        own KV cache. The core's SessionAdapter uses it to serve several slots without loading the model
        once per slot; without it the adapter calls Backend.load again."""
        raise NotImplementedError



Entry = tuple[int, Sequence[int]]   # (slot, token ids): a prefill chunk or one decode token


@dataclass(frozen=True)
class KVBlob:
    """A host-memory copy of one slot's first `n` positions of KV cache, in the layout of the session that
    exported it (K and V per layer, a latent row per layer, f16 or f32 elements...). Only a session of the
    same loaded model reads it back (import_prefix); the core only counts its bytes."""
    n: int
    parts: tuple[np.ndarray, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


class BatchSession(_Closable, ABC):
    """`n_slots` independent sequences in one session; a slot is one sequence's KV region of `capacity`
    positions, and a slot's positions are 0..kv_len(slot)-1 of what it holds.

    One `step` runs prefill chunks and decode tokens of different slots together, so a native
    implementation (Capabilities.native_batch) reads each weight matrix once per step for all of them:
    decode of many sequences becomes compute-bound instead of memory-bound. The scheduler in
    glmcore/scheduler.py drives it; a plugin implements `forward`, and `step` checks the entries first.
    """

    n_slots: int
    capacity: int            # per slot

    @abstractmethod
    def kv_len(self, slot: int) -> int: ...

    def step(self, entries: Sequence[Entry], all_logits: bool | Sequence[bool] = False):
        """Append each entry's ids (one or more; prefill chunks and decode tokens mixed freely, at most
        one entry per slot) to its slot. Returns float32 logits of each entry's last position as an
        array [len(entries), vocab]; with all_logits (True, or per entry: the entries that want them) a list
        of arrays, one per entry: [len(ids), vocab] for those that want every position's logits, the others'
        last rows. The entries are checked here, once, so no backend repeats (or forgets) the check."""
        check_entries(self, entries)
        wanted = [all_logits] * len(entries) if isinstance(all_logits, bool) else [bool(w) for w in all_logits]
        if len(wanted) != len(entries):
            raise BackendError(f"all_logits names {len(wanted)} entries for a step of {len(entries)}")
        return self.forward(entries, wanted if any(wanted) else None)

    @abstractmethod
    def forward(self, entries: Sequence[Entry], all_logits: Sequence[bool] | None = None):
        """The backend's step on entries the core has checked (see step). all_logits None: each entry's last
        position's logits as one [len(entries), vocab] array. Otherwise a list with one array per entry:
        [len(ids), vocab] where all_logits[i], else [1, vocab] (its last position; all of them is correct too,
        only wasted work: a prefill chunk sharing a step with a draft verification needs no more)."""

    @abstractmethod
    def reset(self, slot: int) -> None: ...

    def shift(self, slot: int, n_keep: int, n_discard: int) -> None:
        """Session.shift for one slot; only backends declaring can_shift implement it."""
        raise NotImplementedError

    has_nextn: bool = False       # draft_nextn works: the backend runs the checkpoint's NextN (MTP) layer

    def start_nextn(self) -> None:
        """Keep from now on what draft_nextn drafts from (per slot the fed ids and the target's final hidden states,
        the NextN layer's own cache): the mtp drafter calls it when its scheduler is made, before any token is fed
        (a backend whose NextN cache lives in the slots' own cache, cpu_int4's, refuses it later). Until then a
        loaded NextN layer costs the session no memory and its steps no work. Backends that set has_nextn
        implement it."""
        raise NotImplementedError

    def draft_nextn(self, slot: int, token: int, k: int) -> list[int]:
        """Speculative decoding's MTP drafter: k greedy drafts for slot after `token` (sampled, not yet fed),
        from the checkpoint's multi-token-prediction layer over the slot's hidden states (kept since
        start_nextn). Optional; backends that implement it set has_nextn."""
        raise NotImplementedError

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """dst drops what it held and holds src's first n positions (a shared prompt prefilled once).
        src == dst keeps the slot's first n positions (a conversation that diverges after them).
        Backends declaring native_batch implement it; the scheduler re-prefills for the others."""
        raise NotImplementedError

    def export_prefix(self, slot: int, n: int) -> KVBlob:
        """A host-memory copy of the slot's first n positions (the slot is unchanged). Backends declaring
        Capabilities.kv_export implement it and import_prefix; the prompt cache is off for the others."""
        raise BackendError(f"{type(self).__name__} cannot export its KV cache; the prompt cache (--cache-ram) "
                           "works on backends whose capabilities say kv_export (see `glmcore backends`)")

    def import_prefix(self, slot: int, blob: KVBlob) -> None:
        """The slot drops what it held and holds exactly blob's n positions, as if they had been prefilled."""
        raise BackendError(f"{type(self).__name__} cannot import a KV cache; the prompt cache (--cache-ram) "
                           "works on backends whose capabilities say kv_export (see `glmcore backends`)")

    def check_blob(self, slot: int, blob: KVBlob, n_parts: int) -> None:
        """import_prefix's check that blob can go into slot: a slot that exists, positions that fit."""
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.n_slots:
            raise StepError(f"slot {slot!r} does not exist; slots are 0..{self.n_slots - 1}")
        if not 0 < blob.n <= self.capacity or len(blob.parts) != n_parts:
            raise BackendError(f"a KV blob of {blob.n} positions in {len(blob.parts)} parts does not fit this "
                               f"session ({self.capacity} positions a slot, {n_parts} parts); it was exported "
                               "by another model or backend")


def check_entries(batch: BatchSession, entries: Sequence[Entry]) -> None:
    """The core's one check of a step's entries: slots that exist, each once, with ids, within capacity."""
    if not entries:
        raise StepError("a step needs at least one (slot, ids) entry")
    seen = set()
    for slot, ids in entries:
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < batch.n_slots:
            raise StepError(f"slot {slot!r} does not exist; slots are 0..{batch.n_slots - 1}")
        if slot in seen:
            raise StepError(f"slot {slot} appears twice in one step; give each slot one entry")
        seen.add(slot)
        if len(ids) == 0:
            raise StepError(f"nothing to append to slot {slot} (empty token list)")
        have = batch.kv_len(slot)
        if have + len(ids) > batch.capacity:
            raise StepError(f"{have + len(ids)} tokens ({have} cached + {len(ids)} new) exceed the context of "
                            f"{batch.capacity} in slot {slot}; raise --ctx or use --overflow window")


class SessionAdapter(BatchSession):
    """The default BatchSession of a plugin that implements only `Session`: one Session per slot.
    Correct, not faster: it is not native, so the scheduler re-prefills where a native session copies."""

    def __init__(self, sessions: Sequence[Session]):
        if not sessions:
            raise BackendError("a batch session needs at least one slot")
        self.sessions = list(sessions)
        self.n_slots = len(self.sessions)
        self.capacity = min(s.capacity for s in self.sessions)

    @classmethod
    def load(cls, backend: "Backend", config: ModelConfig, weights, options: "LoadOptions",
             n_slots: int) -> "SessionAdapter":
        first = backend.load(config, weights, options)
        sessions = [first]
        for _ in range(n_slots - 1):
            try:
                sessions.append(first.fork())
            except NotImplementedError:
                sessions.append(backend.load(config, weights, options))
        return cls(sessions)

    def kv_len(self, slot: int) -> int:
        return self.sessions[slot].kv_len

    def forward(self, entries: Sequence[Entry], all_logits: Sequence[bool] | None = None):
        out = []
        for i, (slot, ids) in enumerate(entries):
            s, ids, every = self.sessions[slot], list(ids), all_logits is not None and all_logits[i]
            if every or len(ids) > 1 or s.kv_len == 0:
                out.append(s.prefill(ids, all_logits=every))
            else:
                out.append(s.decode(ids[0]))
        return np.stack(out) if all_logits is None else [o if w else o[None] for o, w in zip(out, all_logits)]

    def reset(self, slot: int) -> None:
        self.sessions[slot].reset()

    def shift(self, slot: int, n_keep: int, n_discard: int) -> None:
        self.sessions[slot].shift(n_keep, n_discard)

    def close(self) -> None:
        for s in self.sessions:
            s.close()


class SlotSession(Session):
    """A backend's single-sequence API over slot 0 of its own one-slot batch session (what conformance
    checks on backends whose model is batched). The core never drives it: it loads batch sessions."""

    def __init__(self, batch: BatchSession):
        self.batch, self.capacity = batch, batch.capacity

    @property
    def kv_len(self) -> int:
        return self.batch.kv_len(0)

    def prefill(self, ids: Sequence[int], all_logits: bool = False):
        return self.batch.step([(0, list(ids))], all_logits=all_logits)[0]

    def decode(self, token: int):
        return self.batch.step([(0, [int(token)])])[0]

    def shift(self, n_keep: int, n_discard: int) -> None:
        self.batch.shift(0, n_keep, n_discard)

    def reset(self) -> None:
        self.batch.reset(0)

    def close(self) -> None:
        self.batch.close()


class Backend(ABC):
    """A hardware path. Required: `name`, `probe`, `capabilities`, and one of `load` (a single-sequence
    Session: the simplest plugin) or `load_batch` (a native BatchSession). Every other hook below is
    optional and has a default; docs/plugins.md lists them all."""
    name: str = ""
    extra: str = ""          # the pip extra that installs this backend's runtime
    description: str = ""
    option_keys: tuple[str, ...] = ()   # the --opt keys (LoadOptions.extra) it reads; resolve refuses others

    @abstractmethod
    def probe(self) -> Probe:
        """A cheap availability check (no model load): ready, or why not and the fix."""

    @abstractmethod
    def capabilities(self) -> Capabilities: ...

    def supports(self, config: ModelConfig) -> str | None:
        """None if this backend computes config's architecture correctly, else why not (one line; the core
        adds which backends do). Default: the 2023-24 dense GLM block only (ChatGLM2/3, GLM-4: rotary over
        half of each head in interleaved pairs, no post norms, an untied output layer) -- all a plugin
        written before glmcore/arch can be trusted with. A backend that runs more overrides this and
        `architectures`."""
        if config.arch == "glm" and config.rotary_dim == config.head_dim // 2 and config.rotary_interleaved \
                and not config.post_norms and not config.tie_embeddings:
            return None
        return (f"{self.name} runs only the ChatGLM2/3 and GLM-4 block, not {describe(config)}")

    def architectures(self) -> list[str]:
        """The registered architectures (glmcore/arch) this backend runs, for `glmcore backends`. Default:
        the dense block, in its 2023-24 form only (see supports)."""
        return ["glm (ChatGLM2/3, GLM-4 only)"]

    def load_batch(self, config: ModelConfig, weights, options: LoadOptions, n_slots: int) -> BatchSession:
        """The one entry point the core calls: a session of n_slots sequences. Backends with a native
        batched step override it (and declare native_batch); the default serves each slot with a Session
        from `load`."""
        return SessionAdapter.load(self, config, weights, options, n_slots)

    def load(self, config: ModelConfig, weights, options: LoadOptions) -> Session:
        """One sequence. Default: none -- a backend implements this, load_batch, or both (conformance
        then also checks the single-sequence API)."""
        raise BackendError(f"backend {self.name!r} implements neither load nor load_batch; it cannot load a model")

    def convert(self, config: ModelConfig, weights, options: LoadOptions, out: Path, progress) -> None:
        """Write this backend's converted model (IR, ONNX parts, packed weights) into `out`."""
        raise BackendError(f"backend {self.name!r} has no conversion step; it loads checkpoints directly")

    def load_shard(self, shard, options: LoadOptions, n_slots: int) -> BatchSession:
        """Tensor parallelism (glmcore/parallel.py): this rank's part of the model, built from
        `shard.config`/`shard.weights` and calling `shard.embed`, `shard.reduce` and `shard.gather`.
        Default: none; `--tp` refuses a backend that does not override it."""
        raise NotImplementedError

    def conformance_variants(self) -> list[dict]:
        """Extra configurations the conformance suite checks, each a LoadOptions.extra dict (optionally
        pinning "precision"/"weights"). Default: the backend's defaults only."""
        return [{}]

    def conformance_weights(self, config: ModelConfig, weights, options: LoadOptions):
        """The float32 weights this configuration really computes with, as (mapping of canonical names,
        tolerance key of conformance/tolerances.py for what remains), so conformance can also hold the
        backend to the reference run on them. Default: None (the checkpoint's own weights only)."""
        return None

    def bytes_per_token(self, config: ModelConfig, options: LoadOptions, kv_len: int) -> int | None:
        """Bytes one decode step reads at kv_len (the bench's memory roofline). Default: None, estimated
        from the weight format."""
        return None

    def remeasure(self) -> None:
        """Measure again what the backend chose by measuring on this CPU and cached (cpu_int4's kernel tier):
        `--backend auto` calls it before it times the backends. Default: nothing cached, nothing to do."""

    def offers(self, hook: str) -> bool:
        """Whether this backend overrides an optional hook (e.g. "load_shard", "load")."""
        return getattr(type(self), hook) is not getattr(Backend, hook)

    def install_hint(self) -> str:
        return f'pip install "glmcore[{self.extra}]"' if self.extra else ""

    def resolve(self, options: LoadOptions) -> LoadOptions:
        """Fill defaults and refuse what this backend does not offer, with a clear message."""
        self.check_options(options.extra)
        caps = self.capabilities()
        precision = options.precision or caps.default_precision
        weights = options.weights or caps.default_weights
        if precision not in caps.precisions:
            raise BackendError(f"backend {self.name!r} has no precision {precision!r}; choose one of "
                               f"{', '.join(caps.precisions)}")
        if weights not in caps.weight_formats:
            raise BackendError(f"backend {self.name!r} has no weight format {weights!r}; choose one of "
                               f"{', '.join(caps.weight_formats)}")
        return dataclasses.replace(options, precision=precision, weights=weights, extra=dict(options.extra))

    def check_options(self, extra: dict) -> None:
        """Refuse an --opt key this backend does not read (a typo would otherwise be silently ignored)."""
        unknown = sorted(set(extra) - set(self.option_keys))
        if unknown:
            known = f"known: {', '.join(self.option_keys)}" if self.option_keys else "it takes no --opt options"
            raise BackendError(f"backend {self.name!r}: unknown option {unknown[0]!r}; {known}")


def describe(config: ModelConfig) -> str:
    """A checkpoint's architecture in a refusal: its module's name and the model_type it was read from."""
    return f"{config.arch} checkpoints (model_type {config.model_type or config.arch!r}, family {config.family})"


def kernels_run(backend: "Backend", config: ModelConfig, archs: Sequence[str]) -> str | None:
    """supports() of a backend whose own kernels or graph builders implement the architectures `archs`
    (glmcore/arch names), each with every trait its config can carry."""
    if config.arch in archs:
        return None
    return f"{backend.name}'s own kernels implement {', '.join(archs)}, not {describe(config)}"


def default_capacity(config: ModelConfig, caps: Capabilities, requested: int | None) -> int:
    limits = [config.max_seq_len] + ([caps.max_context] if caps.max_context else [])
    cap = min(limits) if requested is None else requested
    if requested is None:
        cap = min(cap, 4096)
    if cap > min(limits):
        raise BackendError(f"context {requested} exceeds the limit {min(limits)} of this model/backend; "
                           "lower --ctx")
    return cap


@dataclass
class PluginEntry:
    """A registered backend, or a plugin that failed to load (error set, backend None)."""
    name: str
    backend: Backend | None = None
    error: str = ""
    plugin: str = ""


class Registry:
    def __init__(self):
        self.pm = pluggy.PluginManager("glmcore")
        self.pm.add_hookspecs(BackendSpec)
        self.entries: dict[str, PluginEntry] = {}

    def load_entry_points(self) -> "Registry":
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                module = ep.load()
            except Exception as e:   # a broken plugin is reported, never crashes the CLI
                self._broken(ep.name, f"plugin failed to import ({ep.value}): {type(e).__name__}: {e}")
                continue
            self.register(module, ep.name)
        return self

    def register(self, plugin, name: str) -> None:
        """Register a plugin (module or object with a @hookimpl glmcore_backends); errors are recorded."""
        if self.pm.is_registered(plugin):
            return
        try:
            self.pm.register(plugin, name=name)     # pluggy validates the hookimpl against the spec
        except Exception as e:
            self._broken(name, f"plugin rejected: {type(e).__name__}: {e}")
            return
        impls = [i for i in self.pm.hook.glmcore_backends.get_hookimpls() if i.plugin is plugin]
        if not impls:
            self._broken(name, "plugin defines no @hookimpl glmcore_backends()")
            return
        try:
            backends = list(impls[0].function())
        except Exception as e:
            self._broken(name, f"plugin hook failed: {type(e).__name__}: {e}")
            return
        for b in backends:
            self.entries[b.name] = PluginEntry(b.name, backend=b, plugin=name)

    def _broken(self, name: str, error: str) -> None:
        self.entries[name] = PluginEntry(name, error=error, plugin=name)

    def names(self) -> list[str]:
        return sorted(self.entries)

    def get(self, name: str) -> Backend:
        entry = self.entries.get(name)
        if entry is None:
            raise BackendError(f"unknown backend {name!r}; available: {', '.join(self.names()) or 'none'} "
                               "(see `glmcore backends`)")
        if entry.backend is None:
            raise BackendError(f"backend {name!r} is broken: {entry.error}")
        return entry.backend

    def probe(self, name: str) -> Probe:
        entry = self.entries[name]
        if entry.backend is None:
            return Probe(False, reason=entry.error)
        try:
            return entry.backend.probe()
        except Exception as e:
            return Probe(False, reason=f"probe failed: {type(e).__name__}: {e}", install=entry.backend.install_hint())

    def ready(self) -> list[str]:
        return [n for n in self.names() if self.probe(n).ready]

    def best(self, config: ModelConfig | None = None) -> str:
        """The ready backend with the highest speed_rank (that supports config, when given); only backends
        ranked above the one chosen are probed."""
        ranked = sorted((n for n in self.names() if self.entries[n].backend is not None),
                        key=lambda n: (self.get(n).capabilities().speed_rank, n), reverse=True)
        ready = []
        for name in ranked:
            if self.probe(name).ready:
                if config is None or self.get(name).supports(config) is None:
                    return name
                ready.append(name)
        if ready:
            raise BackendError(f"no ready backend runs {describe(config)} (ready: {', '.join(ready)}); "
                               f"{self.who_runs(config)}")
        raise BackendError("no backend is ready; run `glmcore backends` and install one, "
                           'e.g. pip install "glmcore[torch]"')

    def who_runs(self, config: ModelConfig) -> str:
        """Which registered backends run config's architecture, as the fix of a refusal."""
        able = [n for n in self.names() if self.entries[n].backend is not None
                and self.get(n).supports(config) is None]
        if not able:
            return "no installed backend runs it (see `glmcore backends`)"
        return f"backends that run it: {', '.join(able)} (pick one with --backend; see `glmcore backends`)"


_REGISTRY: Registry | None = None


def registry() -> Registry:
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = Registry().load_entry_points()
    return _REGISTRY
