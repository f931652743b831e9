"""Speculative decoding in the step loop: greedy output with drafts equals plain decoding token for token
(whatever the drafter proposes, wherever it is rejected), and the cache after a step holds exactly what
plain decoding's would; sampled acceptance keeps the model's distribution; stop strings, grammars and
the sliding window stay correct under speculation."""
import numpy as np
import pytest
from scipy import stats

from glmcore.backend import Capabilities
from glmcore.engine import NgramDrafter, Request, RequestState, Speculation, WindowPolicy
from glmcore.errors import GlmcoreError
from glmcore.sampling import Sampler, SamplingParams
from test_scheduler import VOCAB, PureBatch, held_logits, prompts

GREEDY = SamplingParams(temperature=0)
from glmcore.scheduler import Scheduler  # noqa: E402  (the public name, as the rest of the code imports it)


class Scripted:
    """Proposes the continuation plain decoding gives (`expected`), except a wrong id at draft position
    `wrong_at` (None: never wrong)."""

    def __init__(self, expected: dict, wrong_at: int | None):
        self.expected, self.wrong_at = expected, wrong_at

    def propose(self, state, k):
        want = self.expected[tuple(state.request.prompt)][len(state.tokens):len(state.tokens) + k]
        if self.wrong_at is not None and self.wrong_at < len(want):
            want[self.wrong_at] = (want[self.wrong_at] + 1) % VOCAB
        return want


def scheduler(batch, k=4, drafter=None, **kw) -> Scheduler:
    sched = Scheduler(batch, Capabilities(native_batch=True), **kw,
                      speculation=Speculation("ngram", k) if k else None)
    if drafter is not None:
        sched.drafter = drafter
    return sched


def plain(prompt, max_new=12, params=GREEDY, capacity=64, window=None, **kw):
    batch = PureBatch(n_slots=1, capacity=capacity)
    sched = scheduler(batch, k=0)
    h = sched.submit(Request(prompt, params, max_new, window=window or WindowPolicy(), **kw))
    return list(h), h, batch


@pytest.mark.parametrize("wrong_at", [None, 0, 1, 2, 3])
def test_greedy_output_and_cache_equal_plain_decoding_wherever_a_draft_is_rejected(wrong_at):
    ps = prompts(4)
    expected = {tuple(p): plain(p)[0] for p in ps}
    batch = PureBatch(n_slots=4)
    sched = scheduler(batch, 4, Scripted(expected, wrong_at))
    handles = [sched.submit(Request(p, GREEDY, 12)) for p in ps]
    sched.run()
    for h, p in zip(handles, ps):
        assert h.tokens == expected[tuple(p)] and h.timings.drafted > 0
        # the slot's cache holds the prompt and every token but the last, as plain decoding leaves it
        assert batch.held[h.slot.index] == h.slot.tokens == p + h.tokens[:-1]
    if wrong_at is None:       # every draft right: 12 tokens in 1 prefill + 3 verifications (5, 5, 1 tokens)
        assert sched.steps == 1 + 3 and sched.accepted == sched.drafted
    else:
        assert sched.accepted < sched.drafted


@pytest.mark.parametrize("wrong_at", range(4))
def test_each_verification_confirms_exactly_the_drafts_before_the_rejected_one(wrong_at):
    p, k, max_new = prompts(1)[0], 4, 9
    expected = {tuple(p): plain(p, max_new=max_new)[0]}
    sched = scheduler(PureBatch(n_slots=1), k, Scripted(expected, wrong_at))
    h = sched.submit(Request(p, GREEDY, max_new)).wait()
    n, accepted, steps = 1, 0, 1          # the prefill gives the first token
    while n < max_new:
        confirmed = min(wrong_at, k, max_new - n - 1)
        accepted, n, steps = accepted + confirmed, n + confirmed + 1, steps + 1
    assert h.tokens == expected[tuple(p)]
    assert (h.timings.accepted, sched.steps) == (accepted, steps)


def test_sixteen_sequences_with_prompt_lookup_equal_plain_decoding():
    g = np.random.default_rng(3)
    ps = [(g.integers(0, VOCAB, 6).tolist() * 4)[: 10 + i] for i in range(16)]   # repetitive: lookups hit
    batch = PureBatch(n_slots=16, capacity=96)
    sched = scheduler(batch, 5)
    handles = [sched.submit(Request(p, GREEDY, 30)) for p in ps]
    sched.run()
    for h, p in zip(handles, ps):
        assert h.tokens == plain(p, 30, capacity=96)[0]
        assert batch.held[h.slot.index] == p + h.tokens[:-1]
    assert sched.drafted > 0


def test_ngram_lookup_proposes_what_followed_the_latest_earlier_match():
    state = RequestState.new(Request([1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3]), None)
    state.history = list(state.request.prompt)
    assert NgramDrafter().propose(state, 3) == [5, 6, 2]          # "2 3" last seen before "5 6"
    state.history = [7, 8, 9]
    assert NgramDrafter().propose(state, 3) == []


def test_a_stop_string_inside_a_drafted_run_ends_the_request_where_plain_decoding_does():
    p = prompts(1)[0]
    expected, _, _ = plain(p, 12)
    cut = expected[5]

    def on_token(handle, token):             # what the server and lm-eval do with stop strings
        if token == cut:
            handle.cancel()

    base = scheduler(PureBatch(n_slots=1), 0)
    a = base.submit(Request(p, GREEDY, 12), on_token=on_token)
    a.wait()
    batch = PureBatch(n_slots=1)
    sched = scheduler(batch, 8, Scripted({tuple(p): expected}, None))
    b = sched.submit(Request(p, GREEDY, 12), on_token=on_token)
    b.wait()
    assert b.tokens == a.tokens == expected[:expected.index(cut) + 1] and b.finish_reason == "cancelled"
    assert sched.steps == 2                  # the whole run was drafted and confirmed in one step
    assert batch.held[0] == b.slot.tokens == base.slots[0].tokens     # the cut token is not fed, as in plain decoding


def test_the_window_slides_at_the_same_points_as_plain_decoding():
    p = prompts(1, 10)[0]
    window = WindowPolicy("window", n_keep=2)
    expected, ref, ref_batch = plain(p, 60, capacity=24, window=window)
    batch = PureBatch(n_slots=1, capacity=24)
    sched = scheduler(batch, 6, Scripted({tuple(p): expected}, 4))
    h = sched.submit(Request(p, GREEDY, 60, window=window))
    assert list(h) == expected and h.timings.shifts == ref.timings.shifts >= 3
    assert batch.held[0] == ref_batch.held[0]


def test_the_error_policy_ends_at_the_same_token_as_plain_decoding():
    p = prompts(1, 10)[0]
    expected, ref, _ = plain(p, 60, capacity=24)
    sched = scheduler(PureBatch(n_slots=1, capacity=24), 6, Scripted({tuple(p): expected + [0] * 40}, None))
    h = sched.submit(Request(p, GREEDY, 60))
    assert list(h) == expected and h.finish_reason == ref.finish_reason == "length" and h.context_full


def test_sampled_acceptance_keeps_the_distribution():
    """Rejection sampling with a one-point draft: the token's law is p whatever is drafted."""
    logits = np.random.default_rng(0).standard_normal(VOCAB).astype(np.float32) * 1.5
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=1.0, seed=7), VOCAB)
    ids, probs = sampler.distribution(logits)
    p = np.zeros(VOCAB)
    p[ids] = probs
    n = 20000
    for draft in (int(ids[0]), int(ids[5]), int(np.argmin(p))):     # likely, middling, unlikely
        counts = np.bincount([sampler.verify(logits, (), draft) for _ in range(n)], minlength=VOCAB)
        keep = p * n >= 5
        obs = np.append(counts[keep], counts[~keep].sum())
        exp = np.append(p[keep] * n, p[~keep].sum() * n)
        assert stats.chisquare(obs, exp).pvalue > 1e-3, draft


class Forced(PureBatch):
    """PureBatch whose prompt makes the first token certain (logits row after `prompt`: one id at +100),
    so the drafted positions that follow are sampled from a known history."""

    def __init__(self, prompt, first, **kw):
        super().__init__(**kw)
        self.prompt, self.first = prompt, first

    def forward(self, entries, all_logits=False):
        out = super().forward(entries, all_logits)
        for i, (slot, ids) in enumerate(entries):
            held = self.held[slot]
            for j in range(len(ids)):
                if held[:len(held) - len(ids) + j + 1] == self.prompt:
                    row = out[i][j] if all_logits else out[i]
                    row[:] = 0
                    row[self.first] = 100
        return out


def test_sampled_speculation_keeps_the_joint_distribution_of_two_tokens():
    """Through the loop: with [a, b] drafted after a certain first token x, the pairs (second, third)
    follow the model's law p(second | x) p(third | x, second), accepted or not."""
    p0, x = [3, 1, 4], 9
    params = SamplingParams(temperature=1.5, top_p=1.0)
    law = Sampler(params, VOCAB)
    ids, pr = law.distribution(held_logits(p0 + [x]))
    a = int(ids[0])                                  # draft the likeliest second token, then a guess
    ids1, pr1 = law.distribution(held_logits(p0 + [x, a]))
    b = int(ids1[2])
    batch = Forced(p0, x, n_slots=1, capacity=16)

    class Guess:
        def propose(self, state, k):
            return [a, b][:k]

    sched = scheduler(batch, 2, Guess(), n_vocab=VOCAB)
    n, seconds, thirds = 2000, [], []
    for seed in range(n):
        sched.forget()
        h = sched.submit(Request(p0, SamplingParams(temperature=1.5, top_p=1.0, seed=seed), 3))
        toks = list(h)
        assert toks[0] == x and batch.held[0] == p0 + toks[:-1]
        seconds.append(toks[1])
        if toks[1] == a:
            thirds.append(toks[2])
    assert sched.accepted > 0 and sched.accepted < sched.drafted
    for got, (i, q) in ((seconds, (ids, pr)), (thirds, (ids1, pr1))):
        p = np.zeros(VOCAB)
        p[i] = q
        counts = np.bincount(got, minlength=VOCAB)
        keep = p * len(got) >= 5
        obs = np.append(counts[keep], counts[~keep].sum())
        exp = np.append(p[keep], p[~keep].sum()) * len(got)
        assert stats.chisquare(obs, exp).pvalue > 1e-3


def test_speculation_is_refused_without_native_batched_steps():
    with pytest.raises(GlmcoreError, match="needs a backend with native batched steps"):
        Scheduler(PureBatch(native=False), Capabilities(), speculation=Speculation("ngram", 4))
    with pytest.raises(GlmcoreError, match="unknown speculative method 'medusa'"):
        Speculation("medusa")
    with pytest.raises(GlmcoreError, match="invalid --draft-tokens 0"):
        Speculation("ngram", 0)


# ----------------------------------------------------------------------------- the native-batch backends

# every backend with native batched steps; ascend_npu's host path (torch on the CPU, no NPU here) takes ~50 s
NATIVE = ["torch", "cpu_int4", "openvino_amx", pytest.param("ascend_npu", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def glm4_dir(make_tiny):
    return make_tiny("glm4")


@pytest.mark.parametrize("backend", NATIVE)
def test_only_the_entries_that_verify_drafts_get_every_positions_logits(glm4_dir, backend):
    """A prefill chunk sharing a step with a draft verification gets its last row only (the output layer over a
    chunk's every position is work nobody reads); the rows equal those of a step that asks every position."""
    from glmcore.model import load_model
    from glmcore.backend import LoadOptions
    from glmcore_conformance.tolerances import TOLERANCES
    m = load_model(glm4_dir, backend, LoadOptions(threads=1, capacity=64), slots=2)
    batch, V = m.scheduler.batch, m.config.vocab_size
    entries = [(0, list(range(5, 11))), (1, list(range(20, 29)))]
    mixed = batch.step(entries, [True, False])
    assert [np.shape(o) for o in mixed] == [(6, V), (1, V)]
    for slot in (0, 1):
        batch.reset(slot)
    every = batch.step(entries, True)
    assert [np.shape(o) for o in every] == [(6, V), (9, V)]
    # the same weights and ids: only the output layer's row count differs, so the rows agree within the compute
    # precision's summation-order row (f32 here; bf16 where the backend computes in bf16 on this CPU)
    atol = TOLERANCES[m.backend.resolve(LoadOptions()).precision].max_abs
    np.testing.assert_allclose(mixed[0], every[0], rtol=0, atol=atol)
    np.testing.assert_allclose(mixed[1][0], every[1][-1], rtol=0, atol=atol)
    with pytest.raises(GlmcoreError, match="all_logits names 1 entries for a step of 2"):
        batch.step(entries, [True])


def run_all(sched, ps, max_new, **kw):
    hs = [sched.submit(Request(p, GREEDY, max_new, **kw)) for p in ps]
    sched.run()
    return [h.tokens for h in hs]


@pytest.mark.parametrize("backend", NATIVE)
def test_greedy_speculation_equals_plain_decoding_on_each_native_backend(glm4_dir, backend):
    """16 sequences at once and one alone, with prompt lookup and with an oracle drafter wrong at its
    third position (so every verification confirms two drafts and rejects one); the cache after each
    request holds what plain decoding leaves."""
    from glmcore.model import load_model
    from glmcore.backend import LoadOptions
    # f32 compute: a k-token step gives each position the logits a 1-token step gives up to summation order only
    # (bf16 compute, openvino_amx's default on AMX/AVX512-BF16 CPUs, could move a near-tie)
    m = load_model(glm4_dir, backend, LoadOptions("f32", threads=1, capacity=128), slots=16)
    V, caps, batch = m.tokenizer.n_vocab, m.backend.capabilities(), m.scheduler.batch
    g = np.random.default_rng(0)
    ps = [(g.integers(5, V, 7).tolist() * 5)[: 12 + i] for i in range(16)]    # repetitive: lookups hit
    ref = run_all(m.scheduler, ps, 40)
    held = [list(s.tokens) for s in m.scheduler.slots]
    for drafter in (None, Scripted({tuple(p): r for p, r in zip(ps, ref)}, 2)):
        m.scheduler.forget()
        sched = Scheduler(batch, caps, n_vocab=V, speculation=Speculation("ngram", 4))
        if drafter is not None:
            sched.drafter = drafter
        assert run_all(sched, ps, 40) == ref
        assert 0 < sched.accepted < sched.drafted
        assert sorted(s.tokens for s in sched.slots) == sorted(held)
        assert all(batch.kv_len(s.index) == len(s.tokens) for s in sched.slots)
        sched.forget()
        assert run_all(sched, ps[:1], 40) == ref[:1]
    m.close()


def test_the_window_slides_in_place_during_speculation_on_cpu_int4(glm4_dir):
    """cpu_int4 slides its KV ring in place (re-rotating the kept keys); cutting rejected drafts after
    slides leaves the cache as plain decoding leaves it."""
    from glmcore.model import load_model
    from glmcore.backend import LoadOptions
    m = load_model(glm4_dir, "cpu_int4", LoadOptions(threads=1, capacity=32), slots=2)
    V, caps, batch = m.tokenizer.n_vocab, m.backend.capabilities(), m.scheduler.batch
    assert caps.can_shift
    g = np.random.default_rng(1)
    ps = [(g.integers(5, V, 5).tolist() * 4)[:20], g.integers(5, V, 18).tolist()]
    window = WindowPolicy("window", n_keep=4)
    ref = run_all(m.scheduler, ps, 70, window=window)
    shifts = sorted(s.shifts for s in m.scheduler.slots)
    m.scheduler.forget()
    sched = Scheduler(batch, caps, n_vocab=V, speculation=Speculation("ngram", 4))
    sched.drafter = Scripted({tuple(p): r for p, r in zip(ps, ref)}, 3)
    assert run_all(sched, ps, 70, window=window) == ref
    assert sorted(s.shifts for s in sched.slots) == shifts and min(shifts) >= 3 and sched.accepted > 0
    m.close()


def test_a_grammar_rejects_a_drafted_token_it_does_not_allow(glm4_dir):
    """The drafts are right except a token the grammar forbids: the masked row rejects it, and the
    output is plain constrained decoding's."""
    pytest.importorskip("llguidance")
    from glmcore.backend import LoadOptions
    from glmcore.model import load_model
    from glmcore.structured import Grammar, compile_grammar
    m = load_model(glm4_dir, "torch", LoadOptions(threads=1, capacity=128), slots=1)
    tok, caps, batch = m.tokenizer, m.backend.capabilities(), m.scheduler.batch
    constraint = compile_grammar(tok, Grammar.regex(r"alpha beta gamma delta epsilon"), m.config.vocab_size)
    prompt = [tok.special_ids["[gMASK]"], tok.special_ids["<sop>"]] + tok.encode("say it")
    ref = m.scheduler.submit(Request(prompt, GREEDY, 30, [tok.eos_id], constraint=constraint)).wait()
    assert tok.decode(ref.tokens) == "alpha beta gamma delta epsilon" and len(ref.tokens) > 4
    forbidden = tok.encode("zeta")[0]

    class Breaker:
        def propose(self, state, k):
            want = ref.tokens[len(state.tokens):len(state.tokens) + k]
            return want[:1] + [forbidden] + want[2:]

    m.scheduler.forget()
    sched = Scheduler(batch, caps, n_vocab=tok.n_vocab, speculation=Speculation("ngram", 4))
    sched.drafter = Breaker()
    h = sched.submit(Request(prompt, GREEDY, 30, [tok.eos_id], constraint=constraint)).wait()
    assert h.tokens == ref.tokens and h.finish_reason == ref.finish_reason == "stop"
    assert 0 < sched.accepted < sched.drafted
    m.close()


# ----------------------------------------------------------------------------- the command line and the server

def test_run_with_prompt_lookup_prints_what_plain_decoding_prints(tmp_path, capsys):
    from glmcore.cli import main
    f = tmp_path / "p.txt"
    f.write_text("copy this: red green blue red green blue red green blue\nhello there\n", encoding="utf-8")
    common = ["run", "--backend", "cpu_int4", "--prompts", str(f), "--max-new-tokens", "24", "--temperature", "0",
              "--threads", "1"]
    assert main(common) == 0
    plain_out = capsys.readouterr().out
    assert main(common + ["--speculative", "ngram", "--draft-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    assert out == plain_out and "| drafted " in err
    assert main(common + ["--speculative", "mtp", "--draft-tokens", "2"]) == 0    # the demo's NextN layer
    out, err = capsys.readouterr()
    assert out == plain_out and "| drafted " in err


@pytest.mark.parametrize("backend, why", [
    ("cpu_int4", "the checkpoint has no multi-token-prediction (NextN) layer"),      # the backend's own reason
    ("torch", "it needs a checkpoint with a multi-token-prediction (NextN) layer"),  # the generic one
    ("ascend_npu", "it needs a checkpoint with a multi-token-prediction (NextN) layer"),
])
def test_mtp_without_a_nextn_layer_is_refused_with_the_reason(make_tiny, capsys, backend, why):
    from glmcore.cli import main
    assert main(["run", "--model", str(make_tiny("glm4")), "--backend", backend, "--prompt", "hi",
                 "--speculative", "mtp"]) == 2
    err = capsys.readouterr().err
    assert f"--speculative mtp cannot run: {why}" in err and "use --speculative ngram" in err


class Echo:
    """Drafts the last id again, k times."""
    def propose(self, state, k):
        return state.history[-1:] * k


def test_the_server_counts_drafted_and_accepted_tokens(make_tiny):
    pytest.importorskip("fastapi")
    from glmcore.backend import LoadOptions
    from glmcore.model import load_model
    from test_server import client, metric, serving
    d = make_tiny("chatglm3")
    replies = []
    for spec in (None, Speculation("ngram", 4)):
        m = load_model(d, "torch", LoadOptions(threads=1), slots=2, speculation=spec)
        if spec is not None:             # drafts every step, whatever the random model writes
            m.scheduler.drafter = Echo()
        with serving(m) as url:
            r = client(url).completions.create(model="tiny", prompt="a b c a b c a b c a b c", max_tokens=24,
                                               temperature=0)
            replies.append(r.choices[0].text)
            drafted, accepted = metric(url, "glmcore_draft_tokens"), metric(url, "glmcore_draft_accepted_tokens")
        m.close()
    assert replies[0] == replies[1]
    assert drafted > 0 and 0 <= accepted <= drafted


def test_a_two_turn_chat_with_prompt_lookup_equals_one_without(make_tiny):
    """The Pipeline reuses the slot's cache for the next turn: after cut drafts it must hold the reply."""
    from glmcore.backend import LoadOptions
    from glmcore.pipeline import Pipeline
    d = make_tiny("glm4")
    turns = ["say: one two three one two three", "again: one two three"]
    replies = []
    for spec in (None, Speculation("ngram", 4)):
        pipe = Pipeline(d, "cpu_int4", LoadOptions(threads=1), speculation=spec)
        msgs, out = [], []
        for t in turns:
            msgs.append({"role": "user", "content": t})
            reply = pipe.chat(msgs, params=GREEDY, max_new_tokens=20)
            out.append(reply.content)
            msgs.append({"role": "assistant", "content": reply.content})
        assert pipe.timings.cached_tokens > 0            # the second turn prefilled only its own ids
        replies.append(out)
        pipe.model.close()
    assert replies[0] == replies[1]


# ----------------------------------------------------------------------------- the MTP (NextN) drafter

@pytest.fixture(scope="module")
def moe(make_tiny):
    from glmcore.backend import LoadOptions
    from glmcore.model import load_model
    m = load_model(make_tiny("glm4-moe"), "torch", LoadOptions(threads=1, capacity=96), slots=16)
    m.scheduler.batch.start_nextn()      # as the mtp drafter does: the tests below also draft by hand
    yield m
    m.close()


def check_mtp_equals_plain_decoding(m, prompts: list[list[int]], gen: int = 24) -> list[Scheduler]:
    """Greedy decoding with 3 NextN drafts a step gives plain decoding's tokens, for all the prompts at once and for
    the first alone, with drafts made and each slot's cache as long as what it holds. Returns those schedulers."""
    V, caps, batch = m.tokenizer.n_vocab, m.backend.capabilities(), m.scheduler.batch
    assert batch.has_nextn
    m.scheduler.forget()
    ref = run_all(m.scheduler, prompts, gen)
    used = []
    for group in (prompts, prompts[:1]):
        m.scheduler.forget()
        sched = Scheduler(batch, caps, n_vocab=V, speculation=Speculation("mtp", 3))
        assert run_all(sched, group, gen) == ref[:len(group)]
        assert sched.drafted > 0
        assert all(batch.kv_len(s.index) == len(s.tokens) for s in sched.slots)
        used.append(sched)
    return used


def test_mtp_greedy_speculation_equals_plain_decoding(moe):
    g = np.random.default_rng(0)
    check_mtp_equals_plain_decoding(moe, [g.integers(5, moe.tokenizer.n_vocab, 10 + i).tolist() for i in range(16)])


def test_mtp_drafts_do_not_depend_on_how_the_sequence_was_fed(moe):
    """The NextN cache caught up step by step (prefill, decodes, a cut verification, a copied prefix)
    drafts what it drafts over the same ids prefilled at once: each position saw the same id and state."""
    moe.scheduler.forget()
    check_drafts_do_not_depend_on_feeding(moe.scheduler.batch, moe.tokenizer.n_vocab)


def check_drafts_do_not_depend_on_feeding(batch, V):
    """Slots 0-2 of batch: drafts after a step-by-step history (prefill, a draft, decodes, a cut verification,
    a copied prefix) equal those after the same ids prefilled at once."""
    ids = np.random.default_rng(5).integers(5, V, 30).tolist()
    batch.reset(0)
    batch.step([(0, ids[:12])])
    batch.draft_nextn(0, ids[12], 3)
    batch.step([(0, ids[12:14])])
    batch.step([(0, ids[14:20] + [1, 2, 3])], all_logits=True)      # a verification whose last 3 are rejected
    batch.copy_prefix(0, 0, 20)
    batch.draft_nextn(0, ids[20], 2)
    batch.step([(0, ids[20:25])])
    batch.copy_prefix(0, 1, 25)                                       # another slot takes the prefix
    stepwise = [batch.draft_nextn(s, ids[25], 4) for s in (0, 1)]
    batch.reset(2)
    batch.step([(2, ids[:25])])
    assert stepwise == [batch.draft_nextn(2, ids[25], 4)] * 2


def feed_and_draft(batch, ids, export: bool = True):
    """Drafts after a step-by-step history: a prefill, a draft, decodes, a cut verification, a copied prefix,
    another slot taking the prefix, a prefix exported and imported into a third slot (with `export`: backends
    with Capabilities.kv_export)."""
    out = []
    batch.step([(0, ids[:12])])
    out.append(batch.draft_nextn(0, ids[12], 3))
    batch.step([(0, ids[12:14])])
    batch.step([(0, ids[14:20] + [1, 2, 3])], all_logits=True)
    batch.copy_prefix(0, 0, 20)
    out.append(batch.draft_nextn(0, ids[20], 2))
    batch.step([(0, ids[20:25])])
    batch.copy_prefix(0, 1, 25)
    out += [batch.draft_nextn(s, ids[25], 4) for s in (0, 1)]
    if export:
        batch.import_prefix(2, batch.export_prefix(1, 25))
        out.append(batch.draft_nextn(2, ids[25], 4))
    return out


def test_mtp_first_draft_is_the_nextn_formula(moe):
    """eh_proj(concat(enorm(embed(t)), hnorm(h))) -> the layer -> final norm -> lm_head, computed here with
    the layer's own weights on the whole sequence (the embedding at position 0 zeroed, as vLLM does)."""
    import torch
    batch, V = moe.scheduler.batch, moe.tokenizer.n_vocab
    model, mtp = batch.model, batch.mtp.layer
    moe.scheduler.forget()
    ids = np.random.default_rng(7).integers(5, V, 9).tolist()
    _, hidden = model(torch.tensor([ids]), torch.tensor([0]), torch.tensor([3]), torch.tensor([8]),
                      batch.k_cache, batch.v_cache)
    nxt = ids[1:] + [42]
    e = model.embed[torch.tensor(nxt)].clone()
    e[0] = 0
    rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model.cfg.norm_eps) * w   # noqa: E731
    x = torch.cat([rms(e, mtp.enorm), rms(hidden[0], mtp.hnorm)], -1) @ mtp.eh_proj.T
    k, v = torch.zeros_like(batch.mtp.k_cache[:1]), torch.zeros_like(batch.mtp.v_cache[:1])
    step = model.make_step(torch.tensor([0]), torch.tensor([0]), 9, k)
    out = model.block(mtp.layer, x[None], lambda h: model.attention(mtp.layer, h, step, k, v))[0, -1]
    want = int(torch.argmax(rms(out, mtp.final_norm) @ model.lm_head.T))
    batch.reset(3)
    batch.step([(3, ids)])
    assert batch.draft_nextn(3, 42, 1) == [want]


def with_nextn(src, out, drop: str | None = None, duplicate: bool = False):
    """A copy of the dense checkpoint src with a random NextN layer in mtp.safetensors (glmcore's extension, as the
    demo model has one): drop leaves one tensor out, duplicate stores one of the model's own tensors there too."""
    import dataclasses
    import json
    import shutil

    from glmcore.arch import of
    from glmcore.arch.glm import chatglm_name, mtp_as_layer
    from glmcore.config import ModelConfig
    from glmcore.weights import NEXTN_FILE, read_safetensors, write_safetensors
    shutil.copytree(src, out)
    raw = json.loads((out / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(raw))
    cfg = dataclasses.replace(ModelConfig.from_dir(src), num_mtp_layers=1)
    g = np.random.default_rng(3)
    side = {chatglm_name(mtp_as_layer(n, cfg)): (g.standard_normal(s.shape) * 0.2).astype(np.float32)
            for n, s in of(cfg).optional_tensors(cfg).items() if n != drop}
    if duplicate:
        name, t = next(iter(read_safetensors(sorted(src.glob("*.safetensors"))[0]).items()))
        side[name] = np.asarray(t)
    write_safetensors(out / NEXTN_FILE, side, {"format": "pt"})
    return out


def test_a_dense_checkpoint_drafts_with_its_nextn_layer(make_tiny, tmp_path):
    """A NextN layer beside a dense (ChatGLM3) checkpoint runs on torch: greedy output with mtp drafts equals
    plain decoding, and the drafts are being made."""
    from glmcore.backend import LoadOptions
    from glmcore.model import load_model
    m = load_model(with_nextn(make_tiny("chatglm3"), tmp_path / "m"), "torch", LoadOptions(threads=1, capacity=64),
                   slots=4)
    try:
        batch, V, caps = m.scheduler.batch, m.tokenizer.n_vocab, m.backend.capabilities()
        assert batch.has_nextn
        ps = [np.random.default_rng(i).integers(5, V, 8 + i).tolist() for i in range(4)]
        ref = run_all(m.scheduler, ps, 16)
        m.scheduler.forget()
        sched = Scheduler(batch, caps, n_vocab=V, speculation=Speculation("mtp", 3))
        assert run_all(sched, ps, 16) == ref and sched.drafted > 0
    finally:
        m.close()


@pytest.mark.parametrize("drop, duplicate, message", [
    ("mtp.0.eh_proj.weight", False, "mtp.0.eh_proj.weight is missing"),
    (None, True, "is also in the checkpoint's own weights"),
])
def test_a_broken_nextn_file_is_refused_with_its_reason(make_tiny, tmp_path, drop, duplicate, message):
    from glmcore.config import ModelConfig
    from glmcore.errors import CheckpointError
    from glmcore.weights import load_weights
    d = with_nextn(make_tiny("chatglm3"), tmp_path / "m", drop, duplicate)
    with pytest.raises(CheckpointError, match=message):
        load_weights(d, ModelConfig.from_dir(d))


def test_a_nextn_file_without_its_config_key_is_not_read(make_tiny, tmp_path):
    import json

    from glmcore.config import ModelConfig
    from glmcore.weights import load_weights
    d = with_nextn(make_tiny("chatglm3"), tmp_path / "m")
    raw = json.loads((d / "config.json").read_text())
    del raw["num_nextn_predict_layers"]
    (d / "config.json").write_text(json.dumps(raw))
    assert not any(n.startswith("mtp.") for n in load_weights(d, ModelConfig.from_dir(d)))


@pytest.mark.parametrize("backend", ["torch", "cpu_int4"])
def test_a_nextn_layer_costs_nothing_until_the_mtp_drafter_starts_it(backend):
    """The demo model ships a NextN layer: run plainly, the session keeps no hidden states for it (memory and a
    copy per step); the mtp drafter turns that on before its first step; drafting by hand before is refused."""
    from glmcore.backend import LoadOptions
    from glmcore.errors import BackendError
    from glmcore.model import load_model
    m = load_model(None, backend, LoadOptions(threads=1, capacity=64), slots=1)
    try:
        batch = m.scheduler.batch
        state = lambda: getattr(batch, "mtp" if backend == "torch" else "nextn")     # noqa: E731
        assert batch.has_nextn
        batch.step([(0, [5, 6, 7])])
        assert state() is None
        with pytest.raises(BackendError, match="before start_nextn"):
            batch.draft_nextn(0, 8, 2)
        m.scheduler.forget()
        Scheduler(batch, m.backend.capabilities(), n_vocab=m.tokenizer.n_vocab, speculation=Speculation("mtp", 2))
        assert state() is not None
    finally:
        m.close()
