"""The architecture registry (glmcore/arch): an architecture added from this folder alone -- its module and
nothing else -- runs on the torch-based backends through the shared forward, conforms, and is refused by
the backends whose own kernels implement other architectures; no core part knows architectures by name."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

from glmcore import arch
from glmcore.arch import Axis, Split
from glmcore.arch.glm import GLM, GlmArchitecture
from glmcore.backend import LoadOptions, registry
from glmcore.config import ModelConfig
from glmcore.errors import BackendError, ConfigError
from glmcore.weights import load_weights

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


class DenseNeox(GlmArchitecture):
    """Test-only: the dense GLM block (no post norms) with its rotary pairs in NeoX order (i, i + rot/2)
    instead of interleaved -- one changed trait. transformers' Glm4MoeForCausalLM with every layer dense
    (first_k_dense_replace = num_hidden_layers) is exactly this block, so it is the independent check."""
    name = "toy_dense_neox"
    model_types = ("toy_dense_neox",)
    title = "test-only: dense GLM with NeoX-order rotary"
    synthetic_families = ()

    def parse_config(self, raw, source, model_dir):
        cfg = GLM.parse_config({**raw, "model_type": "glm"}, source, model_dir)
        return dataclasses.replace(cfg, arch=self.name, model_type=self.model_types[0], rotary_interleaved=False)


@pytest.fixture(scope="module")
def toy_checkpoint(tmp_path_factory):
    """A dense-only Glm4MoeForCausalLM written by transformers itself, its model_type renamed to the toy's."""
    arch.register(DenseNeox())
    out = tmp_path_factory.mktemp("toy-dense-neox")
    cfg = transformers.Glm4MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, attention_bias=True, partial_rotary_factor=0.5,
        first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Glm4MoeForCausalLM(cfg).eval()
    with torch.no_grad():                       # sharper than the default init, so a rotary bug shows
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2 if "embed" in name else 1.0 / np.sqrt(p.shape[-1]))
    model.save_pretrained(out, safe_serialization=True)
    raw = json.loads((out / "config.json").read_text())
    raw["model_type"] = "toy_dense_neox"
    (out / "config.json").write_text(json.dumps(raw))
    yield out, model
    arch.unregister(DenseNeox.name)


def test_the_toy_config_and_layout_come_from_its_module(toy_checkpoint):
    path, _ = toy_checkpoint
    cfg = ModelConfig.from_dir(path)
    assert (cfg.arch, cfg.rotary_interleaved, cfg.rotary_dim, cfg.post_norms) == ("toy_dense_neox", False, 8, False)
    w = load_weights(path, cfg)           # gate/up_proj and q/k/v_proj fused by the inherited name map
    assert w["layers.1.ffn_up.weight"].shape == (320, 64) and w["layers.0.qkv.bias"].shape == (128,)
    specs = arch.of(cfg).tensors(cfg)
    assert specs["layers.0.qkv.weight"].split is Split.COLUMN and specs["layers.0.qkv.weight"].axis is Axis.QKV
    assert specs["layers.0.ffn_down.weight"].split is Split.ROW and specs["embed.weight"].split is Split.VOCAB


def _logits(backend_name, path, ids, **extra):
    cfg = ModelConfig.from_dir(path)
    backend = registry().get(backend_name)
    opts = backend.resolve(LoadOptions(capacity=64, threads=1, extra=extra))
    with backend.load_batch(cfg, load_weights(path, cfg), opts, 1) as batch:
        return batch.step([(0, ids)], all_logits=True)[0]


@pytest.mark.parametrize("backend,extra", [("torch", {}), ("ascend_npu", {"mode": "eager"})])
def test_the_shared_forward_runs_the_toy_as_transformers_does(toy_checkpoint, backend, extra):
    """torch and ascend_npu's host path run the toy through the one torch forward, matching transformers'
    own model of that block (prefill logits of every position)."""
    if backend not in registry().ready():
        pytest.skip(f"{backend} is not ready here")
    path, model = toy_checkpoint
    ids = list(np.random.default_rng(1).integers(0, 512, 24))
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].float().numpy()
    got = _logits(backend, path, ids, **extra)
    from glmcore_conformance import TOLERANCES      # fp32 both sides: the f32 row holds on any CPU
    assert np.abs(got - want).max() <= TOLERANCES["f32"].max_abs, np.abs(got - want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_the_toy_conforms_on_the_torch_backends(toy_checkpoint):
    from glmcore_conformance import run_suite
    backends = [registry().get(n) for n in ("ascend_npu",) if n in registry().ready()]
    if not backends:
        pytest.skip("ascend_npu's host path is not ready here")
    path, _ = toy_checkpoint
    report = run_suite(backends, model_dir=str(path), precision="f32", weights="f32", extra={"mode": "eager"}, threads=1,
                       cases=["prefill", "decode", "decode_vs_prefill", "window_shift", "batch_mixed"])
    assert report.results and report.passed, [r for r in report.results if not r.passed][:2]


@pytest.mark.parametrize("backend", ["cpu_int4", "openvino_amx", "tpu_bm1684x"])
def test_backends_with_their_own_kernels_refuse_the_toy(toy_checkpoint, backend):
    from glmcore.model import load_model
    path, _ = toy_checkpoint
    cfg = ModelConfig.from_dir(path)
    why = registry().get(backend).supports(cfg)
    assert why and "toy_dense_neox" in why and "glm" in why
    with pytest.raises(BackendError, match=r"cannot run this checkpoint: .*toy_dense_neox.* backends that run "
                                           r"it: .*ascend_npu.*torch") as e:
        load_model(path, backend)
    assert "\n" not in str(e.value)


def test_the_default_backend_is_the_best_ready_one_that_runs_it(toy_checkpoint):
    path, _ = toy_checkpoint
    cfg = ModelConfig.from_dir(path)
    best = registry().best(cfg)
    assert registry().get(best).supports(cfg) is None and best in ("torch", "ascend_npu")


def test_an_unknown_model_type_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match=r"model_type 'llama' is not a GLM model .*'chatglm', 'glm', 'glm4'"):
        ModelConfig.from_dir(tmp_path)


def test_torch_forward_names_match_the_forwards():
    from glmcore_plugins.torch_ref import TORCH_FORWARDS
    from glmcore_plugins.torch_ref.forward import FORWARDS
    assert set(TORCH_FORWARDS) == set(FORWARDS)


def test_no_core_module_outside_arch_branches_on_model_type_or_parses_tensor_names():
    """The layering the registry exists for: model_type and tensor-name parsing live in glmcore/arch only."""
    offenders = []
    for path in list((ROOT / "glmcore").rglob("*.py")) + list((ROOT / "conformance").rglob("*.py")):
        if "arch" in path.relative_to(ROOT).parts:
            continue
        text = path.read_text(encoding="utf-8")
        if re.search(r"model_type\s*(==|in)\s", text) or re.search(r"""rsplit\(["']\.["']""", text) \
                or re.search(r"""fullmatch\(r["']layers""", text):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == [], offenders


def test_no_ready_backend_that_runs_it_is_one_line(toy_checkpoint):
    from glmcore.backend import PluginEntry, Registry
    from glmcore_plugins.cpu_int4 import CpuInt4Backend
    path, _ = toy_checkpoint
    reg = Registry()
    reg.entries["cpu_int4"] = PluginEntry("cpu_int4", backend=CpuInt4Backend())
    if not reg.probe("cpu_int4").ready:
        pytest.skip("cpu_int4 is not ready here (no C compiler)")
    with pytest.raises(BackendError, match=r"no ready backend runs toy_dense_neox checkpoints .*\(ready: cpu_int4\); "
                                           r"no installed backend runs it") as e:
        reg.best(ModelConfig.from_dir(path))
    assert "\n" not in str(e.value)
