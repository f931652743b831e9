"""The prompt cache (issue 39): KV prefixes that outlive their slots, kept in host RAM within --cache-ram.
The cache itself (LRU within the byte budget, chained block keys, partial matches), the backends' export/
import (a restored slot computes what a cold prefill does, on torch and cpu_int4, dense and MoE/MLA GLMs,
slid and truncated afterwards too), and the server: usage's cached_tokens, /metrics, --cache-ram's errors."""
import contextlib
import io

import numpy as np
import pytest

from glmcore.backend import KVBlob, LoadOptions, registry
from glmcore.cli import main
from glmcore.config import ModelConfig
from glmcore.engine.prompt_cache import PromptCache
from glmcore.errors import GlmcoreError
from glmcore.model import load_model
from glmcore.sampling import SamplingParams
from glmcore.scheduler import Request, Scheduler
from glmcore.weights import load_weights
from glmcore_conformance.metrics import compare, out_of_bounds
from glmcore_conformance.tolerances import TOLERANCES, tolerance_key

FAMILIES = ["chatglm3", "glm4-moe", "glm4-moe-lite"]


def blob(n, nbytes):
    return KVBlob(n, (np.zeros(nbytes, np.uint8),))


def ids(start, n):
    return list(range(start, start + n))


# ----------------------------------------------------------------------------- the cache alone


def test_lru_eviction_stays_within_the_byte_budget():
    c = PromptCache(budget=250, block=4)
    a, b, d = ids(0, 8), ids(100, 8), ids(200, 8)
    assert c.put(a, blob(8, 100)) and c.put(b, blob(8, 100))
    assert c.lookup(a + [7, 7], longer_than=0).n == 8        # a is now the most recently used
    assert c.put(d, blob(8, 100))                            # b, the least recently used, makes room
    assert c.nbytes == 200 <= c.budget and c.stats.evicted == 1
    assert c.lookup(b + [1], longer_than=0) is None and c.lookup(a, longer_than=0) is not None
    assert not c.put(ids(300, 8), blob(8, 251))              # larger than the whole budget: not stored
    assert c.stats.refused == 1 and c.nbytes == 200 and len(c) == 2
    assert not c.put(ids(400, 3), blob(3, 10))               # shorter than a block: no key could find it
    # a conversation's next turn supersedes its earlier one (no second copy of the shared prefix)
    assert c.put(a + ids(50, 4), blob(12, 120))
    assert len(c) == 2 and c.nbytes == 220 and c.lookup(a + ids(50, 4), longer_than=0).n == 12


def test_partial_block_match():
    c = PromptCache(budget=1 << 20, block=16)
    held = ids(0, 40)                                        # two full blocks and a half
    c.put(held, blob(40, 64))
    # diverging inside the third block: restored exactly up to the divergence, past the block boundary
    assert c.lookup(held[:35] + [9999] * 10, longer_than=0).n == 35
    # diverging inside the second block: the first block's key finds it, the ids say how far it holds
    assert c.lookup(held[:20] + [9999] * 10, longer_than=0).n == 20
    # less than one shared block: no key matches, a miss
    assert c.lookup(held[:10] + [9999] * 30, longer_than=0) is None
    # a slot that holds as much already wins: the cache counts a miss
    assert c.lookup(held, longer_than=40) is None
    assert (c.stats.hits, c.stats.misses, c.stats.restored_tokens) == (2, 2, 55)
    assert c.block_keys(held)[:1] == c.block_keys(held[:16]) and len(c.block_keys(held)) == 2
    assert c.block_keys([5] + held[1:32])[1] != c.block_keys(held)[1]      # keys are chained: a prefix each


# ----------------------------------------------------------------------------- backends: restore == cold prefill


@pytest.fixture(scope="module")
def int4_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("int4-prompt-cache")


def load(backend, make_tiny, family, cache_dir, slots=2, capacity=128):
    """(backend, batch session) of the tests' tiny checkpoint of family: f32 compute (f32 weights but on
    cpu_int4), threads 1, packed cpu_int4 files under cache_dir."""
    b = registry().get(backend)
    if not b.probe().ready:
        pytest.skip(f"{backend} not ready: {b.probe().reason}")
    d = make_tiny(family)
    cfg = ModelConfig.from_dir(d)
    weights = "int4" if backend == "cpu_int4" else "f32"
    with contextlib.redirect_stderr(io.StringIO()):
        batch = b.load_batch(cfg, load_weights(d, cfg), LoadOptions("f32", weights, capacity, threads=1,
                                                                    cache_dir=cache_dir), slots)
    if batch.has_nextn:       # as the mtp drafter does: its state is kept, and must travel with a restored prefix
        batch.start_nextn()
    return b, batch


def tolerance(family):
    return TOLERANCES[tolerance_key("f32", "f32", experts="moe" in family)]


@pytest.mark.parametrize("backend,family", [(b, f) for b in ("torch", "cpu_int4") for f in FAMILIES]
                         + [("openvino_amx", "chatglm3")])     # openvino_amx runs the dense GLMs only
def test_restored_slot_equals_a_cold_prefill(make_tiny, int4_cache, backend, family):
    b, batch = load(backend, make_tiny, family, int4_cache)
    assert b.capabilities().kv_export
    rng = np.random.default_rng(1)
    vocab = batch.cfg.vocab_size
    prefix, more = [int(t) for t in rng.integers(0, vocab, 37)], [int(t) for t in rng.integers(0, vocab, 9)]
    cold = batch.step([(0, prefix + more)], all_logits=True)[0][len(prefix):]
    batch.reset(0)
    batch.step([(0, prefix)])
    saved = batch.export_prefix(0, len(prefix))
    assert saved.n == len(prefix) and saved.nbytes > 0
    batch.reset(0)
    batch.step([(0, more + more)])                 # slot 0 now holds another conversation
    batch.step([(1, more)])                        # and slot 1 something else, overwritten by the import
    batch.import_prefix(1, saved)
    assert batch.kv_len(1) == len(prefix)
    restored = batch.step([(1, more)], all_logits=True)[0]
    assert not out_of_bounds(compare(cold, restored), tolerance(family).bounds()), compare(cold, restored)
    # greedy decoding from the restored slot and from a cold one: the same tokens
    batch.reset(0)
    batch.step([(0, prefix)])
    batch.import_prefix(1, saved)
    if batch.has_nextn:     # the MoE GLMs: the NextN drafter's state (its cache, ids, hidden states) travels too
        assert batch.draft_nextn(1, more[0], 3) == batch.draft_nextn(0, more[0], 3)
    toks = [[], []]
    for _ in range(6):
        entries = [(s, [toks[s][-1]] if toks[s] else more) for s in (0, 1)]
        out = batch.step(entries)
        for s in (0, 1):
            toks[s].append(int(np.argmax(out[s])))
    assert toks[0] == toks[1]
    batch.close()


@pytest.mark.parametrize("backend", ["torch", "cpu_int4"])
def test_a_restored_slot_slides_and_truncates_as_a_prefilled_one(make_tiny, int4_cache, backend):
    """Slot 0 prefilled, slot 1 restored from it; the same window shift (in place on cpu_int4: its ring
    then wraps, and an export from a wrapped ring is restored too), truncation and new ids give the same
    logits in both."""
    from glmcore.engine.request import Slot, WindowPolicy
    from glmcore.engine.slots import SlotTable
    b, batch = load(backend, make_tiny, "chatglm3", int4_cache, capacity=64)
    table = SlotTable(batch, b.capabilities())
    rng = np.random.default_rng(2)
    prompt = [int(t) for t in rng.integers(0, batch.cfg.vocab_size, 60)]
    s0, s1 = table.slots
    table.feed(s0, prompt, WindowPolicy())
    batch.import_prefix(1, batch.export_prefix(0, 60))
    s1.tokens = list(prompt)

    def same(ids):
        a = table.feed(s0, ids, WindowPolicy("window", n_keep=4, n_discard=30))
        c = table.feed(s1, ids, WindowPolicy("window", n_keep=4, n_discard=30))
        assert s0.tokens == s1.tokens
        np.testing.assert_allclose(a, c, atol=1e-5)   # the same operations on the same cache: the same numbers

    same(prompt[:10])                               # 70 > 64: both slide by 30 first
    table.truncate(s0, 30)
    table.truncate(s1, 30)
    same(prompt[10:50])                             # wraps cpu_int4's ring (its base moved by the shift)
    batch.import_prefix(1, batch.export_prefix(0, batch.kv_len(0)))    # exported from the wrapped ring
    same(prompt[50:55])
    batch.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_scheduler_restores_an_evicted_conversation(make_tiny, int4_cache, family):
    """Three conversations on two slots: the first is saved when its slot goes to the third, and its next
    turn is restored from the cache (cached_tokens counts it) with the tokens a cold run gives."""
    b, batch = load("cpu_int4", make_tiny, family, int4_cache, capacity=256)
    cache = PromptCache(budget=64 << 20)
    s = Scheduler(batch, b.capabilities(), prompt_cache=cache)
    rng = np.random.default_rng(3)
    convs = [[int(t) for t in rng.integers(0, batch.cfg.vocab_size, 50)] for _ in range(3)]

    def run(prompt):
        h = s.submit(Request(prompt, SamplingParams(temperature=0), max_new_tokens=6))
        h.wait()
        return h

    replies = [run(c) for c in convs]
    assert len(cache) == 1 and cache.stats.saved == 1
    turn2 = convs[0] + replies[0].tokens + [7, 8, 9]
    warm = run(turn2)
    assert warm.timings.cached_tokens == 50 + 6 - 1 and cache.stats.hits == 1     # the last reply token was never fed
    s.forget()                                      # slots and cache: a cold prefill
    assert len(cache) == 0 and cache.nbytes == 0
    cold = run(turn2)
    assert cold.timings.cached_tokens == 0 and cold.tokens == warm.tokens
    batch.close()


def test_the_budget_holds_through_the_engine(make_tiny):
    m = load_model(make_tiny("chatglm3"), "torch", LoadOptions(threads=1), slots=1, cache_ram=1)
    s, cache = m.scheduler, m.scheduler.table.cache
    rng = np.random.default_rng(4)
    for _ in range(6):       # 800 ids of the tiny model's KV (2 layers x 2 x 2 heads x 16 f32) are 400 KiB
        s.submit(Request([int(t) for t in rng.integers(0, 1000, 800)], max_new_tokens=2)).wait()
        assert cache.nbytes <= cache.budget == 1 << 20
    assert cache.stats.saved == 5 and cache.stats.evicted == 3 and len(cache) == 2
    assert cache.nbytes == sum(e.blob.nbytes for e in cache.entries.values())
    m.close()


def test_backends_without_export_refuse_a_cache():
    from glmcore.backend import Capabilities
    from glmcore.model import prompt_cache
    assert prompt_cache(None, Capabilities(), "x") is None          # the default: off where it cannot work
    assert prompt_cache(None, Capabilities(kv_export=True), "x").budget == 8192 << 20
    with pytest.raises(GlmcoreError, match=r"cannot export its KV cache.*--cache-ram 0, .*\(cpu_int4, .*torch"):
        prompt_cache(64, Capabilities(), "tpu_bm1684x")


# ----------------------------------------------------------------------------- the server and the CLI


def test_server_reports_restored_tokens_and_metrics(make_tiny):
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from test_server import client, metric, serving
    m = load_model(make_tiny("chatglm3"), "torch", LoadOptions(threads=1), slots=1, cache_ram=16)
    with serving(m) as url:
        c = client(url)
        a = [{"role": "system", "content": "you are a careful assistant " * 8}, {"role": "user", "content": "one"}]
        r1 = c.chat.completions.create(model="tiny", messages=a, max_tokens=6, temperature=0)
        assert metric(url, "glmcore_prompt_cache_bytes") == 0
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "another topic " * 10}],
                                  max_tokens=4, temperature=0)         # takes the only slot: A is saved
        assert metric(url, "glmcore_prompt_cache_bytes") > 0 and metric(url, "glmcore_prompt_cache_hits_total") == 0
        a += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "two"}]
        r3 = c.chat.completions.create(model="tiny", messages=a, max_tokens=4, temperature=0)
        fed = r1.usage.prompt_tokens + r1.usage.completion_tokens - (r1.choices[0].finish_reason == "length")
        assert r3.usage.prompt_tokens_details.cached_tokens == fed
        assert metric(url, "glmcore_prompt_cache_hits_total") == 1
        assert metric(url, "glmcore_prompt_cache_restored_tokens_total") == fed
        assert metric(url, "glmcore_prompt_cache_misses_total") == 2
        assert metric(url, "glmcore_prompt_cache_budget_bytes") == 16 << 20
        assert metric(url, "glmcore_e2e_request_latency_seconds_count") == 3
        assert metric(url, "glmcore_e2e_request_latency_seconds_sum") > 0
        held = r3.usage.prompt_tokens + r3.usage.completion_tokens - (r3.choices[0].finish_reason == "length")
        assert metric(url, "glmcore_kv_cache_positions") == held
        assert metric(url, "glmcore_kv_cache_usage_ratio") == pytest.approx(held / m.scheduler.capacity)
    m.close()


@pytest.mark.parametrize("value,message", [
    ("-5", "error: invalid --cache-ram -5: give MiB of host RAM for the prompt cache (0: off)"),
    ("abc", "glmcore serve: error: argument --cache-ram: invalid int value: 'abc'"),
    ("64", "error: backend 'tpu_bm1684x' cannot export its KV cache, so it has no prompt cache; use --cache-ram 0, "
           "or a backend that has one (cpu_int4, openvino_amx, torch)"),
])
def test_cache_ram_errors_are_one_line(make_tiny, capsys, value, message):
    pytest.importorskip("uvicorn")
    with pytest.raises(SystemExit) if value == "abc" else contextlib.nullcontext():
        rc = main(["serve", "--model", str(make_tiny("chatglm3")), "--backend", "tpu_bm1684x", "--port", "0",
                   "--cache-ram", value])
        assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == message and "Traceback" not in "\n".join(err)


def test_the_session_benchmark_runs_at_smoke_size(capsys):
    """benchmarks/bench_prompt_cache.py at CI's smoke flags: it runs, restores, and the replies agree."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).parent.parent / "benchmarks" / "bench_prompt_cache.py"
    spec = importlib.util.spec_from_file_location("bench_prompt_cache", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--backend", "torch", "--size", "tiny", "--threads", "1"])
    out = capsys.readouterr().out
    assert "replies identical with and without the cache: yes" in out
    assert "cache 12 hits, 4 misses" in out       # 4 conversations x 4 turns: every turn after the first restored
