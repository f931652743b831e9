"""The plugin contract as a third-party author meets it: a backend that implements only a single-sequence
`Session` gets batching (the core's adapter), the scheduler, the server and conformance; every optional
hook is declared on Backend with its default; the core checks each step's entries once."""
import sys

import numpy as np
import pytest

from glmcore.backend import (Backend, BatchSession, Capabilities, LoadOptions, Probe, Session, SessionAdapter,
                             check_entries, hookimpl, registry)
from glmcore.errors import BackendError, StepError
from glmcore.model import load_model
from glmcore.sampling import SamplingParams
from glmcore.scheduler import Request
from glmcore_conformance import format_table, run_suite

GREEDY = SamplingParams(temperature=0)


class MinimalSession(Session):
    """What a plugin author writes: prefill, decode, reset, kv_len (here over the reference's math)."""

    def __init__(self, config, weights, options):
        from glmcore_plugins.torch_ref.model import TorchRefBatch
        self._model = TorchRefBatch(config, weights, options, Capabilities(), 1)
        self.capacity = self._model.capacity

    @property
    def kv_len(self):
        return self._model.kv_len(0)

    def prefill(self, ids, all_logits=False):
        return self._model.step([(0, list(ids))], all_logits)[0]

    def decode(self, token):
        return self._model.step([(0, [token])])[0]

    def reset(self):
        self._model.reset(0)


class MinimalBackend(Backend):
    name = "minimal-plugin"
    description = "a third-party-style plugin: one Session, nothing else"

    def probe(self):
        return Probe(True, device="cpu")

    def capabilities(self):
        return Capabilities(speed_rank=-100)

    def load(self, config, weights, options):
        return MinimalSession(config, weights, options)


MINIMAL = MinimalBackend()


@hookimpl
def glmcore_backends():
    return [MINIMAL]


@pytest.fixture(scope="module", autouse=True)
def _register():
    registry().register(sys.modules[__name__], "minimal-plugin-test")


def test_optional_hooks_are_declared_with_defaults():
    b = MINIMAL
    assert not any(b.offers(h) for h in ("load_batch", "load_shard", "conformance_variants",
                                         "conformance_weights", "bytes_per_token", "convert"))
    assert b.offers("load")
    assert b.conformance_variants() == [{}] and b.conformance_weights(None, None, None) is None
    assert b.bytes_per_token(None, LoadOptions(), 0) is None
    with pytest.raises(BackendError, match="no conversion step"):
        b.convert(None, None, LoadOptions(), None, print)
    from glmcore.parallel import TensorParallel
    with pytest.raises(BackendError, match="no tensor-parallel path"):
        TensorParallel(b, 2)
    torch = registry().get("torch")
    assert TensorParallel(torch, 2).conformance_variants() == torch.conformance_variants()
    # resolve fills the defaults and keeps every other field (tp, cache_dir, ...)
    resolved = b.resolve(LoadOptions(capacity=9, threads=1, tp=2, extra={}))
    assert (resolved.precision, resolved.weights, resolved.capacity, resolved.threads, resolved.tp) == \
        ("f32", "f32", 9, 1, 2)


def test_a_session_only_plugin_gets_batching_through_the_default_adapter(make_tiny):
    m = load_model(make_tiny("chatglm3"), MINIMAL.name, LoadOptions(capacity=64), slots=3, token_budget=8)
    try:
        assert isinstance(m.scheduler.batch, SessionAdapter) and not m.scheduler.native
        prompts = [[1, 2] + list(range(100 + i, 108 + 3 * i)) for i in range(5)]
        handles = [m.scheduler.submit(Request(p, GREEDY, 6)) for p in prompts]
        m.scheduler.run()
        together = [h.tokens for h in handles]
    finally:
        m.close()
    alone = load_model(make_tiny("chatglm3"), MINIMAL.name, LoadOptions(capacity=64))
    try:
        assert together == [list(alone.scheduler.submit(Request(p, GREEDY, 6))) for p in prompts]
    finally:
        alone.close()


def test_a_session_only_plugin_is_served(make_tiny):
    pytest.importorskip("fastapi", reason='the server is the glmcore[server] extra')
    from fastapi.testclient import TestClient

    from glmcore.server.app import create_app
    m = load_model(make_tiny("glm4"), MINIMAL.name, LoadOptions(capacity=128), slots=2)
    app = create_app(m, "tiny")
    m.scheduler.start()
    try:
        with TestClient(app, base_url="http://localhost") as http:
            r = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 5, "temperature": 0,
                                                       "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["finish_reason"] in ("stop", "length") and body["usage"]["completion_tokens"] >= 1
    finally:
        m.close()
    assert m.scheduler.busy_slots == 0 and m.scheduler.queue_len == 0


def test_a_session_only_plugin_conforms():
    report = run_suite([MINIMAL], families=["chatglm3"], cases=["prefill", "decode", "window_shift", "seed",
                                                               "batch_mixed", "batch_generate"],
                       decode_steps=8, threads=1)
    assert report.results and report.passed, format_table(report)


class CountingBatch(BatchSession):
    """Records what reaches forward: the core's check must have run before."""

    def __init__(self):
        self.n_slots, self.capacity, self.lens, self.seen = 2, 4, [0, 0], []

    def kv_len(self, slot):
        return self.lens[slot]

    def forward(self, entries, all_logits=False):
        self.seen.append(entries)
        for slot, ids in entries:
            self.lens[slot] += len(ids)
        return np.zeros((len(entries), 3), np.float32)

    def reset(self, slot):
        self.lens[slot] = 0


@pytest.mark.parametrize("entries,why", [
    ([], "at least one"), ([(2, [1])], "slot 2 does not exist"), ([(-1, [1])], "slot -1 does not exist"),
    ([("0", [1])], "slot '0' does not exist"), ([(0, [1]), (0, [2])], "appears twice"),
    ([(1, [])], "empty token list"), ([(0, [1, 2, 3, 4, 5])], "5 tokens .* exceed the context of 4 in slot 0"),
])
def test_the_core_checks_every_step_once_with_one_error_type(entries, why):
    b = CountingBatch()
    with pytest.raises(StepError, match=why):
        b.step(entries)
    with pytest.raises(StepError, match=why):
        check_entries(b, entries)
    assert b.seen == [] and b.lens == [0, 0]          # nothing reached the backend
    b.step([(0, [1, 2]), (1, [3])])
    assert b.seen == [[(0, [1, 2]), (1, [3])]]
