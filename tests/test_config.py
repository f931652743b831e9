import json

import pytest

from glmcore.config import ModelConfig
from glmcore.errors import ConfigError


@pytest.mark.parametrize("name,family,layers,kv,vocab,rope_base,eps", [
    ("chatglm2-6b", "chatglm2", 28, 2, 65024, 10000.0, 1e-5),
    ("chatglm3-6b", "chatglm3", 28, 2, 65024, 10000.0, 1e-5),
    ("chatglm3-6b-32k", "chatglm3", 28, 2, 65024, 500000.0, 1e-5),
    ("glm-4-9b-chat", "glm4", 40, 2, 151552, 5000000.0, 1.5625e-07),
    ("glm-4-9b-chat-1m", "glm4", 40, 4, 151552, 1e8, 1.5625e-07),
])
def test_real_configs(shared_models, name, family, layers, kv, vocab, rope_base, eps):
    cfg = ModelConfig.from_dir(shared_models / name)
    assert (cfg.family, cfg.num_layers, cfg.num_kv_heads, cfg.vocab_size) == (family, layers, kv, vocab)
    assert cfg.rope_base == rope_base and cfg.norm_eps == eps
    assert (cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.ffn_hidden_size) == (4096, 32, 128, 13696)
    assert cfg.rotary_dim == 64 and cfg.qkv_bias and not cfg.linear_bias


def test_hf_glm_config():
    raw = {"model_type": "glm", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 160, "vocab_size": 1024,
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "attention_bias": True,
           "rope_parameters": {"rope_theta": 5e6, "partial_rotary_factor": 0.5}}
    cfg = ModelConfig.from_dict(raw)
    assert cfg.family == "glm-edge" and cfg.rope_base == 5e6 and cfg.num_kv_heads == 2 and cfg.ffn_hidden_size == 160
    assert cfg.rotary_dim == 8 and not cfg.post_norms


def test_hf_glm_rope_theta_is_trusted():
    # The stored value is what transformers runs; a suspicious glm-4-9b-chat conversion is only warned about
    # (tests/test_glm4_0414.py::test_rope_theta_is_trusted).
    raw = {"model_type": "glm", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
           "intermediate_size": 8, "vocab_size": 64, "max_position_embeddings": 131072, "rope_theta": 10000.0}
    assert ModelConfig.from_dict(raw).rope_base == 10000.0


@pytest.mark.parametrize("raw,match", [
    ({"model_type": "chatglm", "position_encoding_2d": True, "hidden_size": 4096}, "ChatGLM-6B v1"),
    ({"model_type": "chatglm", "inner_hidden_size": 16384, "num_layers": 28}, "ChatGLM-6B v1"),
    ({"model_type": "llama"}, "not a GLM model"),
    ({"model_type": "chatglm", "hidden_size": 64}, "missing key"),
])
def test_bad_configs(raw, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_missing_and_invalid_config(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)


def test_chatglm2_detected_by_tokenizer_config(tmp_path, shared_models):
    raw = json.loads((shared_models / "chatglm3-6b" / "config.json").read_text())
    raw.pop("_name_or_path")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_dir(tmp_path).family == "chatglm3"
    (tmp_path / "tokenizer_config.json").write_text((shared_models / "chatglm2-6b" / "tokenizer_config.json").read_text())
    assert ModelConfig.from_dir(tmp_path).family == "chatglm2"
