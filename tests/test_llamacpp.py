"""The optional llama.cpp comparison (conformance/llamacpp.py): found only where $GLMCORE_LLAMACPP names a build,
llama-bench's figures and peak RSS read right, one llama.cpp run per timed round beside the backends in
`glmcore bench`, and the column it adds. llama.cpp itself is never needed: a stand-in llama-bench is used,
and the real converter runs only where a llama.cpp tree is given."""
from __future__ import annotations

import os
import stat
import sys
import time
from pathlib import Path

import pytest

from glmcore.backend import LoadOptions
from glmcore.errors import GlmcoreError
from glmcore_conformance import bench as bench_module, llamacpp
from glmcore_conformance.bench import bench, format_bench

FAKE_BENCH = """#!{python}
import json, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
hold = bytearray(64 << 20)          # 64 MiB touched: the peak RSS the caller must see
for i in range(0, len(hold), 4096):
    hold[i] = 1
depth = int(args.get("-d", 0))     # llama-bench skips a test of 0 tokens; -d slows both
rows = [{{"n_prompt": int(args["-p"]), "n_gen": 0, "n_depth": depth, "avg_ts": 100.0 + int(args["-t"]) - depth}},
        {{"n_prompt": 0, "n_gen": int(args["-n"]), "n_depth": depth, "avg_ts": 20.0 - depth}}]
rows = [r for r in rows if r["n_prompt"] or r["n_gen"]]
print(json.dumps(rows))
"""


def _fake_tree(root: Path) -> Path:
    (root / "build" / "bin").mkdir(parents=True)
    (root / "convert_hf_to_gguf.py").write_text("")
    for name in llamacpp.TARGETS:
        tool = root / "build" / "bin" / name
        tool.write_text(FAKE_BENCH.format(python=sys.executable))
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return root


def test_found_only_where_named(tmp_path, monkeypatch):
    monkeypatch.delenv(llamacpp.ENV, raising=False)
    assert llamacpp.find() is None
    monkeypatch.setenv(llamacpp.ENV, str(tmp_path))
    with pytest.raises(GlmcoreError, match="GLMCORE_LLAMACPP.*not a built llama.cpp tree"):
        llamacpp.find()
    monkeypatch.setenv(llamacpp.ENV, str(_fake_tree(tmp_path / "lc")))
    assert llamacpp.find().root == tmp_path / "lc"


@pytest.mark.skipif(not hasattr(os, "wait4"), reason="the child's peak RSS comes from os.wait4 (POSIX)")
def test_llama_bench_figures_and_peak_rss(tmp_path):
    lc = llamacpp.LlamaCpp(_fake_tree(tmp_path))
    r = lc.bench(tmp_path / "m.gguf", 128, 64, threads=2)
    assert r["prefill_tps"] == 102.0 and r["decode_tps"] == 20.0
    assert 64 <= r["peak_rss_mib"] < 1024
    # decode after 5 tokens of context: a second llama-bench run with -d; the prefill still from an empty context
    r = lc.bench(tmp_path / "m.gguf", 128, 64, threads=2, depth=5)
    assert r["prefill_tps"] == 102.0 and r["decode_tps"] == 15.0
    assert 64 <= r["peak_rss_mib"] < 1024


class StubLlamaCpp:
    def __init__(self, root: Path):
        self.root, self.calls = root, []

    def gguf(self, model_dir, weights, progress):
        if weights not in llamacpp.GGUF_TYPES:
            raise GlmcoreError(f"no counterpart of {weights}")
        return self.root / llamacpp.GGUF_TYPES[weights] / "model.gguf"

    def bench(self, path, prompt_len, gen, threads, depth=0):
        assert depth == prompt_len          # llama.cpp decodes after the prompt's context, as the backends do
        self.calls.append((path.parent.name, prompt_len, gen, threads))
        return {"prefill_tps": 50.0, "decode_tps": 10.0 + len(self.calls), "peak_rss_mib": 99.0}


def test_bench_runs_llamacpp_in_the_timed_rounds_and_adds_the_column(tmp_path, monkeypatch):
    from glmcore_conformance.models import synthetic_dir
    monkeypatch.setenv("GLMCORE_CACHE", str(tmp_path / "cache"))
    model = synthetic_dir("chatglm3", "tiny", purpose="test", seed=0)
    stub = StubLlamaCpp(tmp_path)
    slept, sleep = [], time.sleep
    monkeypatch.setattr(bench_module, "SETTLE_S", 0.001)
    monkeypatch.setattr(bench_module.time, "sleep", lambda s: (slept.append(s), sleep(s)))
    data = bench([("torch", LoadOptions())], model, prompt_len=8, gen=4, runs=3, warmup=1, threads=1,
                 bandwidth=1e10, llamacpp=stub)
    assert stub.calls == [("F32", 8, 4, 1)] * 3          # the timed rounds only, same prompt, gen and threads
    assert slept.count(0.001) == 3                       # the machine settles after each llama.cpp run
    ref = data["llamacpp"]["f32"]
    assert ref["type"] == "F32" and ref["decode_tps"] == 12.0 and len(ref["runs"]) == 3   # the median
    text = format_bench(data)
    ours = data["results"][0]["decode_tps"]
    assert "decode vs llama.cpp" in text and f"{ours / 12.0:.2f}x F32" in text
    assert "llama.cpp F32 (same checkpoint" in text and "decode 12.0 tok/s" in text
    assert "llama.cpp" not in format_bench({**data, "llamacpp": {}})


def _converted(tmp_path, family: str):
    """A tiny synthetic checkpoint of `family` through the real converter: (llama.cpp, model dir, GGUF path, the
    GGUF's string fields by key)."""
    pytest.importorskip("torch")          # convert_hf_to_gguf.py imports it
    from glmcore_conformance.models import synthetic_dir
    lc = llamacpp.find()
    model = synthetic_dir(family, "tiny", purpose="test", seed=0)
    out = tmp_path / "m.gguf"
    lc._convert(model, out, lambda m: None)
    sys.path.insert(0, str(lc.root / "gguf-py"))
    import gguf
    reader = gguf.GGUFReader(out)
    return lc, model, out, lambda key: [bytes(reader.fields[key].parts[i]).decode() for i in reader.fields[key].data]


@pytest.mark.skipif(not os.environ.get(llamacpp.ENV), reason="no llama.cpp tree named by $GLMCORE_LLAMACPP")
def test_converter_gives_our_glm4_vocabulary(tmp_path):
    """GLM-4's byte-level BPE as llama.cpp's gpt2 vocabulary: every rank's bytes, a merge per multi-byte token,
    the 14 special tokens after the ranks; and llama.cpp loads and runs the file."""
    from glmcore.config import ModelConfig
    from glmcore.tokenizer import load_tokenizer, read_rank_file
    lc, model, out, strings = _converted(tmp_path, "glm4")
    tokens = strings("tokenizer.ggml.tokens")
    cfg = ModelConfig.from_dir(model)
    tok = load_tokenizer(model, cfg.family)
    ranks = read_rank_file(model / "tokenizer.model")
    assert len(tokens) == cfg.vocab_size and strings("tokenizer.ggml.model") == ["gpt2"]
    assert len(strings("tokenizer.ggml.merges")) == sum(len(t) > 1 for t in ranks)
    for name, i in tok.special_ids.items():
        assert tokens[i] == name
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    byte_decoder = {v: k for k, v in bytes_to_unicode().items()}
    for token, rank in list(ranks.items())[:: max(1, len(ranks) // 200)]:
        assert bytes(byte_decoder[c] for c in tokens[rank]) == token
    assert lc.bench(out, 8, 4, 1)["decode_tps"] > 0


@pytest.mark.skipif(not os.environ.get(llamacpp.ENV), reason="no llama.cpp tree named by $GLMCORE_LLAMACPP")
def test_converter_gives_our_sentencepiece_vocabulary(tmp_path):
    from glmcore.config import ModelConfig
    from glmcore.tokenizer import SP_SPECIALS, load_tokenizer
    lc, model, out, strings = _converted(tmp_path, "chatglm3")
    tokens = strings("tokenizer.ggml.tokens")
    cfg = ModelConfig.from_dir(model)
    tok = load_tokenizer(model, cfg.family)
    assert len(tokens) == cfg.vocab_size
    for name in SP_SPECIALS["chatglm3"]:
        assert tokens[tok.special_ids[name]] == name
    assert strings("general.architecture") == ["chatglm"]


@pytest.mark.skipif(not os.environ.get(llamacpp.ENV), reason="no llama.cpp tree named by $GLMCORE_LLAMACPP")
@pytest.mark.parametrize("family,arch", [("glm4-moe", "glm4moe"), ("glm4-moe-lite", "deepseek2")])
def test_converter_reads_the_moe_checkpoints(tmp_path, family, arch):
    """The MoE GLMs through llama.cpp's own converter (their tokenizer.json as it reads it): glm4moe, and deepseek2
    for latent attention; the NextN layer left out; and llama.cpp runs the file."""
    from glmcore.config import ModelConfig
    from glmcore.tokenizer import load_tokenizer
    import gguf
    lc, model, out, strings = _converted(tmp_path, family)
    cfg = ModelConfig.from_dir(model)
    assert strings("general.architecture") == [arch]
    assert not any(t.name.startswith(f"blk.{cfg.num_layers}.") for t in gguf.GGUFReader(out).tensors)
    tokens = strings("tokenizer.ggml.tokens")
    tok = load_tokenizer(model, cfg.family)
    assert all(tokens[i] == name for name, i in tok.special_ids.items())
    assert lc.bench(out, 8, 4, 1)["decode_tps"] > 0


def _run_all():
    """benchmarks/run_all as a module (it is a script without a .py suffix)."""
    import importlib.machinery
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "run_all"
    loader = importlib.machinery.SourceFileLoader("glmcore_run_all", str(path))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def test_run_all_puts_llamacpp_beside_each_row_of_every_size(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GLMCORE_CACHE", str(tmp_path / "cache"))
    run_all = _run_all()
    stub = StubLlamaCpp(tmp_path)
    stub.version = lambda: "stub-1"
    monkeypatch.setattr(run_all, "find_llamacpp", lambda: stub)
    monkeypatch.setattr(bench_module, "SETTLE_S", 0.0)
    assert run_all.main(["--size", "tiny,tiny", "--prompt-len", "8", "--gen", "4", "--runs", "2", "--warmup", "0",
                         "--threads", "1", "--backends", "torch", "--formats", "default"]) == 0
    out = capsys.readouterr().out
    assert "llama.cpp stub-1 beside each row" in out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| chatglm3-tiny")]
    assert len(rows) == 2 and len(stub.calls) == 4          # each row's timed rounds ran llama.cpp beside it
    assert [(r[1], r[9]) for r in rows] == [("torch", "50.0 / 11.5 (F32)"), ("torch", "50.0 / 13.5 (F32)")]
    for r in rows:
        ratio = float(r[10].rstrip(" |x"))              # decode tok/s over llama.cpp's, from the printed figures
        assert ratio == pytest.approx(float(r[5]) / float(r[9].split(" / ")[1].split()[0]), rel=0.01, abs=0.01)
    assert run_all.main(["--size", "tiny", "--no-llamacpp", "--prompt-len", "8", "--gen", "4", "--runs", "1",
                         "--warmup", "0", "--threads", "1", "--backends", "torch", "--formats", "default"]) == 0
    assert "no llama.cpp" in capsys.readouterr().out and len(stub.calls) == 4
    with pytest.raises(SystemExit):
        run_all.main(["--size", "tiny,7b"])
    assert "give sizes from" in capsys.readouterr().err


def test_quantized_gguf_is_made_through_a_scratch_f16(tmp_path, monkeypatch):
    """Q4_0/Q8_0 are made from an f16 GGUF that is deleted afterwards (19 GB at the 9B shape), or from the
    cached F16 one where an F16 comparison made it; each once."""
    from glmcore_conformance.models import synthetic_dir
    monkeypatch.setenv("GLMCORE_CACHE", str(tmp_path / "cache"))
    model = synthetic_dir("chatglm3", "tiny", purpose="test", seed=0)
    lc = llamacpp.LlamaCpp(tmp_path / "lc")
    made = []
    monkeypatch.setattr(lc, "_convert", lambda m, out, progress: (made.append(("f16", out.name)), out.write_text("f16")))
    monkeypatch.setattr(lc, "_quantize", lambda src, out, q, progress: (made.append((q, src.read_text())),
                                                                        out.write_text(q)))
    q4 = lc.gguf(model, "int4")
    assert q4.read_text() == "Q4_0" and made == [("f16", "f16.gguf"), ("Q4_0", "f16")]
    assert not list(q4.parent.glob("f16*")) and lc.gguf(model, "int4") == q4 and len(made) == 2
    f16 = lc.gguf(model, "f16")
    assert f16.read_text() == "f16" and len(made) == 3
    lc.gguf(model, "int8")
    assert made[3:] == [("Q8_0", "f16")]                     # the cached F16 GGUF, not a fresh conversion
    with pytest.raises(GlmcoreError, match="no counterpart"):
        lc.gguf(model, "int3")
    with pytest.raises(GlmcoreError, match="llama.cpp comparison: only .*glm4-moe.*, not glm4-0414"):
        lc.gguf(synthetic_dir("glm4-0414", "tiny", purpose="test", seed=0), "int4")


def test_a_checkpoint_without_weight_files_is_refused(tmp_path):
    """make-model --generated-weights writes no weight files: llama.cpp's converter would write a GGUF without
    tensors (and the cache would keep it); refused in one line instead."""
    from glmcore.synth import make_model
    make_model("glm4-moe-lite", "tiny", tmp_path / "gen", generated=True)
    lc = llamacpp.LlamaCpp(_fake_tree(tmp_path / "lc"))
    with pytest.raises(GlmcoreError, match="has no weight files .*make it without --generated-weights"):
        lc.gguf(tmp_path / "gen", "int4")
