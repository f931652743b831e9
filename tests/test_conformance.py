"""The conformance suite: it passes every ready backend, and it fails broken ones for the right reasons.

The broken backends are the torch reference with one deliberate bug each; the suite must name the
cases the bug breaks and leave the others passing. Set GLMCORE_CONFORMANCE_QUICK=1 to check the ready
backends on one family instead of three.
"""
from __future__ import annotations

import contextlib
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from glmcore.backend import Capabilities, Probe, SessionAdapter, hookimpl, registry  # noqa: E402
from glmcore.cli import main as cli_main  # noqa: E402
from glmcore.config import FAMILIES, ModelConfig  # noqa: E402
from glmcore.errors import BackendError, GlmcoreError  # noqa: E402
from glmcore_conformance import TOLERANCES, format_table, run_suite, to_markdown, tolerance_key  # noqa: E402
from glmcore_conformance.cases import CASES  # noqa: E402
from glmcore_conformance.emulate import EmulatedBackend  # noqa: E402
from glmcore_conformance.metrics import ShapeMismatch, compare, out_of_bounds  # noqa: E402
from glmcore_conformance.models import synthetic_dir  # noqa: E402
from glmcore_conformance.suite import plan  # noqa: E402
from glmcore_plugins.torch_ref import TorchBackend  # noqa: E402
from glmcore_plugins.torch_ref.model import TorchRefSession, apply_rotary, rotary_tables  # noqa: E402

QUICK = os.environ.get("GLMCORE_CONFORMANCE_QUICK") == "1"
READY = registry().ready()


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    """Synthetic models and conversions in a private cache, not the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GLMCORE_CACHE", str(tmp_path_factory.mktemp("glmcore-cache")))
        yield


def suite(backends, families=("chatglm3",), **kw):
    return run_suite(backends, families=list(families), threads=1, **kw)


def verdicts(report) -> dict[str, bool]:
    """case -> passed, over every configuration and family of the report."""
    out: dict[str, bool] = {}
    for r in report.results:
        out[r.case] = out.get(r.case, True) and r.passed
    return out


# ---------------------------------------------------------------- broken toy backends

@contextlib.contextmanager
def positions_plus_one(model):
    """The shared forward gathers its rotary table by position: rolled by one, it rotates at position + 1."""
    cos, sin = model.cos, model.sin
    model.cos, model.sin = torch.roll(cos, -1, 0), torch.roll(sin, -1, 0)
    try:
        yield
    finally:
        model.cos, model.sin = cos, sin


class DecodeRotaryOffByOne(TorchRefSession):
    """Bug: decode rotates the new token at position kv_len + 1 (prefill is right)."""

    def decode(self, token):
        with positions_plus_one(self.batch.model):
            return super().decode(token)


class PrefillForgetsCache(TorchRefSession):
    """Bug: a prefill on a non-empty cache starts a new sequence instead of appending."""

    def prefill(self, ids, all_logits=False):
        if self.kv_len:
            self.reset()
        return super().prefill(ids, all_logits)


class ShiftWithoutRerotation(TorchRefSession):
    """Bug: shift() moves the kept keys down without rotating them to their new positions."""

    def shift(self, n_keep, n_discard):
        b, end = self.batch, self.kv_len
        for k_cache, v_cache in zip(b.k_cache, b.v_cache):       # per layer [1, kv_heads, positions, head_dim]
            k_cache[0, :, n_keep:end - n_discard] = k_cache[0, :, n_keep + n_discard:end].clone()
            v_cache[0, :, n_keep:end - n_discard] = v_cache[0, :, n_keep + n_discard:end].clone()
        b.lens[0] = end - n_discard


class ShiftCorrect(TorchRefSession):
    """Right: shift() un-rotates each kept key at its old position and rotates it at the new one
    (another road than the suite's reference shift, which rotates by -n_discard once)."""

    def shift(self, n_keep, n_discard):
        b, end = self.batch, self.kv_len
        old = torch.arange(n_keep + n_discard, end)
        back = rotary_tables(b.cfg, -old)
        new = rotary_tables(b.cfg, old - n_discard)
        for k_cache, v_cache in zip(b.k_cache, b.v_cache):       # per layer [1, kv_heads, positions, head_dim]
            k = k_cache[0, :, n_keep + n_discard:end].transpose(0, 1)          # [positions, kv_heads, head_dim]
            k_cache[0, :, n_keep:end - n_discard] = apply_rotary(apply_rotary(k, *back), *new).transpose(0, 1)
            v_cache[0, :, n_keep:end - n_discard] = v_cache[0, :, n_keep + n_discard:end].clone()
        b.lens[0] = end - n_discard


class NoisyLogits(TorchRefSession):
    """Bug: logits differ from call to call (racy reductions), within bf16 accuracy."""

    calls = 0

    def prefill(self, ids, all_logits=False):
        return self._noisy(super().prefill(ids, all_logits))

    def decode(self, token):
        return self._noisy(super().decode(token))

    def _noisy(self, out):
        NoisyLogits.calls += 1
        noise = np.random.default_rng(NoisyLogits.calls).standard_normal(out.shape).astype(np.float32)
        return out + 0.3 * noise


class Toy(TorchBackend):
    option_keys = ("kernel",)        # what the variants test passes
    def __init__(self, name, session_cls=TorchRefSession, can_shift=False, precision="f32", ready=True,
                 variants=None, refuse=()):
        self.name, self.session_cls, self.can_shift = name, session_cls, can_shift
        self.precision, self.is_ready, self.variants, self.refuse = precision, ready, variants, refuse
        self.loaded = []

    def probe(self):
        return Probe(True) if self.is_ready else Probe(False, reason="toy switched off", install="flip a switch")

    def capabilities(self):
        return Capabilities(precisions=(self.precision,), weight_formats=(self.precision,),
                            default_precision=self.precision, default_weights=self.precision, can_shift=self.can_shift)

    def conformance_variants(self):
        return self.variants

    def load(self, config, weights, options):
        if (options.precision, options.weights) in self.refuse:
            raise BackendError(f"{self.name} refuses {options.precision}/{options.weights}")
        self.loaded.append(options)
        return self.session_cls(config, weights, options, Capabilities(can_shift=self.can_shift))

    def load_batch(self, config, weights, options, n_slots):
        return SessionAdapter.load(self, config, weights, options, n_slots)    # batches of the toy's sessions


class MultiFormatToy(Toy):
    """Declares two precisions and three weight formats (computing exactly, in fp32)."""

    def capabilities(self):
        return Capabilities(precisions=("f32", "bf16"), weight_formats=("f32", "bf16", "int8"),
                            default_precision="bf16", default_weights="int8")


# ---------------------------------------------------------------- every ready backend passes

@pytest.mark.parametrize("name", READY)
def test_ready_backend_conforms(name):
    backend = registry().get(name)
    families = ["chatglm3"] if QUICK else list(FAMILIES)
    report = suite([backend], families)
    assert report.results, f"{name}: nothing was checked: {report.skipped}"
    assert report.passed, f"{name} does not conform:\n{format_table(report)}"
    # every family it runs is checked in every case; the others are skipped with the backend's reason
    runs = [f for f in families if backend.supports(ModelConfig.from_dir(synthetic_dir(f))) is None]
    checked = {(r.model, r.case) for r in report.results}
    assert checked == {(f, c) for f in runs for c in CASES}, checked
    refused = {s["model"] for s in report.skipped if "model" in s}
    assert refused == set(families) - set(runs), report.skipped


def test_reference_against_itself_is_exact():
    report = suite([registry().get("torch")], FAMILIES)
    assert report.passed, format_table(report)
    for r in report.results:
        if r.case not in ("seed", "chat_continuation", "decode_vs_prefill", "batch_mixed", "batch_generate"):
            assert r.metrics["max_abs"] == 0.0, (r.case, r.metrics)     # the others take other roads


# ---------------------------------------------------------------- the suite can fail

def test_catches_rotary_off_by_one():
    report = suite([Toy("rotary_bug", DecodeRotaryOffByOne)], ["chatglm3", "glm4"])
    assert not report.passed
    assert verdicts(report) == {"prefill": True, "decode": False, "decode_vs_prefill": False, "reset_reuse": False,
                                "near_capacity": False, "window_shift": False, "chat_continuation": False,
                                "seed": True, "batch_mixed": False,
                                "batch_generate": True}, format_table(report)   # buggy alone and together alike
    # by a wide margin, not by rounding: every decode figure far outside the f32 bounds
    f32 = TOLERANCES["f32"]
    for r in report.results:
        if r.case == "decode":
            assert r.metrics["rel_l2"] > 100 * f32.rel_l2 and r.metrics["kl"] > 1000 * f32.kl
            assert r.metrics["cosine"] < 0.99 and r.metrics["top1"] < 0.9
            # and it would fail even the bf16 row
            assert out_of_bounds(r.metrics, TOLERANCES["bf16"].bounds())


def test_catches_rotary_off_by_one_in_an_int4_backend():
    """The int4 row is loose, but decode_vs_prefill holds the backend to itself at its compute precision."""
    class BuggyInt4(EmulatedBackend):
        conformance_weights = None             # no hook: only the loose int4 row against fp32

        def load(self, config, weights, options):
            return DecodeRotaryOffByOne(config, {**weights, **self.rounded(weights)}, options, self.capabilities())

    report = suite([BuggyInt4("int4", name="buggy_int4")], ["chatglm3"],
                   cases=["prefill", "decode", "decode_vs_prefill"])
    by = {r.case: r for r in report.results}
    assert not by["decode_vs_prefill"].passed and by["decode_vs_prefill"].tolerance == "f32"
    assert by["decode_vs_prefill"].metrics["rel_l2"] > 1000 * TOLERANCES["f32"].rel_l2


def test_catches_a_cache_that_forgets_on_append():
    report = suite([Toy("forgetful", PrefillForgetsCache)], ["chatglm3"])
    v = verdicts(report)
    # a slot takes ids twice in batch_mixed; the scheduler prefills long prompts in chunks in batch_generate
    assert v.pop("chat_continuation") is False and v.pop("batch_mixed") is False and v.pop("batch_generate") is False
    assert all(v.values()), format_table(report)
    failure = next(r for r in report.results if r.case == "chat_continuation")
    assert "kv_len" in failure.error            # the contract check names what went wrong


class ImportsLengthOnly(TorchBackend):
    """Declares kv_export, but its import_prefix sets the slot's length without writing the rows: the slot keeps the
    KV of what it held before (the right length, the wrong content)."""
    name = "imports_length_only"

    def load_batch(self, config, weights, options, n_slots):
        batch = super().load_batch(config, weights, options, n_slots)
        batch.import_prefix = lambda slot, blob: batch.lens.__setitem__(slot, blob.n)
        return batch


def test_catches_a_prefix_import_that_keeps_the_old_rows():
    """batch_mixed restores a prefix as the prompt cache does (export_prefix, import_prefix) into a slot that held
    other ids: the rows after it tell a broken import from a real one."""
    v = verdicts(suite([ImportsLengthOnly()], ["chatglm3"]))
    assert v.pop("batch_mixed") is False and all(v.values()), v


class LastRowsOnly(TorchBackend):
    """Gives each entry only its last position's logits even where the step asked for every position's."""
    name = "last_rows_only"

    def load_batch(self, config, weights, options, n_slots):
        batch = super().load_batch(config, weights, options, n_slots)
        forward = batch.forward
        batch.forward = lambda entries, all_logits=None: forward(entries, None if all_logits is None else
                                                                 [False] * len(entries))
        return batch


def test_catches_a_step_that_ignores_which_entries_want_every_position():
    """batch_mixed asks every position's logits of some entries of a step (as a draft verification sharing a step
    with a prefill chunk): a batch session that answers with last rows only fails it."""
    v = verdicts(suite([LastRowsOnly()], ["chatglm3"]))
    assert v.pop("batch_mixed") is False and all(v.values()), v


def test_catches_a_shift_without_rerotation_and_passes_a_correct_one():
    broken = suite([Toy("shift_bug", ShiftWithoutRerotation, can_shift=True)], ["glm4"])
    v = verdicts(broken)
    assert v.pop("window_shift") is False and v.pop("batch_mixed") is False      # one slot shifts there
    assert all(v.values()), format_table(broken)
    ok = suite([Toy("shift_ok", ShiftCorrect, can_shift=True)], ["chatglm3", "glm4"])
    assert ok.passed, format_table(ok)


def test_catches_nondeterministic_logits_in_the_seed_case():
    report = suite([Toy("noisy", NoisyLogits, precision="bf16")], ["chatglm3"])
    v = verdicts(report)
    assert v["seed"] is False, format_table(report)
    seed = next(r for r in report.results if r.case == "seed")
    assert seed.failed == ["tokens"] and "runs differ" in seed.note


# ---------------------------------------------------------------- tolerances against lossy formats

@pytest.mark.parametrize("fmt", ["f16", "bf16", "int8", "int4"])
def test_emulated_formats_pass_their_own_row(fmt):
    report = suite([EmulatedBackend(fmt)], ["glm4"])
    assert report.passed, format_table(report)
    own = [r for r in report.results if r.against == "own weights"]
    assert own and all(r.tolerance == "f32" for r in own)


def test_rows_tell_formats_apart():
    """int4 weights claiming to be bf16 fail the bf16 row; bf16 claiming f32 fails the f32 row."""
    for fmt, claim in (("int4", "bf16"), ("bf16", "f32")):
        report = suite([EmulatedBackend(fmt, declare=claim)], ["chatglm3"], cases=["prefill", "decode"])
        fp32 = [r for r in report.results if r.against == "fp32 ref"]
        assert fp32 and not any(r.passed for r in fp32), format_table(report)


def test_own_weights_hook_catches_a_backend_that_lies_about_its_weights():
    class Liar(EmulatedBackend):
        def conformance_weights(self, config, weights, options):
            return {}, "f32"      # claims to compute with the checkpoint's weights, computes with int4

    report = suite([Liar("int4", name="liar")], ["chatglm3"], cases=["prefill"])
    by = {r.against: r for r in report.results}
    assert not by["own weights"].passed and not report.passed


def test_tolerance_key_takes_the_looser_part(monkeypatch):
    assert tolerance_key("f32", "f32") == "f32"
    assert tolerance_key("bf16", "int4") == "int4"
    assert tolerance_key("f32", "bf16") == "bf16"
    assert tolerance_key("f16", "int8") == "int8"
    assert tolerance_key("bf16", "bf16", experts=True) == "bf16+experts"
    assert tolerance_key("f32", "f32", experts=True) == "f32"
    assert tolerance_key("f32", "int4", experts=True) == "int4+experts"
    assert tolerance_key("int8", "f32", experts=True) == "int8+experts"
    assert tolerance_key("f32", "f16", experts=True) == "f16+experts"
    monkeypatch.delitem(TOLERANCES, "f16+experts")     # a format measured on dense models only
    with pytest.raises(GlmcoreError, match=r"no tolerance for f16 on a Mixture-of-Experts model .* add a "
                                           r"'f16\+experts' row"):
        tolerance_key("f16", "f32", experts=True)
    with pytest.raises(GlmcoreError, match="tolerances.py"):
        tolerance_key("f32", "nf4")
    for name, row in TOLERANCES.items():   # each looser row is looser in every figure
        looser = list(TOLERANCES.values())[list(TOLERANCES).index(name):]
        assert all(r.rel_l2 >= row.rel_l2 and r.kl >= row.kl and r.cosine <= row.cosine for r in looser)


def test_metrics():
    rng = np.random.default_rng(0)
    ref = (6 * rng.standard_normal((5, 300))).astype(np.float32)
    m = compare(ref, ref)
    assert m == {"max_abs": 0.0, "rel_l2": 0.0, "cosine": pytest.approx(1.0), "top1": 1.0, "kl": 0.0}
    noisy = compare(ref, ref + 0.01 * rng.standard_normal(ref.shape).astype(np.float32))
    assert 0 < noisy["max_abs"] < 0.1 and noisy["rel_l2"] < 0.01 and noisy["kl"] < 1e-3
    bad = ref.copy()
    bad[2, 7] = np.nan
    m = compare(ref, bad)
    assert set(out_of_bounds(m, TOLERANCES["int4"].bounds())) == {"max_abs", "rel_l2", "cosine", "top1", "kl"}
    with pytest.raises(ShapeMismatch):
        compare(ref, ref[:4])


# ---------------------------------------------------------------- what gets checked

def test_plan_covers_each_precision_and_format_once():
    cover, more = plan(MultiFormatToy("multi"))
    labels = [c.label for c in cover]
    assert labels[:4] == ["bf16/int8", "f32/int8", "bf16/f32", "bf16/bf16"]
    cover, _ = plan(MultiFormatToy("multi"), precision="f32")
    assert {c.precision for c in cover} == {"f32"}


def test_refused_pairings_are_replaced_and_uncoverable_formats_fail():
    toy = MultiFormatToy("multi", refuse={("f32", "int8")})
    report = suite([toy], ["chatglm3"], cases=["prefill"])
    loaded = {(o.precision, o.weights) for o in toy.loaded}
    assert ("f32", "int8") not in loaded and any(p == "f32" for p, _ in loaded)
    assert {"f32", "bf16"} <= {p for p, _ in loaded} and {"f32", "bf16", "int8"} <= {w for _, w in loaded}
    assert any("refuses f32/int8" in s["reason"] for s in report.skipped)

    hopeless = MultiFormatToy("hopeless", refuse={(p, "int8") for p in ("f32", "bf16")})
    report = suite([hopeless], ["chatglm3"], cases=["prefill"])
    load_failures = [r for r in report.results if r.case == "load"]
    assert len(load_failures) == 1 and "int8" in load_failures[0].error and not report.passed


def test_conformance_variants_are_checked():
    toy = Toy("variants", variants=[{"kernel": "a"}, {"kernel": "b"}])
    report = suite([toy], ["chatglm3"], cases=["prefill"])
    assert report.passed
    assert [o.extra for o in toy.loaded] == [{"kernel": "a"}, {"kernel": "b"}]
    assert {r.config for r in report.results} == {"f32/f32 kernel=a", "f32/f32 kernel=b"}


def test_not_ready_backends_are_skipped_with_the_reason():
    report = suite([Toy("off", ready=False), registry().get("torch")], ["chatglm3"], cases=["prefill"])
    assert report.passed
    assert report.skipped == [{"backend": "off", "reason": "not ready: toy switched off"}]


def test_capacity_comes_from_the_backend_limit():
    class Small(Toy):
        def capabilities(self):
            return Capabilities(max_context=100)

    toy = Small("small")
    report = suite([toy], ["chatglm3"], cases=["near_capacity"])
    assert report.passed and toy.loaded[0].capacity == 100


# ---------------------------------------------------------------- command line and report files

@pytest.fixture
def registered():
    """Register toy backends in the global registry, as a third-party plugin would be, then remove them."""
    reg = registry()
    added = []

    def add(*backends):
        class Plugin:
            @hookimpl
            def glmcore_backends(self):
                return list(backends)
        plugin = Plugin()
        reg.register(plugin, f"test-plugin-{len(added)}")
        added.append((plugin, [b.name for b in backends]))

    yield add
    for plugin, names in added:
        reg.pm.unregister(plugin)
        for n in names:
            reg.entries.pop(n, None)


def test_cli_writes_json_and_markdown(tmp_path, capsys):
    rc = cli_main(["conformance", "--backend", "torch", "--quick", "--threads", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "max|d|" in out and f"PASS: {len(CASES)}/{len(CASES)} cases passed on torch" in out
    data = json.loads((tmp_path / "conformance.json").read_text())
    assert data["passed"] is True and len(data["results"]) == len(CASES)
    assert data["meta"]["tolerances"]["bf16"]["rel_l2"] == TOLERANCES["bf16"].rel_l2
    first = data["results"][0]
    assert set(first["metrics"]) == set(first["bounds"]) == {"max_abs", "rel_l2", "cosine", "top1", "kl"}
    md = (tmp_path / "conformance.md").read_text()
    assert "| backend | model | config |" in md and "PASS" in md


def test_cli_exits_1_when_a_case_fails(registered, tmp_path, capsys):
    registered(Toy("rotary_bug", DecodeRotaryOffByOne))
    rc = cli_main(["conformance", "--backend", "rotary_bug", "--quick", "--threads", "1", "--cases",
                   "prefill,decode", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL: 1/2 cases passed" in out and " !" in out
    data = json.loads((tmp_path / "conformance.json").read_text())
    assert [r["passed"] for r in data["results"]] == [True, False]
    assert "FAIL" in to_markdown(run_suite([Toy("rotary_bug", DecodeRotaryOffByOne)], families=["chatglm3"],
                                           cases=["decode"], threads=1))


@pytest.mark.parametrize("args, message", [
    (["--backend", "nope"], "unknown backend 'nope'"),
    (["--backend", "off"], "not ready: toy switched off; fix: flip a switch"),
    (["--backend", "torch", "--cases", "bogus"], "unknown case 'bogus'"),
    (["--backend", "torch", "--capacity", "20"], "too small"),
    (["--backend", "torch", "--precision", "int3"], "no selected backend offers precision 'int3'"),
    (["--backend", "torch", "--model", "/nonexistent/model"], "not a directory"),
    (["--backend", "torch", "--threads", "0"], "invalid --threads"),
])
def test_cli_usage_errors_exit_2(registered, capsys, args, message):
    registered(Toy("off", ready=False))
    assert cli_main(["conformance", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1      # one line


def test_cli_on_a_real_checkpoint_directory(make_tiny, capsys):
    """--model DIR: any checkpoint in any supported layout, here a .bin one."""
    d = make_tiny("glm4", fmt="bin")
    rc = cli_main(["conformance", "--backend", "torch", "--model", str(d), "--threads", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and f"glm4 ({d.name})" in out
