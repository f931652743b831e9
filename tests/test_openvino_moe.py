"""openvino_amx on the MoE GLMs: glm4_moe (f32 router with group limiting, experts through opset17's GroupedMatMul,
q/k norms, NeoX partial rotary) and glm4_moe_lite (latent attention over a latent KV state, kv_b absorbed). Held to
transformers' own Glm4MoeForCausalLM / Glm4MoeLiteForCausalLM, and to the torch reference on the weights the graph
computes with (dequantized as it dequantizes them) within the f32 row: the graph is exact, whatever the format.
Single sequence (stateful model) and the paged batch form; prefill, decode and a 300-token prompt."""
from __future__ import annotations

import contextlib
import dataclasses
import io

import numpy as np
import pytest

ov = pytest.importorskip("openvino")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from glmcore.backend import LoadOptions                                  # noqa: E402
from glmcore.config import ModelConfig                                   # noqa: E402
from glmcore.errors import BackendError                                  # noqa: E402
from glmcore.weights import load_weights                                 # noqa: E402
from glmcore_conformance.metrics import compare, out_of_bounds           # noqa: E402
from glmcore_conformance.tolerances import TOLERANCES, tolerance_key     # noqa: E402
from glmcore_plugins.openvino_amx import OpenVINOBackend, graph          # noqa: E402
from glmcore_plugins.torch_ref import TorchBackend                       # noqa: E402
from test_speculative import feed_and_draft                              # noqa: E402

MOE_FAMILIES = ["glm4-moe", "glm4-moe-lite"]
HF_CLASS = {"glm4-moe": "Glm4MoeForCausalLM", "glm4-moe-lite": "Glm4MoeLiteForCausalLM"}
BACKEND = OpenVINOBackend()


@pytest.fixture(scope="module", autouse=True)
def ready():
    p = BACKEND.probe()
    if not p.ready:
        pytest.skip(f"openvino_amx not ready: {p.reason}")


def checkpoint(make_tiny, family):
    d = make_tiny(family)
    cfg = ModelConfig.from_dir(d)
    return d, cfg, load_weights(d, cfg)


def options(weights="f32", **kw):
    return LoadOptions(precision="f32", weights=weights, capacity=512, threads=2, **kw)


def effective(cfg, w, weights):
    """The checkpoint with every weight as the graph computes with it."""
    eff, _ = BACKEND.conformance_weights(cfg, w, options(weights))
    return {**dict(w), **eff}


def within(want, got, row):
    figures = compare(want, got)
    assert not out_of_bounds(figures, TOLERANCES[row].bounds()), (row, figures)
    return figures


def hf_logits(d, family, ids):
    transformers.logging.set_verbosity_error()
    hf = getattr(transformers, HF_CLASS[family]).from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def prompt(seed=3, n=300):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 2000, n)]


def single(session, ids):
    """A 40-token prefill, 6 decode steps, then the rest of the prompt in one prefill (chunked by the session)."""
    out = [session.prefill(ids[:40], all_logits=True)] + [session.decode(t)[None] for t in ids[40:46]]
    return np.concatenate(out + [session.prefill(ids[46:], all_logits=True)])


# two sequences: one step of both prefills, six decode steps of both, then the rest of a 300-token prompt
def batch_steps(a, b):
    return [[(0, a[:40]), (1, b[:12])]] + [[(0, [a[40 + k]]), (1, [b[12 + k]])] for k in range(6)] + [[(0, a[46:])]]


def run_batch(batch, steps):
    got = [batch.step(entries, all_logits=True) for entries in steps]
    return (np.concatenate([got[0][0]] + [g[0] for g in got[1:]]),
            np.concatenate([got[0][1]] + [g[1] for g in got[1:7]]))


@pytest.mark.parametrize("weights", ["f32", "int8", "int4"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_single_sequence_matches_the_reference_and_transformers(make_tiny, family, weights):
    """The stateful model (prefill, decode, a 300-token prompt) against the reference on the graph's own
    weights within the f32 row (exact), and against transformers' model on the checkpoint within the row of
    the weight format with routed experts."""
    d, cfg, w = checkpoint(make_tiny, family)
    ids = prompt()
    with contextlib.redirect_stderr(io.StringIO()), BACKEND.load(cfg, w, options(weights)) as s:
        got = single(s, ids)
    with TorchBackend().load(cfg, effective(cfg, w, weights), LoadOptions(capacity=512)) as ref:
        own = ref.prefill(ids, all_logits=True)
    within(own, got, "f32")
    within(hf_logits(d, family, ids), got, tolerance_key("f32", weights, experts=True))


@pytest.mark.parametrize("weights", ["f32", "int4"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_paged_batch_form_matches_the_reference(make_tiny, family, weights):
    """The paged-attention form (latent attention's key and value states of different widths included): two
    sequences in mixed prefill/decode steps give the reference's logits on the graph's own weights."""
    _, cfg, w = checkpoint(make_tiny, family)
    a, b = prompt(3), prompt(4, 18)
    steps = batch_steps(a, b)
    with contextlib.redirect_stderr(io.StringIO()), BACKEND.load_batch(cfg, w, options(weights), 2) as batch:
        got_a, got_b = run_batch(batch, steps)
    with TorchBackend().load_batch(cfg, effective(cfg, w, weights), LoadOptions(capacity=512), 2) as ref:
        want_a, want_b = run_batch(ref, steps)
    within(want_a, got_a, "f32")
    within(want_b, got_b, "f32")


def test_group_limited_routing_on_transformers_own_checkpoint(tmp_path):
    """transformers' own checkpoint with n_group 4 / topk_group 2 (the group limit decides), q/k norms, attention
    bias, a correction bias that changes choices and routed_scaling_factor 2.5: f32 logits as transformers'."""
    from test_glm4_moe import group_limited_checkpoint
    model = group_limited_checkpoint(tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    assert (cfg.num_groups, cfg.topk_groups, cfg.qk_norm) == (4, 2, True)
    ids = [int(t) for t in np.random.default_rng(4).integers(0, 300, 60)]
    with BACKEND.load(cfg, load_weights(tmp_path, cfg), options()) as s:
        got = s.prefill(ids, all_logits=True)
    with torch.no_grad():
        within(model(torch.tensor([ids])).logits[0].numpy(), got, "f32")


def test_transformers_own_latent_attention_checkpoint_without_q_lora(tmp_path):
    """transformers' own glm4_moe_lite checkpoint on the branches the synthetic one leaves out: q_proj without the q
    LoRA, attention biases (q/kv_a/o), NeoX-order rope (rope_interleave false), group-limited routing with a
    correction bias that changes choices: f32 logits as transformers'."""
    cfg = transformers.Glm4MoeLiteConfig(
        vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, n_group=2,
        topk_group=1, attention_bias=True, rope_interleave=False, routed_scaling_factor=1.8,
        mlp_layer_types=["dense", "sparse"])
    torch.manual_seed(1)
    model = transformers.Glm4MoeLiteForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.3 if "norm" not in name else 0.1).add_(1.0 if "norm" in name else 0.0)
        model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(tmp_path, safe_serialization=True)
    ours = ModelConfig.from_dir(tmp_path)
    assert (ours.q_lora_rank, ours.qkv_bias, ours.rotary_interleaved, ours.num_groups) == (0, True, False, 2)
    ids = [int(t) for t in np.random.default_rng(5).integers(0, 300, 60)]
    with BACKEND.load(ours, load_weights(tmp_path, ours), options()) as s:
        got = s.prefill(ids, all_logits=True)
    with torch.no_grad():
        within(model(torch.tensor([ids])).logits[0].numpy(), got, "f32")


def test_a_wrong_expert_order_fails(make_tiny, monkeypatch):
    """Sabotage: rows left unsorted under the right offsets, or offsets one expert early, must fail the f32 row
    (so the tests above see the grouping, not just the shapes)."""
    _, cfg, w = checkpoint(make_tiny, "glm4-moe")
    ids = prompt(n=60)
    with TorchBackend().load(cfg, w, LoadOptions(capacity=512)) as ref:
        want = ref.prefill(ids, all_logits=True)
    right = graph._by_expert

    def unsorted(expert, pairs, n):
        order, offsets = right(expert, pairs, n)
        return graph.ops.range(graph._c(0, np.int32), pairs, graph._c(1, np.int32), graph.I32).output(0), offsets

    def early(expert, pairs, n):     # each expert's rows end where the next one's do (the total stays right)
        order, offsets = right(expert, pairs, n)
        ops, c = graph.ops, graph._c
        shifted = ops.concat([ops.slice(offsets, c([1]), c([n]), c([1])), ops.slice(offsets, c([n - 1]), c([n]),
                                                                                     c([1]))], 0)
        return order, shifted.output(0)
    for sabotage in (unsorted, early):
        monkeypatch.setattr(graph, "_by_expert", sabotage)
        with BACKEND.load(cfg, w, options()) as s:
            got = s.prefill(ids, all_logits=True)
        assert out_of_bounds(compare(want, got), TOLERANCES["f32"].bounds()), sabotage.__name__


@pytest.mark.parametrize("weights,kind", [("int8", "i8"), ("int4", "i4")])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_experts_run_sparse_on_compressed_weights_and_nextn_is_no_layer(make_tiny, family, weights, kind):
    """Each MoE layer's two GroupedMatMuls compile to the CPU plugin's GatherMatmul (only the experts present
    run) reading the stacked experts compressed (i8/i4 inputs, no f32 copy); one attention per decoder layer:
    the checkpoint's NextN layer (mtp.*) is not built into the decoder."""
    _, cfg, w = checkpoint(make_tiny, family)
    assert any(n.startswith("mtp.") for n in w)
    model = graph.build_model(cfg, w, weights)
    types = [op.get_type_name() for op in model.get_ordered_ops()]
    assert types.count("GroupedMatMul") == 2 * sum(cfg.sparse_layers)
    assert types.count("ScaledDotProductAttention") == cfg.num_layers
    with contextlib.redirect_stderr(io.StringIO()), BACKEND.load(cfg, w, options(weights)) as s:
        runtime = [(op, op.get_rt_info()["layerType"].astype(str)) for op in s.compiled.get_runtime_model().get_ordered_ops()]
    gathered = [op for op, t in runtime if t == "GatherMatmul"]
    assert len(gathered) == 2 * sum(cfg.sparse_layers)
    for op in gathered:
        stacked = op.input(1)
        assert stacked.get_element_type().get_type_name() == kind
        assert stacked.get_partial_shape()[0].get_length() == cfg.num_experts


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_bytes_per_token_reads_the_chosen_experts_and_the_kv_states(make_tiny, family):
    """The bench's roofline: a decode step reads k of E experts (GatherMatmul), every other matrix as stored (int8:
    a byte and an f16 scale per row), and per position of each layer K and V (latent attention: the latent key and
    the latent as the value), f32 with --precision f32."""
    from glmcore.arch import of
    from glmcore_conformance.bench import default_bytes_per_token
    _, cfg, _ = checkpoint(make_tiny, family)
    opts = options("int8")
    ours = BACKEND.bytes_per_token(cfg, opts, 0)
    tensors = of(cfg).tensors(cfg)
    experts = sum(int(np.prod(t.shape)) + 2 * t.shape[0] for n, t in tensors.items() if ".experts." in n)
    every_expert = dataclasses.replace(cfg, experts_per_token=cfg.num_experts)
    unread = graph.decode_weight_bytes(every_expert, tensors, "int8", 128) - ours
    assert abs(unread - experts * (1 - cfg.experts_per_token / cfg.num_experts)) <= 1
    assert ours < default_bytes_per_token(cfg, opts, 0)
    per_position = cfg.latent_size + cfg.kv_lora_rank if family == "glm4-moe-lite" else 2 * cfg.kv_size
    assert BACKEND.bytes_per_token(cfg, opts, 10) - ours == 10 * cfg.num_layers * per_position * 4


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_ir_cache_round_trips_the_moe_graph(make_tiny, tmp_path, family):
    """GroupedMatMul, the stacked int4 experts and the latent states survive save_model/read_model: the IR read
    back from the cache gives the in-memory graph's logits."""
    _, cfg, w = checkpoint(make_tiny, family)
    ids = prompt(n=50)
    runs = []
    for cache in (None, tmp_path):
        with contextlib.redirect_stderr(io.StringIO()), BACKEND.load(cfg, w, options("int4", cache_dir=cache)) as s:
            runs.append(s.prefill(ids, all_logits=True))
    assert any(tmp_path.rglob("openvino_model.xml"))
    within(runs[0], runs[1], "f32")


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_converted_ir_runs_in_openvino_genai_llmpipeline(make_tiny, tmp_path, family):
    """`glmcore convert`'s MoE IR in openvino_genai, stateful (SDPA) and in GenAI's own paged form (PA): the greedy
    tokens of our session."""
    genai = pytest.importorskip("openvino_genai")
    from glmcore_plugins.openvino_amx import session as ovs
    _, cfg, w = checkpoint(make_tiny, family)
    opts = BACKEND.resolve(LoadOptions("f32", "int8", 128))
    BACKEND.convert(cfg, w, opts, tmp_path, lambda m: None)
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, 17).tolist()
    with BACKEND.load(cfg, w, opts) as s:
        ours = [int(np.argmax(s.prefill(prompt)))]
        while len(ours) < 12:
            ours.append(int(np.argmax(s.decode(ours[-1]))))
    for attention in ("SDPA", "PA"):
        pipe = genai.LLMPipeline(str(tmp_path), "CPU", ATTENTION_BACKEND=attention, **ovs.compile_config(opts))
        gc = genai.GenerationConfig()
        gc.max_new_tokens, gc.do_sample, gc.ignore_eos = 12, False, True
        assert list(pipe.generate(ov.Tensor(np.array([prompt], dtype=np.int64)), gc).tokens[0]) == ours, attention


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_supported_and_gptq_refused_in_one_line(make_tiny, family):
    _, cfg, w = checkpoint(make_tiny, family)
    assert BACKEND.supports(cfg) is None
    assert any(cfg.arch in a for a in BACKEND.architectures())
    with pytest.raises(BackendError, match=rf"quant=gptq calibrates the dense GLMs, not {cfg.arch}; use quant=rtn"):
        BACKEND.load(cfg, w, options("int4", extra={"quant": "gptq"}))


@pytest.mark.slow
def test_conformance_suite_on_both_moe_families(tmp_path, monkeypatch):
    """The project's conformance suite, every configuration openvino_amx declares, on both tiny MoE families
    (about 2 minutes on 2 cores)."""
    from glmcore_conformance import format_table, run_suite
    monkeypatch.setenv("GLMCORE_CACHE", str(tmp_path))
    report = run_suite([BACKEND], families=MOE_FAMILIES, decode_steps=16, threads=2)
    assert report.passed, format_table(report)
    assert len({r.model for r in report.results}) == 2, {r.model for r in report.results}      # both families
    assert {r.tolerance for r in report.results} >= {"f32", "int8+experts", "int4+experts"}, format_table(report)


# ---------------------------------------------------------------- the NextN (MTP) drafter on the batch session

@pytest.mark.parametrize("family", MOE_FAMILIES + ["demo"])
def test_nextn_drafts_are_the_references(make_tiny, family):
    """The checkpoint's NextN layer as a model of its own drafts what the torch reference drafts (f32: the same
    greedy tokens), through copy_prefix and a prefix exported and imported; on both MoE families and on the
    trained demo model (a dense GLM with a NextN layer)."""
    if family == "demo":
        from glmcore.demo import PACKAGED_DIR
        cfg = ModelConfig.from_dir(PACKAGED_DIR)
        w = load_weights(PACKAGED_DIR, cfg)
    else:
        _, cfg, w = checkpoint(make_tiny, family)
    ids = [int(t) for t in np.random.default_rng(5).integers(5, min(2000, cfg.vocab_size), 30)]
    drafts = []
    with contextlib.redirect_stderr(io.StringIO()), BACKEND.load_batch(cfg, w, options(), 3) as ours, \
            TorchBackend().load_batch(cfg, w, LoadOptions(capacity=512), 3) as ref:
        for batch in (ours, ref):
            assert batch.has_nextn
            batch.start_nextn()
            drafts.append(feed_and_draft(batch, ids))
    assert drafts[0] == drafts[1]


def test_mtp_speculation_equals_plain_decoding(make_tiny):
    """Greedy decoding with NextN drafts gives plain decoding's tokens (16 sequences at once and one alone), and
    drafts do not depend on how the sequence was fed (int8 weights)."""
    from glmcore.model import load_model
    from test_speculative import check_drafts_do_not_depend_on_feeding, check_mtp_equals_plain_decoding
    with contextlib.redirect_stderr(io.StringIO()):
        m = load_model(make_tiny("glm4-moe"), "openvino_amx",      # f32 compute on every CPU (see test_speculative)
                       LoadOptions("f32", threads=2, capacity=96, weights="int8"), slots=16)
    try:
        m.scheduler.batch.start_nextn()
        g = np.random.default_rng(0)
        check_mtp_equals_plain_decoding(m, [g.integers(5, m.tokenizer.n_vocab, 10 + i).tolist() for i in range(16)])
        check_drafts_do_not_depend_on_feeding(m.scheduler.batch, m.tokenizer.n_vocab)
    finally:
        m.close()


def test_a_checkpoint_without_nextn_has_no_drafter(make_tiny):
    d = make_tiny("glm4")
    cfg = ModelConfig.from_dir(d)
    with contextlib.redirect_stderr(io.StringIO()), BACKEND.load_batch(cfg, load_weights(d, cfg), options(), 1) as b:
        assert not b.has_nextn
        with pytest.raises(BackendError, match="this checkpoint has no NextN layer to draft with"):
            b.start_nextn()


def test_drafting_before_start_and_a_foreign_nextn_blob_are_refused(make_tiny):
    """draft_nextn before start_nextn, and a prefix blob whose NextN part is not this model's, are one-line errors."""
    _, cfg, w = checkpoint(make_tiny, "glm4-moe")
    with contextlib.redirect_stderr(io.StringIO()), BACKEND.load_batch(cfg, w, options(), 2) as b:
        with pytest.raises(BackendError, match="draft_nextn before start_nextn"):
            b.draft_nextn(0, 5, 2)
        b.start_nextn()
        b.step([(0, list(range(5, 17)))])
        blob = b.export_prefix(0, 12)
        n_caches = len(blob.parts) - 3 - len(b.mtp.states(0))
        ids = blob.parts[n_caches]
        foreign = dataclasses.replace(blob, parts=blob.parts[:n_caches] + (ids[:-1],) + blob.parts[n_caches + 1:])
        with pytest.raises(BackendError, match="NextN part does not fit this session"):
            b.import_prefix(1, foreign)


def test_an_openvino_without_grouped_matmul_refuses_the_moe_glms(make_tiny, monkeypatch):
    """Before OpenVINO 2026 (no opset17) the MoE graph cannot be built: supports() says so in one line; the dense
    GLMs still run."""
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openvino.opset17" else
                        real(name, *a))
    for family in ("glm4-moe", "glm4-moe-lite"):
        why = BACKEND.supports(ModelConfig.from_dir(make_tiny(family)))
        assert why and "opset17's GroupedMatMul" in why and "pip install -U 'openvino>=2026.0'" in why
        assert "\n" not in why
    assert BACKEND.supports(ModelConfig.from_dir(make_tiny("glm4"))) is None
