import importlib.metadata
import types

import pytest

from glmcore import backend as bk
from glmcore.backend import Backend, Capabilities, Probe, Registry, hookimpl
from glmcore.errors import BackendError


class Fake(Backend):
    name, extra = "fake", "fake"

    def __init__(self, ready=True, rank=5):
        self._ready, self._rank = ready, rank

    def probe(self):
        return Probe(self._ready, reason="" if self._ready else "no fake device", install=self.install_hint())

    def capabilities(self):
        return Capabilities(precisions=("f32", "bf16"), speed_rank=self._rank)

    def load(self, config, weights, options):
        raise NotImplementedError


def plugin(*backends):
    mod = types.SimpleNamespace()

    @hookimpl
    def glmcore_backends():
        return list(backends)

    mod.glmcore_backends = glmcore_backends
    return mod


def test_third_party_plugin_registers_like_builtins():
    reg = Registry()
    reg.register(plugin(Fake()), "thirdparty")
    assert reg.names() == ["fake"] and reg.probe("fake").ready and reg.best() == "fake"


def test_broken_plugins_are_reported_not_raised(monkeypatch):
    def boom():
        raise RuntimeError("half installed")

    bad_hook = types.SimpleNamespace(glmcore_backends=hookimpl(boom))
    eps = [importlib.metadata.EntryPoint("ghost", "glmcore_no_such_module", bk.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: eps)
    reg = Registry().load_entry_points()
    reg.register(bad_hook, "badhook")
    reg.register(types.SimpleNamespace(), "nohook")
    assert "failed to import" in reg.entries["ghost"].error
    assert "half installed" in reg.entries["badhook"].error
    assert "no @hookimpl" in reg.entries["nohook"].error
    assert not reg.probe("ghost").ready
    with pytest.raises(BackendError, match="backend 'ghost' is broken"):
        reg.get("ghost")


def test_best_prefers_speed_and_skips_unready():
    reg = Registry()
    fast, slow = Fake(ready=False, rank=9), Fake(rank=1)
    fast.name, slow.name = "fast", "slow"
    reg.register(plugin(fast, slow), "p")
    assert reg.best() == "slow"
    assert reg.probe("fast").install == 'pip install "glmcore[fake]"'


def test_best_probes_only_down_to_the_first_ready(monkeypatch):
    """Choosing the default must not pay for probing backends ranked below a ready one."""
    reg = Registry()
    top, low = Fake(rank=9), Fake(rank=1)
    top.name, low.name = "top", "low"
    reg.register(plugin(top, low), "p")
    monkeypatch.setattr(low, "probe", lambda: pytest.fail("a lower-ranked backend was probed"))
    assert reg.best() == "top"


def test_no_ready_backend_and_unknown_backend():
    reg = Registry()
    with pytest.raises(BackendError, match="no backend is ready"):
        reg.best()
    with pytest.raises(BackendError, match="unknown backend 'x'"):
        reg.get("x")


def test_resolve_refuses_undeclared_precision():
    from glmcore.backend import LoadOptions
    with pytest.raises(BackendError, match="no precision 'f16'; choose one of f32, bf16"):
        Fake().resolve(LoadOptions(precision="f16"))
    assert Fake().resolve(LoadOptions()).precision == "f32"


def test_builtin_backends_are_entry_points():
    names = {ep.name for ep in importlib.metadata.entry_points(group=bk.ENTRY_POINT_GROUP)}
    assert {"torch", "openvino_amx", "tpu_bm1684x", "ascend_npu", "cpu_int4"} <= names
