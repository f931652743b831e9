"""cpu_int4 on the MoE GLMs: glm4_moe (INT4 routed and shared experts, fp32 router, q/k norms, NeoX rotary) and
glm4_moe_lite (latent attention with kv_b absorbed, the latent KV cache). Held to transformers' own
Glm4MoeForCausalLM / Glm4MoeLiteForCausalLM within the int4+experts row, to the torch reference on the packed
file's own (dequantized) weights within the int8+experts row, and to itself: one token at a time, whole prompts
and mixed batches give the same bits."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil

import numpy as np
import pytest

from glmcore.backend import LoadOptions
from glmcore.config import ModelConfig
from glmcore.weights import load_weights
from glmcore_conformance.metrics import compare, out_of_bounds
from glmcore_conformance.tolerances import TOLERANCES
from glmcore_plugins.cpu_int4 import CpuInt4Backend, native, quant

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MOE_FAMILIES = ["glm4-moe", "glm4-moe-lite"]
HF_CLASS = {"glm4-moe": "Glm4MoeForCausalLM", "glm4-moe-lite": "Glm4MoeLiteForCausalLM"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    p = CpuInt4Backend().probe()
    if not p.ready:
        pytest.skip(f"cpu_int4 not ready: {p.reason}")
    return tmp_path_factory.mktemp("int4-moe-cache")


def checkpoint(make_tiny, family):
    """(dir, config, weights) of the tests' tiny checkpoint of a family (made once per session)."""
    d = make_tiny(family)
    cfg = ModelConfig.from_dir(d)
    return d, cfg, load_weights(d, cfg)


def load_batch(cfg, w, cache, slots=1, capacity=512, threads=2, **extra):
    with contextlib.redirect_stderr(io.StringIO()):
        return CpuInt4Backend().load_batch(cfg, w, LoadOptions(capacity=capacity, cache_dir=cache, threads=threads,
                                                               extra=extra), slots)


def within(want, got, row):
    figures = compare(want, got)
    assert not out_of_bounds(figures, TOLERANCES[row].bounds()), (row, figures)
    return figures


def own_reference(cfg, w, batch, slots=1, capacity=512):
    """The torch reference on the weights the packed file holds (dequantized)."""
    from glmcore_plugins.torch_ref import TorchBackend
    deq = quant.dequantized_weights(batch.meta, np.asarray(batch._blob))
    return TorchBackend().load_batch(cfg, {**dict(w), **deq}, LoadOptions(capacity=capacity), slots)


# prefill of two sequences in one step, six decode steps of both, then the rest of a 300-token prompt
def script(rng):
    a, b = [int(t) for t in rng.integers(0, 2000, 300)], [int(t) for t in rng.integers(0, 2000, 20)]
    steps = [[(0, a[:40]), (1, b[:12])]] + [[(0, [a[40 + k]]), (1, [b[12 + k]])] for k in range(6)] + [[(0, a[46:])]]
    return a, b[:18], steps


def run_script(session, steps):
    got = [session.step(entries, all_logits=True) for entries in steps]
    return (np.concatenate([got[0][0]] + [g[0] for g in got[1:]]),
            np.concatenate([got[0][1]] + [g[1] for g in got[1:7]]))


def assert_one_token_and_batched_agree(batch, ids, split):
    """Slot 0 of a 3-slot batch: the whole prompt, one token at a time, and ids[:split] in a step with two other
    sequences followed by single tokens beside theirs give the same bits. Returns the whole prompt's logits."""
    whole = batch.step([(0, ids)], all_logits=True)[0]
    batch.reset(0)
    single = np.concatenate([batch.step([(0, [t])], all_logits=True)[0] for t in ids])
    batch.reset(0)
    mixed = batch.step([(1, ids[:7]), (0, ids[:split]), (2, ids[3:30])], all_logits=True)[1]
    mixed = np.concatenate([mixed] + [batch.step([(2, [9]), (0, [t]), (1, [4])], all_logits=True)[1]
                                      for t in ids[split:]])
    assert np.array_equal(whole, single) and np.array_equal(whole, mixed)
    return whole


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_logits_match_transformers_within_the_int4_experts_row(make_tiny, cache, family):
    """Prefill, decode and a 300-token prompt, two sequences in one batch, against transformers' own model on the
    checkpoint's weights (int4's loss plus routing flips: the int4+experts row), and against the reference on the
    packed weights (int8 activations plus routing flips: int8+experts, where top-1 discriminates)."""
    d, cfg, w = checkpoint(make_tiny, family)
    transformers.logging.set_verbosity_error()
    hf = getattr(transformers, HF_CLASS[family]).from_pretrained(d, dtype=torch.float32).eval()
    a, b, steps = script(np.random.default_rng(3))
    with load_batch(cfg, w, cache, slots=2) as batch, own_reference(cfg, w, batch, slots=2) as ref:
        got_a, got_b = run_script(batch, steps)
        own_a, own_b = run_script(ref, steps)
    with torch.no_grad():
        want_a, want_b = (hf(torch.tensor([ids])).logits[0].numpy() for ids in (a, b))
    within(want_a, got_a, "int4+experts")
    within(want_b, got_b, "int4+experts")
    within(own_a, got_a, "int8+experts")
    within(own_b, got_b, "int8+experts")


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("isa", native.ISAS)
def test_one_token_and_batched_steps_give_the_same_bits(make_tiny, cache, family, isa):
    """A token's logits do not depend on what else is in its step: one token at a time, a whole prompt, and
    mixed steps of several sequences (experts grouped over other tokens) agree exactly, per kernel variant."""
    if not native.supported(isa):
        pytest.skip(f"this CPU has no {isa}")
    _, cfg, w = checkpoint(make_tiny, family)
    # 600 positions: the AVX-512 latent attention's partial softmax runs over 3 chunks (whole prompts in blocks of
    # tokens, single tokens with their chunks spread over the threads)
    ids = [int(t) for t in np.random.default_rng(5).integers(0, 2000, 600)]
    with load_batch(cfg, w, cache, slots=3, capacity=640, isa=isa) as batch:
        assert_one_token_and_batched_agree(batch, ids, 525)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_more_threads_than_cores_give_one_threads_bits(make_tiny, cache, family):
    """A parallel region closes when its caller is done and waits only for the workers that entered it; with more
    threads than cores, workers often miss regions (or come late to closed ones). Every stage must still be done
    exactly once: a prompt, decode steps of two sequences and a window shift (its layers shared out the same
    way) give the bits of one thread."""
    _, cfg, w = checkpoint(make_tiny, family)
    ids = [int(t) for t in np.random.default_rng(8).integers(0, 2000, 60)]
    out = []
    for threads in (1, 3 * (os.cpu_count() or 1) + 1):
        with load_batch(cfg, w, cache, slots=2, capacity=64, threads=threads) as batch:
            got = batch.step([(0, ids[:40]), (1, ids[40:52])], all_logits=True)
            got += [batch.step([(0, [t]), (1, [t + 1])]) for t in ids[52:56]]
            batch.shift(0, 4, 20)
            got += [batch.step([(0, [t]), (1, [t])]) for t in ids[56:]]
        out.append(np.concatenate(got))
    assert np.array_equal(*out)


@pytest.mark.parametrize("kv_lora,v_dim", [(24, 8), (48, 24)])
def test_latent_widths_that_are_not_whole_tiles(tmp_path, cache, kv_lora, v_dim):
    """kv_lora_rank and v_head_dim need not be multiples of the 16-row tile (each head's block of kv_b's halves is
    padded with zero rows): transformers' own checkpoint at such widths (48 takes the AVX-512 latent kernel, 24 the
    generic one), on every kernel tier: whole prompt, one token at a time and a mixed batch give the same bits,
    and the logits are the reference's on the packed weights within the int8+experts row."""
    from test_glm4_moe import transformers_variant
    transformers_variant(tmp_path, "glm4-moe-lite", dict(kv_lora_rank=kv_lora, v_head_dim=v_dim))
    cfg = ModelConfig.from_dir(tmp_path)
    w = load_weights(tmp_path, cfg)
    ids = [int(t) for t in np.random.default_rng(6).integers(0, 320, 300)]
    for isa in [i for i in native.ISAS if native.supported(i)]:
        with load_batch(cfg, w, cache, slots=3, capacity=320, isa=isa) as batch:
            whole = assert_one_token_and_batched_agree(batch, ids, 290)
            with own_reference(cfg, w, batch, capacity=320) as ref:
                within(ref.step([(0, ids)], all_logits=True)[0], whole, "int8+experts")


def test_padded_latent_packs_have_a_cache_key_of_their_own(make_tiny, tmp_path):
    """A pack of a model whose latent widths are whole tiles keeps the key it always had (caches stay valid); one
    whose widths are not (packed unpadded by earlier versions, then refused by the kernels) gets a new key, so such
    a stale pack is never read as the padded layout."""
    import hashlib
    from test_glm4_moe import transformers_variant
    o = quant.QuantOptions()
    whole = ModelConfig.from_dir(make_tiny("glm4-moe-lite"))
    # the key as it was computed before (default options: linear_bits and int8_matrices are left out of it)
    opts = {k: v for k, v in o.as_json().items() if k not in ("linear_bits", "int8_matrices")}
    before = hashlib.sha256(json.dumps({"fp": "f", "v": quant.VERSION, **opts}, sort_keys=True).encode())
    assert quant.cache_key("f", o, whole) == before.hexdigest()[:16]
    transformers_variant(tmp_path, "glm4-moe-lite", dict(v_head_dim=8))
    assert quant.cache_key("f", o, ModelConfig.from_dir(tmp_path)) != before.hexdigest()[:16]


def test_group_limited_routing_on_transformers_own_checkpoint(tmp_path, cache):
    """transformers' own checkpoint with n_group 4 / topk_group 2 (the group limit decides), q/k norms, attention
    bias, a correction bias that changes choices, routed_scaling_factor 2.5; cpu_int4 is held to the reference on
    its own packed weights (int8+experts: a wrong choice of experts costs top-1 wholesale)."""
    from test_glm4_moe import group_limited_checkpoint
    model = group_limited_checkpoint(tmp_path)
    ours = ModelConfig.from_dir(tmp_path)
    assert (ours.num_groups, ours.topk_groups, ours.qk_norm) == (4, 2, True)
    w = load_weights(tmp_path, ours)
    ids = [int(t) for t in np.random.default_rng(4).integers(0, 300, 60)]
    with load_batch(ours, w, cache) as batch, own_reference(ours, w, batch) as ref:
        got = batch.step([(0, ids)], all_logits=True)[0]
        want = ref.step([(0, ids)], all_logits=True)[0]
    figures = within(want, got, "int8+experts")
    assert figures["top1"] >= 0.9, figures
    with torch.no_grad():
        within(model(torch.tensor([ids])).logits[0].numpy(), got, "int4+experts")


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("kv_dtype", ["f16", "f32"])
def test_window_shift_matches_the_reference(make_tiny, cache, family, kv_dtype):
    """StreamingLLM: the kept keys re-rotated in place (glm4_moe: NeoX order over the partial rotary; the latent
    cache: only its rope part) give the reference's logits after the same shifts (the second wraps the ring)."""
    from glmcore.backend import SlotSession
    from glmcore_conformance.reference import shift_in_place
    from glmcore_plugins.torch_ref import TorchBackend
    _, cfg, w = checkpoint(make_tiny, family)
    ids = [int(t) for t in np.random.default_rng(6).integers(0, 2000, 120)]
    s = SlotSession(load_batch(cfg, w, cache, capacity=64, kv_dtype=kv_dtype))
    deq = quant.dequantized_weights(s.batch.meta, np.asarray(s.batch._blob))
    ref = TorchBackend().load(cfg, {**dict(w), **deq}, LoadOptions(capacity=64))
    got, want = [], []
    for sess, out in ((s, got), (ref, want)):
        sess.prefill(ids[:50])
        for n_keep, n_discard in ((4, 20), (4, 30)):
            sess.shift(n_keep, n_discard) if sess is s else shift_in_place(sess, n_keep, n_discard)
            more = ids[50 + len(out) * 20: 50 + len(out) * 20 + 64 - sess.kv_len]
            out.append(np.concatenate([sess.prefill(more[:-6], all_logits=True)] + [sess.decode(t)[None] for t in more[-6:]]))
        assert sess.kv_len == 64
    s.close()
    ref.close()
    figures = within(np.concatenate(want), np.concatenate(got), "int8+experts")
    assert figures["top1"] >= 0.9, figures


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_packed_file_holds_the_nextn_layer_apart_and_counts_active_bytes(make_tiny, cache, family):
    """The NextN (MTP) layer is packed apart from the decoder (mtp.0.*: the speculative drafter runs it) and not
    counted in what a decode step reads; the router stays fp32; latent attention's kv_b is packed as its two
    absorbed halves; a decode step reads the chosen experts only."""
    _, cfg, w = checkpoint(make_tiny, family)
    assert any(n.startswith("mtp.") for n in w)
    with load_batch(cfg, w, cache) as batch:
        t, stats = batch.meta["tensors"], batch.info()
        assert not any(n.startswith(f"layers.{cfg.num_layers}.") for n in t)
        nextn = {n for n in t if n.startswith("mtp.")}
        assert batch.has_nextn and nextn
        assert t["mtp.0.eh_proj.weight"]["kind"] == "tiles" and t["mtp.0.enorm.weight"]["kind"] == "f32"
        assert t["mtp.0.layer.router.weight"]["kind"] == "f32" and "mtp.0.layer.experts.0.ffn_up.weight" in t
        t = {n: v for n, v in t.items() if n not in nextn}
        assert t["layers.1.router.weight"]["kind"] == "f32"
        if family == "glm4-moe-lite":
            assert "layers.0.kv_b.weight" not in t and t["layers.0.kv_b_uk.weight"]["n"] == \
                cfg.num_heads * cfg.kv_lora_rank
            deq = quant.dequantized_weights(batch.meta, np.asarray(batch._blob))
            # the two halves mean kv_b (to int4's step)
            assert np.abs(deq["layers.0.kv_b.weight"] - w["layers.0.kv_b.weight"]).max() < \
                0.2 * np.abs(w["layers.0.kv_b.weight"]).max()
        experts = sum(v["nbytes"] for n, v in t.items() if ".experts." in n)
        others = sum(v["nbytes"] for n, v in t.items() if v["kind"] == "tiles" and ".experts." not in n)
        routers = sum(v["nbytes"] for n, v in t.items() if n.endswith("router.weight"))
        share = cfg.experts_per_token / cfg.num_experts
        assert stats["bytes_per_token"] == int(others + share * experts + routers)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_gptq_is_refused_in_one_line(make_tiny, cache, family):
    from glmcore.errors import BackendError
    _, cfg, w = checkpoint(make_tiny, family)
    with pytest.raises(BackendError, match=rf"quant=gptq calibrates the dense GLMs, not {cfg.arch}; use quant=rtn"):
        load_batch(cfg, w, cache, quant="gptq")


@pytest.mark.slow
def test_conformance_suite_on_both_moe_families(cache, tmp_path, monkeypatch):
    """The project's conformance suite, every variant cpu_int4 declares, on both tiny MoE families: the fp32
    reference at int4+experts, the reference on the packed weights at int8+experts (window shift included), and
    decode against one-shot prefill at f32 (about 5 minutes on 2 cores)."""
    from glmcore_conformance import format_table, run_suite
    monkeypatch.setenv("GLMCORE_CACHE", str(tmp_path))
    report = run_suite([CpuInt4Backend()], families=MOE_FAMILIES, decode_steps=16, threads=2)
    assert report.passed, format_table(report)
    assert {r.case for r in report.results if r.against == "own weights"} >= {"prefill", "decode", "window_shift"}
    assert {r.tolerance for r in report.results} >= {"int4+experts", "int8+experts", "f32"}



@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("isa", native.ISAS[1:])
def test_fast_kernels_give_the_plain_kernels_logits(make_tiny, cache, tmp_path, family, isa):
    """Each fast tier (its matrix kernels, its latent or grouped attention) against the plain C path on the same
    weights: a 200-token prompt, then decode steps over a 600-position cache (the AVX-512 latent attention's
    partial softmax over 3 chunks) that both took from the plain path's prompt, so each step's difference is its
    own. Every token takes every expert here, so no near-tie of the router turns a rounding difference into
    another expert; what is left is int8 activation quantization: a rounding difference can move an activation
    by one step (at a hidden size of 64, a logit by up to a few percent, and the later positions with it). So:
    most positions agree to float rounding, none beyond 5%."""
    if not native.supported(isa):
        pytest.skip(f"this CPU has no {isa}")
    d = tmp_path / "all-experts"
    shutil.copytree(make_tiny(family), d)
    config = json.loads((d / "config.json").read_text())
    config["num_experts_per_tok"] = config["n_routed_experts"]
    (d / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_dir(d)
    w = load_weights(d, cfg)
    ids = [int(t) for t in np.random.default_rng(9).integers(0, 2000, 600)]
    with load_batch(cfg, w, cache, capacity=640, isa="plain", kv_dtype="f32") as plain, \
            load_batch(cfg, w, cache, capacity=640, isa=isa, kv_dtype="f32") as fast:
        prompts = [b.step([(0, ids[:200])], all_logits=True)[0] for b in (plain, fast)]
        plain.step([(0, ids[200:590])])
        fast.import_prefix(0, plain.export_prefix(0, 590))
        steps = [np.stack([b.step([(0, [t])])[0] for t in ids[590:]]) for b in (plain, fast)]
    for want, got in (prompts, steps):
        rel = np.abs(want - got).max(axis=1) / np.abs(want).max(axis=1)
        assert np.median(rel) <= 1e-5 and rel.max() <= 0.05, (np.median(rel), rel.max())
