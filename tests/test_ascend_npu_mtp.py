"""The NextN (MTP) drafter on ascend_npu's batch session (plugins/ascend_npu/session.py over the drafting shared with
torch_ref, plugins/torch_ref/nextn.py): on the host path in eager and graph mode its drafts are torch's on the same
checkpoint (the trained demo model, a dense GLM with a NextN layer; glm4_moe, whose NextN layer is an MoE layer;
glm4_moe_lite, latent attention over its own latent cache) through decodes, cut verifications, copied prefixes and resets; greedy output with its drafts equals plain
decoding; on stand-in torch_npu kernels the layer runs on the fused kernels over the whole cache with each row's
KV length. ascend_npu exports no KV (no prompt cache), so copy_prefix and reset are the NextN side's whole contract."""
from __future__ import annotations

import contextlib
import io
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from glmcore.backend import LoadOptions  # noqa: E402
from glmcore.config import ModelConfig  # noqa: E402
from glmcore.errors import BackendError  # noqa: E402
from glmcore.model import load_model  # noqa: E402
from glmcore.weights import load_weights  # noqa: E402
from glmcore_plugins.ascend_npu import AscendNpuBackend  # noqa: E402
from glmcore_plugins.torch_ref import TorchBackend  # noqa: E402
from test_cpu_int4_mtp import DEMO, prompts  # noqa: E402
from test_speculative import check_drafts_do_not_depend_on_feeding, check_mtp_equals_plain_decoding  # noqa: E402
from test_speculative import feed_and_draft  # noqa: E402

# graph mode on the host compiles each shape with inductor (about a minute per graph on 2 cores)
MODES = ["eager", pytest.param("graph", marks=pytest.mark.slow)]


def checkpoint(make_tiny, family):
    d = DEMO if family == "demo" else make_tiny(family)
    cfg = ModelConfig.from_dir(d)
    return cfg, load_weights(d, cfg)


def host(mode: str, precision: str = "f32", **extra) -> LoadOptions:
    return LoadOptions(precision=precision, capacity=96, threads=1, extra={"device": "cpu", "mode": mode, **extra})


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["demo", "glm4-moe", "glm4-moe-lite"])
def test_drafts_are_torchs_on_the_same_checkpoint(make_tiny, family, mode):
    """f32 on the host: the same greedy drafts as the torch reference after the same step-by-step history (a prefill,
    a draft, decodes, a cut verification, a prefix kept in place and copied to another slot), and after a reset and
    the ids prefilled again. The NextN side is on the device only once start_nextn asks for it."""
    cfg, w = checkpoint(make_tiny, family)
    ids = [int(t) for t in np.random.default_rng(5).integers(5, min(2000, cfg.vocab_size), 30)]
    with contextlib.redirect_stderr(io.StringIO()), \
            AscendNpuBackend().load_batch(cfg, w, host(mode, buckets="16,32", batch_buckets="2"), 3) as ours, \
            TorchBackend().load_batch(cfg, w, LoadOptions(capacity=96), 3) as ref:
        assert ours.has_nextn and ours.mtp is None
        ours.step([(2, ids[:5])])
        assert ours.mtp is None                  # a plain run keeps nothing for the layer
        drafts = []
        for batch in (ours, ref):
            batch.reset(2)
            batch.start_nextn()
            drafts.append(feed_and_draft(batch, ids, export=False))
            batch.reset(0)
            batch.step([(0, ids[:25])])
            drafts[-1].append(batch.draft_nextn(0, ids[25], 4))
        r = ours.runner
        assert {t.device for t in (ours.mtp.hidden, ours.mtp.k_cache, ours.mtp.ids)} == {r.device}
        assert ours.mtp.hidden.dtype == ours.mtp.k_cache.dtype == r.dtype
    assert drafts[0] == drafts[1]
    assert drafts[0][-1] == drafts[0][-2]         # a prefix fed at once drafts as the step-by-step one


@pytest.mark.parametrize("mode", MODES)
def test_mtp_speculation_equals_plain_decoding(mode):
    """The demo model with its trained NextN layer, 16 sequences at once and one alone: greedy output with 3 drafts
    a step is plain decoding's, the drafts get accepted as on torch (a layer fed wrong states or positions gets next
    to none), and drafts do not depend on how the sequence was fed."""
    extra = {"buckets": "64", "batch_buckets": "16"} if mode == "graph" else {}    # two graphs to compile
    with contextlib.redirect_stderr(io.StringIO()):
        m = load_model(DEMO, "ascend_npu", host(mode, **extra), slots=16)
    try:
        together, _ = check_mtp_equals_plain_decoding(m, prompts(m, 16))
        assert together.accepted > together.drafted / 5
        m.scheduler.forget()
        check_drafts_do_not_depend_on_feeding(m.scheduler.batch, m.tokenizer.n_vocab)
    finally:
        m.close()


def test_a_checkpoint_without_nextn_has_no_drafter(make_tiny):
    cfg, w = checkpoint(make_tiny, "glm4")
    with AscendNpuBackend().load_batch(cfg, w, host("eager"), 1) as b:
        assert not b.has_nextn
        with pytest.raises(BackendError, match="this checkpoint has no NextN layer to draft with"):
            b.start_nextn()
        with pytest.raises(BackendError, match="draft_nextn before start_nextn"):
            b.draft_nextn(0, 5, 2)


@pytest.mark.parametrize("n_slots", [1, 3])
def test_on_npu_kernels_the_layer_reads_the_whole_cache_with_each_rows_length(make_tiny, monkeypatch, n_slots):
    """On torch_npu's fused kernels (the stand-ins of test_ascend_npu: documented schemas, CPU results) the NextN
    layer attends over its whole contiguous cache, each call passing the row's KV length (the catch-up's prompt
    kernel, then the incremental kernel per chained draft), and writes a one-slot cache by scatter_update_; its
    drafts are the host kernels' on the same bf16 session."""
    from test_ascend_npu import NPU, _fake_torch_npu
    from glmcore_plugins.ascend_npu import session as sess
    from glmcore_plugins.ascend_npu.ops import select_ops
    cfg, w = checkpoint(make_tiny, "demo")
    ids = [int(t) for t in np.random.default_rng(3).integers(5, 2000, 14)]
    opts = AscendNpuBackend().resolve(host("eager", "bf16", block_size="16"))
    caps = AscendNpuBackend().capabilities()
    drafts = []
    with AscendNpuBackend().load_batch(cfg, w, opts, n_slots) as on_host:
        on_host.start_nextn()
        on_host.step([(0, ids[:12])])
        drafts.append(on_host.draft_nextn(0, ids[12], 3))
    fake, calls = _fake_torch_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(sess, "select_ops", lambda device, dtype, soc: select_ops(NPU, dtype, soc))
    with sess.AscendBatchSession(cfg, w, opts, caps, torch.device("cpu"), n_slots, "Ascend910B4") as b:
        b.start_nextn()
        assert not b.mtp.views and b.runner.ops.name == "npu"
        b.step([(0, ids[:12])])
        calls.clear()
        drafts.append(b.draft_nextn(0, ids[12], 3))
    # per layer call: the catch-up (12 positions ending at 12), then drafts at KV lengths 13 and 14
    attention = [c for c in calls if isinstance(c, tuple)]
    assert attention == [("fused_fa", [12]), ("incre_fa", [13]), ("incre_fa", [14])]
    assert ("scatter_update_" in calls) == (n_slots == 1)
    assert drafts[0] == drafts[1]
