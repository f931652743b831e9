"""Batching from the command line: `run --prompts FILE`, `bench --batch`, and a reply cut by a full context."""
import pytest

from glmcore.cli import main

GREEDY = ["--temperature", "0", "--threads", "1"]


def test_prompts_file_runs_as_one_batch_and_equals_each_prompt_alone(tmp_path, capsys):
    prompts = ["你好", "hello there", "what is 1+1?", "写一首诗"]
    f = tmp_path / "p.txt"
    f.write_text("\n".join(prompts[:2]) + "\n\n" + "\n".join(prompts[2:]) + "\n", encoding="utf-8")
    assert main(["run", "--backend", "torch", "--prompts", str(f), "--slots", "3", "--max-new-tokens", "10",
                 *GREEDY]) == 0
    out, err = capsys.readouterr()
    assert "4 prompts on 3 slots" in err and "tok/s aggregate" in err
    answers = out.split("--- [")[1:]
    assert [a.split("\n", 1)[0].split("] ", 1)[1] for a in answers] == prompts
    for prompt, answer in zip(prompts, answers):
        assert main(["run", "--backend", "torch", "--prompt", prompt, "--max-new-tokens", "10", *GREEDY]) == 0
        alone = capsys.readouterr().out
        assert answer.split("\n", 1)[1] == alone


@pytest.mark.parametrize("argv,match", [
    (["run"], "either --prompt TEXT or --prompts FILE"),
    (["run", "--prompt", "x", "--prompts", "f"], "either --prompt TEXT or --prompts FILE"),
    (["run", "--prompts", "/nonexistent/prompts.txt"], "cannot read --prompts"),
    (["run", "--backend", "torch", "--prompts", "EMPTY"], "has no prompt"),
    (["run", "--backend", "torch", "--prompts", "ONE", "--token-budget", "0"], "token budget"),
    (["bench", "--backend", "torch", "--size", "tiny", "--batch", "0,x"], "--batch"),
])
def test_batch_errors_are_one_line(argv, match, tmp_path, capsys):
    (tmp_path / "EMPTY").write_text("\n\n")
    (tmp_path / "ONE").write_text("hi\n")
    argv = [str(tmp_path / a) if a in ("EMPTY", "ONE") else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 2 and match in err[-1] and err[-1].startswith("error:")


def test_a_full_context_ends_the_reply_with_a_notice_not_a_failure(capsys):
    rc = main(["run", "--backend", "torch", "--prompt", "hello", "--ctx", "24", "--max-new-tokens", "100", *GREEDY])
    out, err = capsys.readouterr()
    assert rc == 0 and out.strip(), err
    assert "note: the reply stopped because the context of 24 tokens is full" in err
    assert "generated" in err.splitlines()[-1]          # the timing line still comes


def test_bench_batch_prints_the_table(capsys):
    assert main(["bench", "--backend", "torch", "--size", "tiny", "--batch", "1,4", "--prompt-len", "8", "--gen", "4",
                 "--threads", "1", "--runs", "2"]) == 0
    out, err = capsys.readouterr()
    assert "| batch | prefill ms (whole batch) | prefill tok/s | ms / decode step | aggregate decode tok/s |" in out
    rows = [line for line in out.splitlines() if line.startswith("| 1 |") or line.startswith("| 4 |")]
    assert len(rows) == 2 and "native batched steps" in out and "median of 2 runs after 1 warm-up" in out
    assert "warm-up (1)" in err and "4, run 2/2" in err


def test_batch_bench_reports_medians_of_its_rounds():
    from glmcore.backend import LoadOptions
    from glmcore_conformance.batchbench import batch_bench, format_batch
    from glmcore_conformance.models import synthetic_dir
    d = synthetic_dir("chatglm3", "tiny", purpose="bench", seed=0)
    data = batch_bench("torch", d, LoadOptions(threads=1), [2], 6, 3, runs=3, warmup=0)
    (row,) = data["rows"]
    assert len(row["runs"]) == 3 and data["warmup"] == 0
    for k in ("prefill_ms", "step_ms", "decode_tps"):
        assert row[k] == sorted(r[k] for r in row["runs"])[1]
    assert row["prefill_tps"] == pytest.approx(2 * 6 / (row["prefill_ms"] / 1e3))
    assert f"{row['decode_tps'] / row['prefill_tps']:.2f}x" in format_batch(data)


def test_backends_say_how_each_batches(capsys):
    import json
    assert main(["backends", "--json"]) == 0
    rows = {r["backend"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["torch"]["batching"] == "native batched steps"
    for r in rows.values():
        assert r["batching"].startswith(("native batched steps", "core adapter")) or not r["ready"]


def test_chat_survives_a_full_context(monkeypatch, capsys):
    """Under the default policy a full context ends the reply with a notice; a turn that no longer fits
    is refused with the fix named, and the session goes on (/reset starts over)."""
    lines = iter(["hello", "and more", "/reset", "again", "/quit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--backend", "torch", "--ctx", "24", "--max-new-tokens", "40", *GREEDY]) == 0
    out, err = capsys.readouterr()
    assert out.count("assistant> ") == 3
    assert "note: the reply stopped because the context of 24 tokens is full" in err
    assert "exceed the context of 24" in err and "/reset starts a new conversation" in err


def test_pipeline_keeps_the_partial_reply_when_the_context_fills(make_tiny):
    from glmcore import LoadOptions, Pipeline, SamplingParams
    pipe = Pipeline(make_tiny("glm4"), "torch", LoadOptions(capacity=24, threads=1))
    reply = pipe.chat([{"role": "user", "content": "hi"}], params=SamplingParams(temperature=0), max_new_tokens=50)
    assert pipe.finish_reason == "length" and pipe.context_full
    assert reply.content and pipe.timings.new_tokens >= 24 - pipe.timings.prompt_tokens
