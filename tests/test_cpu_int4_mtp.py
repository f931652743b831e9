"""The NextN (MTP) drafter on cpu_int4: the checkpoint's NextN layer packed beside the model and run by the C
kernels from the target's hidden states (plugins/cpu_int4/session.py draft_nextn, glmi4.c glmi4_draft), on the
dense demo model, glm4_moe (an MoE NextN layer) and glm4_moe_lite (latent attention). Greedy
output with its drafts equals plain decoding; its drafts do not depend on how the sequence was fed, survive cut
verifications, copied prefixes and window slides, and are torch_ref's where the int4 rounding allows."""
import json
from pathlib import Path

import numpy as np
import pytest

from glmcore.backend import LoadOptions
from glmcore.engine import Speculation, WindowPolicy
from glmcore.errors import BackendError
from glmcore.model import load_model
from glmcore.scheduler import Scheduler
from glmcore_conformance.metrics import compare, out_of_bounds
from glmcore_conformance.tolerances import TOLERANCES
from test_speculative import check_drafts_do_not_depend_on_feeding, check_mtp_equals_plain_decoding, run_all

DEMO = str(Path(__file__).resolve().parents[1] / "glmcore" / "data" / "demo-chatglm3-poet")
HELDOUT = Path(__file__).parent / "data" / "demo_heldout_prompts.json"      # poems the demo never trained on


@pytest.fixture(scope="module", params=["demo", "glm4-moe", "glm4-moe-lite"])
def model(request, make_tiny):
    d = DEMO if request.param == "demo" else make_tiny(request.param)
    m = load_model(d, "cpu_int4", LoadOptions(threads=1, capacity=96), slots=16)
    m.scheduler.batch.start_nextn()      # as the mtp drafter does: the tests below also draft by hand
    yield m
    m.close()


def is_demo(m) -> bool:
    return Path(m.model_dir).name == Path(DEMO).name


def prompts(m, n):
    if is_demo(m):                    # the demo model: chat prompts of its own kind, so that drafts get accepted
        from glmcore.chat import as_message
        texts = [p["prompt"] for p in json.loads(HELDOUT.read_text(encoding="utf-8"))][:n]
        return [m.chat_format.encode_messages([as_message({"role": "user", "content": t})]) for t in texts]
    g = np.random.default_rng(0)
    return [g.integers(5, m.tokenizer.n_vocab, 10 + i).tolist() for i in range(n)]


def test_mtp_greedy_speculation_equals_plain_decoding(model):
    assert model.scheduler.batch.nextn_refusal is None
    together, _ = check_mtp_equals_plain_decoding(model, prompts(model, 16))     # 16 at once, then one alone
    if is_demo(model):
        # the demo's trained NextN layer: about 30% of 3-token runs right (torch: 90 of 254, here 82 of 279);
        # a layer fed the wrong states or positions gets next to none
        assert together.accepted > together.drafted / 5


def test_mtp_drafts_do_not_depend_on_how_the_sequence_was_fed(model):
    """Caught up step by step (prefill, decodes, a cut verification, a copied prefix) the NextN cache drafts what
    it drafts over the same ids prefilled at once: each position saw the same id and state."""
    model.scheduler.forget()
    check_drafts_do_not_depend_on_feeding(model.scheduler.batch, model.tokenizer.n_vocab)


def test_a_prefix_restored_from_the_prompt_cache_drafts_as_a_prefilled_one(model):
    """export_prefix/import_prefix (the prompt cache's) carry the NextN layer's cache rows and what it drafts from:
    a restored slot drafts what a slot that prefilled the same ids drafts."""
    batch = model.scheduler.batch
    model.scheduler.forget()
    ids = prompts(model, 1)[0]
    batch.step([(0, ids[:-1])])
    batch.draft_nextn(0, ids[-1], 2)               # the NextN cache catches up on slot 0
    batch.import_prefix(1, batch.export_prefix(0, len(ids) - 1))
    batch.step([(2, ids[:-1])])
    assert batch.draft_nextn(1, ids[-1], 3) == batch.draft_nextn(2, ids[-1], 3)
    model.scheduler.forget()


def test_drafts_near_the_end_of_the_ring_stop_there(model):
    batch, V = model.scheduler.batch, model.tokenizer.n_vocab
    model.scheduler.forget()
    batch.reset(0)
    batch.step([(0, np.random.default_rng(2).integers(5, V, batch.capacity - 2).tolist())])
    assert len(batch.draft_nextn(0, 7, 5)) == 3        # positions capacity-3 .. capacity-1


@pytest.mark.parametrize("family", ["demo", "glm4-moe", "glm4-moe-lite"])
def test_the_nextn_layer_computes_torchs_on_the_same_checkpoint(make_tiny, family):
    """With 8-bit weights (linear_bits=8, embed_bits=8) cpu_int4's NextN layer computes torch_ref's up to int8
    rounding of weights and activations: from torch's target states, its logits are torch's NextN logits within
    the conformance row of that rounding (int8; int8+experts for an MoE layer), and so are its first drafts' top-1
    agreement. The targets themselves are compared by the conformance suite."""
    import torch
    d = DEMO if family == "demo" else make_tiny(family)
    ref = load_model(d, "torch", LoadOptions(threads=1, capacity=64), slots=1)
    m = load_model(d, "cpu_int4", LoadOptions(threads=1, capacity=64, extra={"linear_bits": 8, "embed_bits": 8}),
                   slots=1)
    tb, cb = ref.scheduler.batch, m.scheduler.batch
    tb.start_nextn()
    cb.start_nextn()
    try:
        want, got, mine, ref_rows = [], [], [], []
        for p in prompts(m, 8):
            n = len(p) - 1
            for batch in (tb, cb):
                batch.reset(0)
                batch.step([(0, p[:-1])])
            states, nxt = tb.mtp.hidden[0, :n], p[1:]
            theirs, _ = tb.model.nextn(tb.mtp.layer, torch.tensor([nxt]), torch.tensor([0]), torch.tensor([0]),
                                       states[None], tb.mtp.k_cache[:, :, :n], tb.mtp.v_cache[:, :, :n])
            ours, _ = cb.nextn_logits(0, 0, nxt, states.numpy())
            mine.append(ours)
            ref_rows.append(theirs[0].numpy())
            cb.nextn.hidden[0, :n] = states.numpy()
            want.append(tb.draft_nextn(0, p[-1], 4))
            got.append(cb.draft_nextn(0, p[-1], 4))
    finally:
        ref.close()
        m.close()
    row = TOLERANCES["int8" if family == "demo" else "int8+experts"]
    metrics = compare(np.stack(ref_rows), np.stack(mine))
    assert not out_of_bounds(metrics, row.bounds()), metrics
    # a flipped draft changes the rest of its chain: the first ones, against the row's top-1
    assert (np.array(got)[:, 0] == np.array(want)[:, 0]).mean() >= row.top1


def test_the_window_slides_during_mtp_speculation():
    """cpu_int4 slides its ring in place, the NextN layer's cache with it: output with mtp drafts through the
    slides is plain decoding's, and the drafts after a slide are those over what the target holds."""
    m = load_model(DEMO, "cpu_int4", LoadOptions(threads=1, capacity=32), slots=2)
    try:
        V, caps, batch = m.tokenizer.n_vocab, m.backend.capabilities(), m.scheduler.batch
        ps = prompts(m, 2)
        window = WindowPolicy("window", n_keep=4)
        ref = run_all(m.scheduler, ps, 60, window=window)
        shifts = sorted(s.shifts for s in m.scheduler.slots)
        m.scheduler.forget()
        sched = Scheduler(batch, caps, n_vocab=V, speculation=Speculation("mtp", 3))
        assert run_all(sched, ps, 60, window=window) == ref
        assert sorted(s.shifts for s in sched.slots) == shifts and min(shifts) >= 2 and sched.accepted > 0
        # after a slide the NextN cache is rebuilt from the kept states: as if those were fed at once
        ids = np.random.default_rng(4).integers(5, V, 30).tolist()
        batch.reset(0)
        batch.step([(0, ids[:28])])
        batch.draft_nextn(0, ids[28], 2)
        batch.shift(0, 4, 10)
        slid = batch.draft_nextn(0, ids[28], 3)
        kept = batch.nextn.hidden[0, :18].copy()
        batch.nextn.lens[0] = 0                       # recompute every position from the same states and ids
        assert batch.draft_nextn(0, ids[28], 3) == slid
        assert np.array_equal(batch.nextn.hidden[0, :18], kept)
    finally:
        m.close()


def test_the_nextn_ring_layer_is_reserved_only_for_drafting():
    """A packed NextN layer costs each slot's KV ring one more layer only once start_nextn asks for it (the mtp
    drafter, when the scheduler is made); after tokens were fed it is refused in one line, not lost KV."""
    m = load_model(DEMO, "cpu_int4", LoadOptions(threads=1, capacity=32), slots=2)
    try:
        batch, L = m.scheduler.batch, m.config.num_layers
        assert batch.has_nextn
        plain = batch._lib.glmi4_kv_bytes(batch._h, 1)
        batch.start_nextn()
        assert batch._lib.glmi4_kv_bytes(batch._h, 1) * L == plain * (L + 1)
        batch.step([(0, [5, 6, 7])])
        batch.start_nextn()              # already started: nothing to do
        assert batch.kv_len(0) == 3
    finally:
        m.close()
    m = load_model(DEMO, "cpu_int4", LoadOptions(threads=1, capacity=32), slots=1)
    try:
        batch = m.scheduler.batch
        batch.step([(0, [5, 6, 7])])
        with pytest.raises(BackendError, match="start_nextn after tokens were fed"):
            batch.start_nextn()
        # a scheduler made over the used session empties its slots first (its own slots hold nothing), so its mtp
        # drafter starts there
        Scheduler(batch, m.backend.capabilities(), n_vocab=m.tokenizer.n_vocab, speculation=Speculation("mtp", 1))
        assert batch.kv_len(0) == 0 and batch.nextn is not None
    finally:
        m.close()
