"""The default backend by measurement (glmcore/autoselect.py), with fake timings: the choice, the cache and
what invalidates it, the pin, `--backend auto`, the hook in resolve_backend and `glmcore backends`."""
from __future__ import annotations

import json
import types

import pytest

from glmcore import autoselect
from glmcore.autoselect import Measured
from glmcore.backend import Backend, Capabilities, Probe, Registry, hookimpl
from glmcore.errors import BackendError, GlmcoreError


class Fake(Backend):
    extra = "fake"

    def __init__(self, name, rank=5, device="cpu", weights="int8"):
        self.name, self._rank, self._device, self._weights = name, rank, device, weights

    def probe(self):
        return Probe(True, device=self._device)

    def capabilities(self):
        return Capabilities(weight_formats=(self._weights,), default_weights=self._weights, speed_rank=self._rank)

    def load(self, config, weights, options):
        raise NotImplementedError


def registry(*backends) -> Registry:
    mod = types.SimpleNamespace(glmcore_backends=hookimpl(lambda: list(backends)))
    reg = Registry()
    reg.register(mod, "fakes")
    reg.default = lambda name=None, config=None: default(reg, name, config)
    return reg


def default(reg, name=None, config=None) -> str:
    """What `glmcore run` picks with --backend `name` (None: left out) from this registry for a checkpoint's
    config."""
    from glmcore import model
    real = model.registry
    model.registry = lambda: reg
    try:
        return model.resolve_backend(name, config).name
    finally:
        model.registry = real


# decode tok/s, prefill tok/s, format: the rule (speed_rank) prefers "ranked", the measurement "quick"; on the
# MoE shape "ranked" is the faster
TIMES = {"ranked": (20.0, 100.0, "int8"), "quick": (40.0, 250.0, "int4")}
MOE_TIMES = {"ranked": (60.0, 300.0, "int8"), "quick": (30.0, 200.0, "int4")}


def busy(monkeypatch, share: float) -> None:
    """Measurements from now on see other programs take `share` of the CPUs: /proc/stat's busy time runs ahead
    of this process's own CPU time (fake clocks, one second per block)."""
    clock = {"n": 0}

    def sample():
        clock["n"] += 1
        t = float(clock["n"])
        return t * share * (autoselect.os.cpu_count() or 1), 0.0, t
    monkeypatch.setattr(autoselect.Contention, "_sample", staticmethod(sample))


@pytest.fixture
def env(monkeypatch, tmp_path):
    monkeypatch.setenv("GLMCORE_CACHE", str(tmp_path))
    monkeypatch.delenv("GLMCORE_AUTOSELECT", raising=False)        # conftest turns it off for every other test
    monkeypatch.delenv("GLMCORE_BACKEND", raising=False)
    calls = []

    def measure(name, arch="glm"):
        calls.append(name if arch == "glm" else f"{name}@{arch}")
        d, p, w = TIMES[name] if arch == "glm" else MOE_TIMES[name]
        return Measured(name, w, d, p)
    monkeypatch.setattr(autoselect, "measure_backend", measure)
    busy(monkeypatch, 0.0)          # what else runs on this machine meanwhile must not make a timing provisional
    reg = registry(Fake("ranked", rank=20), Fake("quick", rank=5), Fake("reference", rank=0, weights="f32"))
    return types.SimpleNamespace(reg=reg, calls=calls, cache=tmp_path / "autoselect.json")


def test_decide_fastest_then_better_format_within_ten_percent():
    assert autoselect.decide([Measured("a", "int8", 20, 1), Measured("b", "int4", 40, 1)])[0] == "b"
    backend, why = autoselect.decide([Measured("a", "int8", 37, 1), Measured("b", "int4", 40, 1)])
    assert backend == "a" and "better format" in why                  # 7.5% slower, int8 keeps more bits
    assert autoselect.decide([Measured("a", "int8", 35, 1), Measured("b", "int4", 40, 1)])[0] == "b"   # 12.5%
    assert autoselect.decide([Measured("a", error="boom"), Measured("b", "int4", 1, 1)])[0] == "b"
    with pytest.raises(GlmcoreError, match="no backend could be measured: a: boom"):
        autoselect.decide([Measured("a", error="boom")])


def test_measured_once_cached_and_used_as_the_default(env):
    assert env.reg.default() == "quick"                                  # not the rule's "ranked"
    assert sorted(env.calls) == ["quick", "ranked"]                   # the reference (rank 0) is not timed
    saved = json.loads(env.cache.read_text())
    assert saved["backend"] == "quick" and saved["cpu"] == autoselect.cpu_identity()
    assert {r["backend"]: r["decode"] for r in saved["results"]} == {"ranked": 20.0, "quick": 40.0}
    env.calls.clear()
    assert env.reg.default() == "quick" and env.calls == []              # from the cache


@pytest.mark.parametrize("field, value", [("version", "0.0.0-old"), ("cpu", "another CPU")])
def test_a_new_version_or_cpu_measures_again(env, field, value):
    env.reg.default()
    raw = json.loads(env.cache.read_text())
    raw[field] = value
    env.cache.write_text(json.dumps(raw))
    env.calls.clear()
    env.reg.default()
    assert sorted(env.calls) == ["quick", "ranked"]


def test_a_new_ready_backend_measures_again(env):
    env.reg.default()
    env.calls.clear()
    TIMES["extra"] = (80.0, 300.0, "int4")
    try:
        reg = registry(Fake("ranked", rank=20), Fake("quick", rank=5), Fake("extra", rank=1))
        assert reg.default() == "extra" and sorted(env.calls) == ["extra", "quick", "ranked"]
    finally:
        del TIMES["extra"]


def test_backend_auto_measures_again(env):
    env.reg.default()
    env.calls.clear()
    assert env.reg.default("auto") == "quick"
    assert sorted(env.calls) == ["quick", "ranked"]


def test_pin_and_off_switch(env, monkeypatch):
    monkeypatch.setenv("GLMCORE_BACKEND", "ranked")
    assert env.reg.default() == "ranked" and env.calls == []
    monkeypatch.setenv("GLMCORE_BACKEND", "nope")
    with pytest.raises(BackendError, match="unknown backend 'nope'"):
        env.reg.default()
    monkeypatch.delenv("GLMCORE_BACKEND")
    monkeypatch.setenv("GLMCORE_AUTOSELECT", "0")
    assert env.reg.default() == "ranked" and env.calls == []             # the speed_rank rule


def test_an_accelerator_or_a_single_cpu_backend_keeps_the_rule(env):
    reg = registry(Fake("ranked", rank=20), Fake("quick", rank=5), Fake("npu", rank=100, device="npu"))
    assert reg.default() == "npu" and env.calls == []
    reg = registry(Fake("quick", rank=5), Fake("reference", rank=0))
    assert reg.default() == "quick" and env.calls == []


def test_a_failing_backend_is_reported_not_chosen(env, monkeypatch):
    def measure(name, arch="glm"):
        if name == "quick":
            raise RuntimeError("kernel exploded")
        return Measured(name, "int8", 20.0, 100.0)
    monkeypatch.setattr(autoselect, "measure_backend", measure)
    choice = autoselect.choose(env.reg)
    assert choice.backend == "ranked"
    lines = "\n".join(autoselect.describe(choice, "ranked"))
    assert "quick" in lines and "failed: RuntimeError: kernel exploded" in lines


def test_glmcore_backends_prints_the_numbers_and_why(env, monkeypatch, capsys):
    from glmcore import cli
    monkeypatch.setattr(cli, "registry", lambda: env.reg)
    assert cli.main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "default: quick (fastest decode: 40.0 tok/s (vs ranked 20.0))" in out
    assert "decode     40.0 tok/s  prefill    250.0 tok/s" in out
    monkeypatch.setenv("GLMCORE_AUTOSELECT", "0")
    assert cli.main(["backends"]) == 0
    assert "default: ranked (by speed_rank" in capsys.readouterr().out


def test_contention_counts_other_programs_not_this_one():
    import subprocess
    import sys
    import time
    # one spinner: a container's CPU quota may be below the CPUs /proc/stat counts, but it gives one CPU
    spinners = [subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<1.5: pass"])]
    try:
        time.sleep(0.3)
        with autoselect.Contention() as c:
            time.sleep(0.8)
    finally:
        for p in spinners:
            p.wait(timeout=30)
    assert c.share is not None and c.share > 0.6 / (autoselect.os.cpu_count() or 1)
    with autoselect.Contention() as mine:            # this process's own work is not contention
        t = time.process_time()
        while time.process_time() - t < 0.5:
            pass
    assert mine.share is not None and mine.share < c.share


def test_contention_unknown_or_garbled_is_not_provisional(env, monkeypatch):
    monkeypatch.setattr(autoselect.Contention, "_sample", staticmethod(lambda: None))   # no /proc/stat
    with autoselect.Contention() as c:
        pass
    assert c.share is None
    env.reg.default()
    assert json.loads(env.cache.read_text())["contention"] is None
    env.calls.clear()
    for share in (None, "busy", [1]):                    # an edited cache file: used as it is, never a crash
        env.cache.write_text(json.dumps({**json.loads(env.cache.read_text()), "contention": share}))
        assert env.reg.default() == "quick" and env.calls == []
    assert autoselect.contention_note("busy", 1) == ""


def test_a_measurement_under_contention_is_provisional(env, monkeypatch, capsys):
    from glmcore import cli
    busy(monkeypatch, 0.6)
    assert env.reg.default() == "quick" and sorted(env.calls) == ["quick", "ranked"]
    saved = json.loads(env.cache.read_text())
    assert saved["contention"] == pytest.approx(0.6) and saved["tries"] == 1
    monkeypatch.setattr(cli, "registry", lambda: env.reg)
    assert cli.main(["backends"]) == 0                 # measured again: provisional
    out = capsys.readouterr().out
    assert "[other programs used 60% of the CPUs meanwhile: provisional, measured again at the next start]" in out
    assert json.loads(env.cache.read_text())["tries"] == 2
    env.calls.clear()
    env.reg.default()                                   # the third try under contention is kept
    assert json.loads(env.cache.read_text())["tries"] == autoselect.BUSY_TRIES and env.calls
    env.calls.clear()
    assert env.reg.default() == "quick" and env.calls == []
    assert cli.main(["backends"]) == 0
    assert "kept: the last 3 measurements all ran beside other work" in capsys.readouterr().out
    busy(monkeypatch, 0.1)                              # a quiet measurement is final at once
    env.cache.unlink()
    env.reg.default()
    env.calls.clear()
    assert env.reg.default() == "quick" and env.calls == []
    assert json.loads(env.cache.read_text())["tries"] == 1


class RunsAll(Fake):
    def supports(self, config):
        return None


class DenseOnly(Fake):
    def supports(self, config):
        return None if config.arch == "glm" else f"{self.name} runs only dense GLMs"


def test_each_architecture_is_measured_on_its_own_shape(env, monkeypatch, capsys):
    """An MoE checkpoint's default is timed on an MoE shape, once, among the backends that run it; the dense
    choice stands beside it; `glmcore backends` prints both."""
    from glmcore.synth import make_model
    moe, dense = (make_model(f, "tiny", env.cache.parent / f, generated=True) for f in ("glm4-moe", "chatglm3"))
    reg = registry(RunsAll("ranked", rank=20), RunsAll("quick", rank=5), DenseOnly("dense-only", rank=30))
    TIMES["dense-only"] = (10.0, 50.0, "int8")
    try:
        assert autoselect.choose(reg, config=moe).backend == "ranked"
        assert sorted(env.calls) == ["quick@glm4_moe", "ranked@glm4_moe"]         # dense-only is not timed
        env.calls.clear()
        assert autoselect.choose(reg, config=dense).backend == "quick" and autoselect.choose(reg).backend == "quick"
        assert sorted(env.calls) == ["dense-only", "quick", "ranked"]
        env.calls.clear()
        assert reg.default(config=moe) == "ranked" and env.calls == []      # cached apart; what `glmcore run` takes
        assert reg.default(config=dense) == "quick" and env.calls == []
        assert (env.cache.parent / "autoselect-glm4_moe.json").is_file()
        from glmcore import cli
        monkeypatch.setattr(cli, "registry", lambda: reg)
        assert cli.main(["backends"]) == 0
        out = capsys.readouterr().out
        assert "default: quick (fastest decode: 40.0 tok/s" in out
        assert "default for glm4_moe: ranked (fastest decode: 60.0 tok/s (vs quick 30.0))" in out
        assert "synthetic glm4-moe small, 4 layers" in out
        # a cache file that claims another architecture's numbers is not used: measured again
        moe_file = env.cache.parent / "autoselect-glm4_moe.json"
        moe_file.write_text(json.dumps({**json.loads(moe_file.read_text()), "arch": "glm"}))
        env.calls.clear()
        assert reg.default(config=moe) == "ranked" and sorted(env.calls) == ["quick@glm4_moe", "ranked@glm4_moe"]
    finally:
        del TIMES["dense-only"]


def test_an_architecture_without_a_timing_shape_keeps_the_rule(env):
    assert autoselect.choose(env.reg, config=types.SimpleNamespace(arch="glm5_dsa")) is None and env.calls == []


# ---------------------------------------------------------------- cpu_int4's kernel tier, with fake timings

@pytest.fixture
def tiers(monkeypatch, tmp_path):
    """Every tier 'supported' and passing its self-test, timed by a table (µs per product of m tokens)."""
    from glmcore_plugins.cpu_int4 import native
    try:
        native.lib()
    except BackendError as e:
        pytest.skip(f"cpu_int4's kernel library is not available here: {e}")
    monkeypatch.setenv("GLMCORE_INT4_LIB", str(native.library_path()[0]))     # found outside tmp_path's cache
    monkeypatch.setenv("GLMCORE_CACHE", str(tmp_path))
    monkeypatch.delenv("GLMCORE_AUTOSELECT", raising=False)
    monkeypatch.delenv("GLMCORE_INT4_ISA", raising=False)
    monkeypatch.setattr(native, "_tier", None)
    failing = {}
    table = {"avx512vnni": (50.0, 400.0), "avxvnni": (60.0, 500.0), "avx2": (40.0, 700.0)}
    timed = []

    def time_kernel(isa, mat, m, iters):
        timed.append(native.ISAS[isa])
        return table[native.ISAS[isa]][m > 1] * 1e-6
    monkeypatch.setattr(native, "supported", lambda name: True)
    monkeypatch.setattr(native, "self_test", lambda isa: failing.get(native.ISAS[isa], ""))
    monkeypatch.setattr(native, "time_kernel", time_kernel)
    busy(monkeypatch, 0.0)
    return types.SimpleNamespace(native=native, table=table, failing=failing, timed=timed,
                                 cache=tmp_path / native.TIER_CACHE)


def test_a_narrower_tier_that_decodes_faster_is_chosen(tiers):
    n = tiers.native
    i, why = n.choose_isa("auto")
    assert n.ISAS[i] == "avx2" and why.startswith("fastest decode: decode 40 µs, prefill 700 µs")
    assert "avx512vnni 50/400" in why and sorted(set(tiers.timed)) == ["avx2", "avx512vnni", "avxvnni"]
    assert "plain" not in tiers.timed                       # the reference is the fallback, not a contender


def test_a_decode_tie_goes_to_the_faster_prefill(tiers):
    tiers.table["avx2"] = (49.0, 700.0)                     # within 5% of avx512vnni's 50 µs
    n = tiers.native
    i, why = n.choose_isa()
    assert n.ISAS[i] == "avx512vnni" and "decode within 5% of avx2's, faster prefill" in why
    assert n.decide_tier([n.TierTiming("avx2", 40, 700), n.TierTiming("avx512vnni", 45, 100)])[0] == "avx2"


def test_a_tier_failing_its_self_test_is_never_chosen_nor_timed(tiers):
    tiers.failing["avx2"] = "avx2 int4 g32 kernel differs from the plain C reference"
    n = tiers.native
    i, _ = n.choose_isa()
    assert n.ISAS[i] == "avx512vnni" and "avx2" not in tiers.timed
    details = n.describe_tier(i, n._tier.why)
    assert "avx2 failed its self-test: avx2 int4 g32 kernel differs" in details["isa timings"]
    tiers.failing.update(avx512vnni="x", avxvnni="y")
    assert n.decide_tier(n.measure_tiers())[0] == "plain"


def test_the_tier_is_measured_once_and_cached(tiers):
    n = tiers.native
    n.choose_isa()
    saved = json.loads(tiers.cache.read_text())
    assert saved["isa"] == "avx2" and saved["cpu"] == autoselect.cpu_identity()
    assert saved["kernels"] == n.lib().glmi4_source_sha().decode()
    tiers.timed.clear()
    n._tier = None                                          # a new process: from the cache file
    assert n.ISAS[n.choose_isa()[0]] == "avx2" and tiers.timed == []
    for field_, value in (("version", "0.0.0-old"), ("cpu", "another CPU"), ("kernels", "other source")):
        raw = json.loads(tiers.cache.read_text())
        tiers.cache.write_text(json.dumps({**raw, field_: value}))
        n._tier = None
        n.choose_isa()
        assert tiers.timed, field_                          # stale: measured again
        tiers.timed.clear()


def test_a_tier_timed_under_contention_is_timed_again(tiers, monkeypatch):
    n = tiers.native
    busy(monkeypatch, 0.9)
    n.choose_isa()
    assert json.loads(tiers.cache.read_text())["contention"] == pytest.approx(0.9)
    assert "other programs used 90% of the CPUs meanwhile: provisional" in n.describe_tier(
        n.isa_index("avx2"), n._tier.why)["isa timings"]
    tiers.timed.clear()
    n._tier = None                                          # a new process: the cached timing is provisional
    n.choose_isa()
    assert tiers.timed and json.loads(tiers.cache.read_text())["tries"] == 2


def test_a_pinned_tier_wins_and_the_off_switch_takes_the_widest(tiers, monkeypatch):
    n = tiers.native
    assert n.choose_isa("avxvnni") == (n.isa_index("avxvnni"), "pinned by isa=avxvnni")
    monkeypatch.setenv("GLMCORE_INT4_ISA", "avx512vnni")
    assert n.choose_isa() == (n.isa_index("avx512vnni"), "pinned by GLMCORE_INT4_ISA=avx512vnni")
    assert n.choose_isa("avxvnni")[0] == n.isa_index("avxvnni")           # the option beats the variable
    monkeypatch.setenv("GLMCORE_INT4_ISA", "auto")
    monkeypatch.setenv("GLMCORE_AUTOSELECT", "0")
    i, why = n.choose_isa()
    assert n.ISAS[i] == "avx512vnni" and "not measured" in why          # the widest, as the test suite runs
    assert tiers.timed == [] and not tiers.cache.exists()
    monkeypatch.setattr(n, "supported", lambda name: name in ("plain", "avx2"))
    with pytest.raises(BackendError, match="isa=avx512vnni is not supported by this CPU"):
        n.choose_isa("avx512vnni")
    monkeypatch.setenv("GLMCORE_INT4_ISA", "avx512vnni")
    with pytest.raises(BackendError, match="GLMCORE_INT4_ISA=avx512vnni is not supported by this CPU"):
        n.choose_isa()
    from glmcore_plugins.cpu_int4 import CpuInt4Backend
    probe = CpuInt4Backend().probe()
    assert not probe.ready and "GLMCORE_INT4_ISA=avx512vnni is not supported" in probe.reason


def test_backend_auto_times_the_tier_again_before_the_backends(tiers, monkeypatch):
    """`--backend auto` measures again what was chosen by measuring: cpu_int4's tier first (its timings feed the
    backend figures), then the backends."""
    from glmcore_plugins.cpu_int4 import CpuInt4Backend
    n = tiers.native
    assert n.ISAS[n.choose_isa()[0]] == "avx2"
    tiers.table["avx2"] = (90.0, 700.0)                     # the CPU's figures moved (another load, a BIOS change)
    n._tier = None
    assert n.ISAS[n.choose_isa()[0]] == "avx2"              # the cached choice stands ...
    order = []
    monkeypatch.setattr(autoselect, "measure_backend",
                        lambda name, arch="glm": order.append(name) or Measured(name, "int4", 1, 1))
    reg = registry(CpuInt4Backend(), Fake("other", rank=5))
    monkeypatch.setattr(n, "tier_choice", lambda rerun=False, real=n.tier_choice: order.append(f"tier {rerun}")
                        or real(rerun))
    autoselect.choose(reg, rerun=True)
    timed = [o for o in order if not o.startswith("tier")]
    assert sorted(timed) == ["cpu_int4", "other"] and order.index("tier True") < order.index(timed[0])
    assert n._tier.isa == "avx512vnni"                      # ... until --backend auto times it again
    assert json.loads(tiers.cache.read_text())["isa"] == "avx512vnni"


def test_glmcore_backends_prints_the_tier_timings(tiers, monkeypatch, capsys):
    from glmcore import cli
    n = tiers.native
    monkeypatch.setattr(n, "supported", lambda name: name in ("plain", "avx2", "avxvnni"))
    monkeypatch.setenv("GLMCORE_BACKEND", "cpu_int4")      # no backend measurement in this test
    assert cli.main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "isa: avx2" in out and "isa choice: fastest decode: decode 40 µs, prefill 700 µs (vs avxvnni 60/500)" in out
    assert "avxvnni decode 60 prefill 500; avx2 decode 40 prefill 700" in out


def test_the_real_timing_covers_every_vector_tier_this_cpu_runs():
    """The measurement itself (no fake): each vector tier the CPU runs gets a positive decode and prefill time;
    which one wins is not asserted (timings)."""
    from glmcore_plugins.cpu_int4 import native
    try:
        native.lib()
    except BackendError as e:
        pytest.skip(f"cpu_int4's kernel library is not available here: {e}")
    timings = native.measure_tiers(rounds=1)
    assert sorted(t.isa for t in timings) == sorted(i for i in native.ISAS[1:] if native.supported(i))
    assert all(t.decode_us > 0 and t.prefill_us > t.decode_us for t in timings if not t.error)
