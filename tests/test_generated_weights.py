"""Synthetic checkpoints whose weights are generated when read (`make-model --generated-weights`): the same
tensors make-model would have stored, streamed into a backend's converted form (how GLM-4.7-Flash at its full 47
layers is converted on a disk that cannot hold its bf16 weights)."""
import json

import numpy as np
import pytest

from glmcore import arch
from glmcore.cli import main
from glmcore.errors import GlmcoreError
from glmcore.model import open_checkpoint
from glmcore.generated import GeneratedWeights
from glmcore.synth import make_model


@pytest.mark.parametrize("family", arch.synthetic_families())
def test_generated_weights_equal_the_stored_ones(tmp_path, family):
    make_model(family, "tiny", tmp_path / "stored", seed=3)
    make_model(family, "tiny", tmp_path / "gen", seed=3, generated=True)
    assert not list((tmp_path / "gen").glob("*.safetensors*"))
    stored, gen = open_checkpoint(tmp_path / "stored").weights(), open_checkpoint(tmp_path / "gen").weights()
    assert isinstance(gen, GeneratedWeights) and set(gen) == set(stored)
    for name in stored:
        a, b = np.asarray(stored[name]), gen[name]
        assert a.dtype == b.dtype and np.array_equal(a, b), name


def test_bf16_and_the_seed_are_kept(tmp_path):
    make_model("glm4-moe", "tiny", tmp_path / "a", seed=1, dtype="bf16", generated=True)
    make_model("glm4-moe", "tiny", tmp_path / "b", seed=2, dtype="bf16", generated=True)
    a, b = open_checkpoint(tmp_path / "a").weights(), open_checkpoint(tmp_path / "b").weights()
    assert a["embed.weight"].dtype == a.dtype == np.dtype("bfloat16")
    assert not np.array_equal(a["embed.weight"], b["embed.weight"])
    assert a.fingerprint() != b.fingerprint()
    assert a.fingerprint() == open_checkpoint(tmp_path / "a").weights().fingerprint()


def test_a_generated_checkpoint_converts_and_runs_on_cpu_int4(tmp_path, capsys):
    make_model("glm4-moe-lite", "tiny", tmp_path / "gen", generated=True)
    make_model("glm4-moe-lite", "tiny", tmp_path / "stored")
    run = ["--backend", "cpu_int4", "--prompt", "hello", "--max-new-tokens", "6", "--temperature", "0"]
    assert main(["convert", "--model", str(tmp_path / "gen"), "--backend", "cpu_int4",
                 "--out", str(tmp_path / "packed")]) == 0
    capsys.readouterr()
    assert main(["run", "--model", str(tmp_path / "gen"), "--opt", f"packed={tmp_path / 'packed'}", *run]) == 0
    from_packed = capsys.readouterr().out
    assert main(["run", "--model", str(tmp_path / "stored"), *run]) == 0
    assert capsys.readouterr().out == from_packed        # the same weights, packed the same way
    # the packed model is tied to the generated checkpoint it came from
    make_model("glm4-moe-lite", "tiny", tmp_path / "other", seed=5, generated=True)
    assert main(["run", "--model", str(tmp_path / "other"), "--opt", f"packed={tmp_path / 'packed'}", *run]) == 2
    assert "converted from a different model" in capsys.readouterr().err


@pytest.mark.parametrize("mark", [{"weights": "generated", "seed": -1, "dtype": "bf16"},
                                  {"weights": "generated", "seed": 0, "dtype": "f64"},
                                  {"weights": "generated", "seed": True, "dtype": "f32"}])
def test_a_broken_generation_mark_is_one_line(tmp_path, mark):
    make_model("glm4", "tiny", tmp_path / "m", generated=True)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["glmcore_synthetic"].update(mark)
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(GlmcoreError, match="glmcore_synthetic needs an integer seed"):
        open_checkpoint(tmp_path / "m").weights()


@pytest.mark.parametrize("extra", [["--shards", "2"], ["--format", "bin"]])
def test_cli_refuses_file_options_with_generated_weights(tmp_path, capsys, extra):
    assert main(["make-model", "--family", "glm4", "--size", "tiny", "--generated-weights", *extra,
                 "--out", str(tmp_path / "m")]) == 2
    assert not (tmp_path / "m").exists()
    assert "--generated-weights writes no weight files" in capsys.readouterr().err


def test_a_config_too_large_to_generate_is_one_line(tmp_path):
    """Sizes the config reader admits can still ask for more values than anything real (4 M rows x 1024)."""
    make_model("glm4", "tiny", tmp_path / "m", generated=True)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg.update(padded_vocab_size=1 << 22, hidden_size=1024)
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    weights = open_checkpoint(tmp_path / "m").weights()
    with pytest.raises(GlmcoreError, match="too large to generate"):
        weights["embed.weight"]
