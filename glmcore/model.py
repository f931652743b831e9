"""Load a checkpoint onto a backend: config + weights + tokenizer + chat format + the scheduler over a
batch session (the one generation loop)."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from .backend import Backend, LoadOptions, registry
from .cache import cache_root
from .config import ModelConfig
from .engine.prompt_cache import DEFAULT_CACHE_MIB, PromptCache
from .scheduler import Scheduler, Speculation
from .errors import BackendError, CheckpointError, GlmcoreError
from .files import read_json_object
from .sampling import GGUF_RECOMMENDED_KEYS, SamplingParams, recommended
from .weights import load_weights

MAX_GENERATION_CONFIG_BYTES = 1 << 20       # a real one is a few hundred bytes


def demo_model_dir(notice=lambda msg: print(msg, file=sys.stderr)) -> Path:
    """The built-in default model (glmcore.demo): a small ChatGLM3 trained on classical Chinese poems,
    shipped in glmcore/data and copied into the cache directory on first use."""
    from .demo import demo_model_dir as packaged
    return packaged(notice)


@dataclass
class LoadedModel:
    """A checkpoint on a backend, driven by the continuous-batching `scheduler` (one slot or many)."""
    model_dir: Path
    config: ModelConfig
    tokenizer: object
    chat_format: object
    backend: Backend
    scheduler: Scheduler
    sampling: SamplingParams = SamplingParams()     # what a request that sets none samples with (the checkpoint's)

    def close(self) -> None:
        self.scheduler.stop()
        self.scheduler.batch.close()


@dataclass
class Checkpoint:
    """What --model names, opened: a checkpoint directory, or a GGUF file (or split set) whose metadata gives
    the config and, written once into the cache, the tokenizer files."""
    path: Path
    config: ModelConfig
    tokenizer_dir: Path
    gguf: object = None             # glmcore.gguf.GGUFCheckpoint

    def weights(self):
        return self.gguf.weights if self.gguf is not None else load_weights(self.path, self.config)

    def sampling(self) -> SamplingParams:
        """The sampling the checkpoint recommends (glmcore.sampling.recommended): generation_config.json's, or the
        GGUF's general.sampling.* keys."""
        if self.gguf is not None:
            meta = self.gguf.meta
            values = {ours: meta.get(key, float, None) for key, ours in GGUF_RECOMMENDED_KEYS.items()}
            return recommended(values, f"{self.path} (general.sampling.*)")
        path = self.path / "generation_config.json"
        if not path.exists():
            return SamplingParams()
        return recommended(read_json_object(path, MAX_GENERATION_CONFIG_BYTES, "generation_config.json",
                                            "fix it, or delete it to sample with glmcore's defaults", CheckpointError),
                           str(path))


def open_checkpoint(model) -> Checkpoint:
    from .gguf import is_gguf, open_gguf
    path = Path(model)
    if is_gguf(path):
        g = open_gguf(path)
        return Checkpoint(path, g.config, g.tokenizer_dir, g)
    if not path.is_dir():
        raise GlmcoreError(f"model directory {path} does not exist (it is not a checkpoint directory or a .gguf "
                           "file); pass --model DIR of a checkpoint, or create one with `glmcore make-model`")
    return Checkpoint(path, ModelConfig.from_dir(path), path)


def resolve_backend(name: str | None, config: ModelConfig | None = None) -> Backend:
    """The named backend, or the best ready one that runs config; refused (one line, naming the backends
    that do) when it is not ready or does not run config's architecture."""
    reg = registry()
    if name is not None and not name.strip():
        raise GlmcoreError("--backend is empty; name a backend (see `glmcore backends`) or leave --backend out")
    if not name or name == "auto":    # the fastest measured on this CPU (glmcore/autoselect.py; auto: measure
        from .autoselect import choose  # again), or None where the speed_rank rule of reg.best() stands
        chosen = getattr(choose(reg, rerun=name == "auto", config=config), "backend", None)
        # the measured choice only where it runs this checkpoint's architecture
        name = chosen if chosen and (config is None or reg.get(chosen).supports(config) is None) else None
    name = name or reg.best(config)
    backend = reg.get(name)
    probe = reg.probe(name)
    if not probe.ready:
        fix = f"; fix: {probe.install}" if probe.install else ""
        raise GlmcoreError(f"backend {name!r} is not ready: {probe.reason}{fix}")
    why = backend.supports(config) if config is not None else None
    if why:
        raise BackendError(f"backend {name!r} cannot run this checkpoint: {why}; {reg.who_runs(config)}")
    return backend


def load_model(model: str | Path | None = None, backend: str | None = None, options: LoadOptions | None = None,
               slots: int = 1, token_budget: int = 256, speculation: Speculation | None = None,
               cache_ram: int | None = 0) -> LoadedModel:
    """Load a checkpoint (default: the demo model) on a backend (default: the best ready one) as a batch
    session of `slots` sequences driven by a Scheduler (speculative decoding as `speculation` says), with a
    prompt cache of `cache_ram` MiB (0: none; None: the default size where the backend can export its KV)."""
    from .chat import chat_format_for
    from .tokenizer import load_tokenizer

    ckpt = open_checkpoint(model if model else demo_model_dir())
    model_dir, config = ckpt.path, ckpt.config
    sampling = ckpt.sampling()          # a bad value is refused before the weights load
    b = resolve_backend(backend, config)
    if options is not None and options.tp != 1:
        from .parallel import tensor_parallel
        b = tensor_parallel(b, options.tp)
        why = b.supports(config)
        if why:
            raise BackendError(f"--tp {options.tp}: {why}")
    opts = b.resolve(options or LoadOptions())
    caps = b.capabilities()
    tokenizer = load_tokenizer(ckpt.tokenizer_dir, config.family)
    if tokenizer.n_vocab > config.vocab_size:
        raise GlmcoreError(f"{model_dir}: {Path(tokenizer.path).name} has {tokenizer.n_vocab} ids but the model only "
                           f"{config.vocab_size} embedding rows; the tokenizer is from another checkpoint, copy "
                           "the one that came with these weights")
    if opts.cache_dir is None:
        opts.cache_dir = cache_root() / "converted"
    weights = ckpt.weights()
    if slots < 1 or (caps.max_slots is not None and slots > caps.max_slots):
        most = f"1..{caps.max_slots}" if caps.max_slots else "a positive number"
        raise GlmcoreError(f"invalid number of slots {slots} for backend {b.name!r}: use {most}")
    (speculation or Speculation()).checked(caps)        # refused before the load, not after
    cache = prompt_cache(cache_ram, caps, b.name)
    batch = b.load_batch(config, weights, opts, slots)
    scheduler = Scheduler(batch, caps, n_vocab=tokenizer.n_vocab, token_budget=token_budget, speculation=speculation,
                          prompt_cache=cache)
    return LoadedModel(model_dir, config, tokenizer, chat_format_for(tokenizer), b, scheduler, sampling)


def prompt_cache(cache_ram: int | None, caps, backend: str) -> PromptCache | None:
    """The prompt cache of `cache_ram` MiB (None: DEFAULT_CACHE_MIB where the backend can export its KV,
    else none), refused in one line where it cannot work."""
    if cache_ram is None:
        cache_ram = DEFAULT_CACHE_MIB if caps.kv_export else 0
    if not isinstance(cache_ram, int) or cache_ram < 0:
        raise GlmcoreError(f"invalid --cache-ram {cache_ram!r}: give MiB of host RAM for the prompt cache (0: off)")
    if cache_ram and not caps.kv_export:
        reg = registry()
        able = [n for n in reg.names() if reg.entries[n].backend is not None and reg.get(n).capabilities().kv_export]
        raise GlmcoreError(f"backend {backend!r} cannot export its KV cache, so it has no prompt cache; use "
                           f"--cache-ram 0, or a backend that has one ({', '.join(able) or 'none installed'})")
    return PromptCache(cache_ram << 20) if cache_ram else None
