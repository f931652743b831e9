"""The torch reference side of every comparison: one session per capacity, results memoized per case,
so a model's reference logits are computed once however many backends and formats are checked."""
from __future__ import annotations

from collections.abc import Callable

from glmcore.backend import Backend, LoadOptions, Session, registry
from glmcore.errors import GlmcoreError

from .models import Model

REFERENCE = "torch"


def reference_backend() -> Backend:
    reg = registry()
    backend = reg.get(REFERENCE)
    probe = reg.probe(REFERENCE)
    if not probe.ready:
        fix = probe.install or 'pip install "glmcore[torch]"'
        raise GlmcoreError(f"the conformance reference (backend {REFERENCE!r}) is not ready: {probe.reason}; "
                           f"fix: {fix}")
    return backend


class Reference:
    def __init__(self, model: Model, backend: Backend | None = None, threads: int | None = None):
        self.model = model
        self.backend = backend or reference_backend()
        self.threads = threads
        self.sessions: dict[int, Session] = {}
        self.memo: dict[tuple, object] = {}

    def session(self, capacity: int) -> Session:
        if capacity not in self.sessions:
            opts = self.backend.resolve(LoadOptions(capacity=capacity, threads=self.threads))
            self.sessions[capacity] = self.backend.load(self.model.config, self.model.weights, opts)
        return self.sessions[capacity]

    def run(self, key: tuple, capacity: int, fn: Callable[[Session], object]):
        """fn(session) once per key (the key must name every id and parameter fn depends on)."""
        if key not in self.memo:
            self.memo[key] = fn(self.session(capacity))
        return self.memo[key]

    def close(self) -> None:
        for s in self.sessions.values():
            s.close()
        self.sessions.clear()
        self.memo.clear()


def shift_in_place(session: Session, n_keep: int, n_discard: int) -> None:
    """StreamingLLM on the reference's own cache: drop slots n_keep..n_keep+n_discard-1, rotate the
    later (already rotated) keys back by n_discard positions, as the Session.shift contract says.

    Uses the reference session's own shift() when it has one; otherwise works on the torch reference's
    cache tensors (its one-slot batch: per layer k_cache/v_cache [1, kv_heads, capacity, head_dim], keys
    stored rotated)."""
    if type(session).shift is not Session.shift:
        session.shift(n_keep, n_discard)
        return
    import torch
    from glmcore_plugins.torch_ref.model import rotary_tables
    batch = session.batch
    cfg, end = batch.cfg, batch.lens[0]
    src = slice(n_keep + n_discard, end)
    dst = slice(n_keep, end - n_discard)
    # rotation by angle a then by -n_discard*theta equals rotation to the new position
    cos, sin = rotary_tables(cfg, torch.tensor([-n_discard]))
    for k_cache, v_cache in zip(batch.k_cache, batch.v_cache):
        keys = k_cache[0, :, src].transpose(0, 1)                       # [positions, kv_heads, head_dim]
        k_cache[0, :, dst] = batch.model.rerotate(keys, cos, sin).transpose(0, 1)
        v_cache[0, :, dst] = v_cache[0, :, src].clone()
    batch.lens[0] = end - n_discard
