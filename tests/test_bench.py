"""`glmcore bench` and benchmarks/run_all, as smoke tests at tiny size: they must run, not be fast."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from glmcore.backend import LoadOptions, registry
from glmcore.cli import main as cli_main
from glmcore.config import ModelConfig
from glmcore_conformance.bench import (WEIGHT_BYTES, BandwidthProbe, bytes_per_token, default_bytes_per_token,
                                       format_bench, measure_bandwidth)

ROOT = Path(__file__).resolve().parents[1]
# --no-llamacpp: these check glmcore's own figures, also where $GLMCORE_LLAMACPP names a build (test_llamacpp.py
# checks the llama.cpp column)
TINY = ["--size", "tiny", "--prompt-len", "8", "--gen", "4", "--runs", "1", "--warmup", "0", "--no-llamacpp",
        "--threads", "1"]
needs_torch = pytest.mark.skipif("torch" not in registry().ready(), reason="the torch backend is not ready")


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    # one cache for the whole module: the synthetic checkpoint is made once (the workers inherit it)
    cache = tmp_path_factory.getbasetemp() / "bench-cache"
    monkeypatch.setenv("GLMCORE_CACHE", str(cache))


def config() -> ModelConfig:
    return ModelConfig(family="chatglm3", hidden_size=4096, num_layers=28, num_heads=32, num_kv_heads=2,
                       head_dim=128, ffn_hidden_size=13696, vocab_size=65024, max_seq_len=8192,
                       rope_base=10000.0, norm_eps=1e-5)


@needs_torch
def test_bench_vs_runs_both_backends_alternately(capsys):
    rc = cli_main(["bench", "--backend", "torch", "--vs", "torch", *TINY])
    out = capsys.readouterr()
    assert rc == 0, out.err
    table = out.out
    assert "TTFT ms" in table and "prefill tok/s" in table and "decode tok/s" in table and "peak RSS MiB" in table
    assert table.count("roofline torch f32/f32") == 2
    assert "torch vs torch: prefill" in table and "memory bandwidth" in table
    # alternating: run 1 of the first backend, then of the second
    runs = [line for line in out.err.splitlines() if "run 1/1" in line]
    assert runs == ["bench: torch run 1/1", "bench: torch run 1/1"]


@needs_torch
def test_bench_json_figures(capsys):
    rc = cli_main(["bench", "--backend", "torch", "--json", *TINY[:-2], "--runs", "2", "--threads", "1"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    (r,) = data["results"]
    assert r["backend"] == "torch" and (r["precision"], r["weights"]) == ("f32", "f32")
    assert len(r["runs"]) == 2 and all(x["new_tokens"] == 4 for x in r["runs"])
    assert r["ttft_ms"] > 0 and r["prefill_tps"] > 0 and r["decode_tps"] > 0
    assert 20 < r["peak_rss_mib"] < 4096
    if sys.platform.startswith("linux"):
        assert r["rss_per_run"]
    cfg = ModelConfig.from_dir(data["model"])
    assert r["bytes_per_token"] == default_bytes_per_token(cfg, LoadOptions("f32", "f32"), data["kv_len"])
    # the bandwidth: probed at startup, before each of the 2 measured rounds and after the last, the median used
    probes = data["bandwidth_probes"]
    assert len(probes) == 4 and data["bandwidth"] == statistics.median(probes)
    assert r["ceiling_tps"] == pytest.approx(data["bandwidth"] / r["bytes_per_token"])
    # reached: each round against the mean of the probes just before and just after it, the median round
    rounds = [x["decode_tps"] * r["bytes_per_token"] / ((probes[i + 1] + probes[i + 2]) / 2)
              for i, x in enumerate(r["runs"])]
    assert r["reached"] == pytest.approx(statistics.median(rounds))
    assert "reached" in format_bench(data)


def test_default_bytes_per_token_follows_the_format():
    cfg = config()
    f32 = default_bytes_per_token(cfg, LoadOptions("f32", "f32"), 0)
    int4 = default_bytes_per_token(cfg, LoadOptions("bf16", "int4"), 0)
    read = cfg.num_params() - (cfg.vocab_size - 1) * cfg.hidden_size      # one embedding row, not the table
    assert f32 == 4 * read
    assert int4 == int(read * WEIGHT_BYTES["int4"])
    # KV: 2 (K and V) x layers x tokens x kv heads x head dim x 2 bytes (bf16)
    kv = default_bytes_per_token(cfg, LoadOptions("bf16", "int4"), 1000) - int4
    assert kv == pytest.approx(2 * 28 * 1000 * 2 * 128 * 2, abs=1)


def test_a_backend_can_state_its_bytes_per_token():
    class Stated:
        name = "stated"

        def bytes_per_token(self, config, options, kv_len):
            return 123 + kv_len

    class Broken:
        name = "broken"

        def bytes_per_token(self, config, options, kv_len):
            raise ValueError("no idea")

    assert bytes_per_token(Stated(), config(), LoadOptions(), 7) == (130, "stated by the backend")
    assert bytes_per_token(Broken(), config(), LoadOptions("f32", "f32"), 7)[1] == "estimated from the weight format"


def test_measure_bandwidth_is_plausible():
    bw = measure_bandwidth(threads=1, seconds=0.2)
    assert 5e8 < bw < 2e12     # between 0.5 GB/s and 2 TB/s


def test_bandwidth_probe_keeps_its_buffer_between_rounds():
    # a gigabyte freed between rounds slows the next round (the kernel's free-page work): allocate once
    probe = BandwidthProbe(threads=1)
    buf = probe.buf
    first, second = probe.measure(0.05), probe.measure(0.05)
    assert probe.buf is buf and all(5e8 < bw < 2e12 for bw in (first, second))
    probe.close()
    assert probe.buf is None


@needs_torch
def test_bench_counts_drafted_and_accepted_tokens(capsys):
    """--speculative mtp on the demo model (its trained NextN layer): each run reports what it drafted and the
    target accepted, and still makes exactly --gen tokens."""
    demo = ROOT / "glmcore" / "data" / "demo-chatglm3-poet"
    rc = cli_main(["bench", "--backend", "torch", "--model", str(demo), "--prompt-len", "16", "--gen", "24",
                   "--runs", "1", "--warmup", "0", "--threads", "1", "--speculative", "mtp", "--draft-tokens", "2",
                   "--json", "--no-llamacpp"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    data = json.loads(out.out)
    (r,) = data["results"]
    assert data["speculation"] == {"method": "mtp", "draft_tokens": 2}
    assert r["runs"][0]["new_tokens"] == 24
    assert 0 < r["drafted"] <= 2 * 24 and 0 <= r["accepted"] <= r["drafted"]
    assert f"drafted {r['drafted']}, accepted {r['accepted']}" in format_bench(data)


@pytest.mark.parametrize("args, message", [
    (["--backend", "torch", "--size", "tiny", "--batch", "1,2", "--speculative", "ngram"], "drop --batch"),
    (["--backend", "nope", "--size", "tiny"], "unknown backend 'nope'"),
    (["--backend", "torch", "--size", "tiny", "--gen", "1"], "--gen >= 2"),
    (["--backend", "torch", "--model", "/nonexistent"], "not a checkpoint directory"),
    (["--backend", "torch", "--size", "tiny", "--precision", "int3"], "has no precision 'int3'"),
    (["--backend", "torch", "--size", "tiny", "--threads", "0"], "invalid --threads"),
])
@needs_torch
def test_bench_usage_errors_exit_2(capsys, args, message):
    assert cli_main(["bench", *args]) == 2
    assert message in capsys.readouterr().err


def test_run_all_smoke():
    """Every ready backend at tiny size, default formats: one Markdown table on stdout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_all"), *TINY, "--formats", "default"],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("Benchmark: synthetic chatglm3 tiny") and "memory bandwidth" in lines[1]
    assert "| model | backend | precision/weights | TTFT ms | prefill tok/s | decode tok/s | peak RSS MiB |" in proc.stdout
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| model")]
    assert {r.split(" | ")[1] for r in rows} == set(registry().ready())
    assert not any("error" in r for r in rows), proc.stdout
