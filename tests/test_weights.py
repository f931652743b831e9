import json
import shutil
import struct

import numpy as np
import pytest

from glmcore.config import ModelConfig
from glmcore.errors import CheckpointError, GlmcoreError
from glmcore.arch.glm import REAL_VOCAB, SIZES, chatglm_name
from glmcore.synth import make_model
from glmcore.weights import BF16, canonical_shapes, load_weights, read_safetensors, write_safetensors


def _load(d):
    return load_weights(d, ModelConfig.from_dir(d))


@pytest.mark.parametrize("family", ["chatglm2", "chatglm3", "glm4"])
def test_safetensors_and_bin_layouts_agree(make_tiny, family):
    st, bn = make_tiny(family), make_tiny(family, "bin")
    assert (st / "model.safetensors.index.json").is_file() and (bn / "pytorch_model.bin.index.json").is_file()
    a, b = _load(st), _load(bn)
    assert set(a) == set(b) == set(canonical_shapes(ModelConfig.from_dir(st)))
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


def test_weights_are_memory_mapped_and_keep_dtype(tmp_path):
    make_model("chatglm3", "tiny", tmp_path, dtype="bf16", shards=1)
    w = _load(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert w["layers.0.qkv.weight"].dtype == BF16
    assert isinstance(w["layers.0.qkv.weight"].base, np.memmap) or isinstance(w["layers.0.qkv.weight"], np.memmap)
    assert w.f32("layers.0.qkv.weight").dtype == np.float32


def test_bf16_bin_roundtrip(tmp_path):
    make_model("glm4", "tiny", tmp_path, fmt="bin", dtype="bf16", shards=1)
    w = _load(tmp_path)
    assert w["embed.weight"].dtype == BF16 and np.isfinite(w.f32("embed.weight")).all()


def test_f16_safetensors_header_and_values(tmp_path):
    t = {"a": np.arange(6, dtype=np.float16).reshape(2, 3), "b": np.ones(3, BF16)}
    write_safetensors(tmp_path / "x.safetensors", t)
    r = read_safetensors(tmp_path / "x.safetensors")
    np.testing.assert_array_equal(r["a"], t["a"])
    assert r["b"].dtype == BF16


def test_hf_glm_names_are_mapped(make_tiny, tmp_path):
    src = make_tiny("glm4")
    w = _load(src)
    cfg = ModelConfig.from_dir(src)
    hf = {"model.embed_tokens.weight": w["embed.weight"], "model.norm.weight": w["final_norm.weight"],
          "lm_head.weight": w["lm_head.weight"]}
    for i in range(cfg.num_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            qs, ks, _ = np.split(w[p + f"qkv.{kind}"], [cfg.q_size, cfg.q_size + cfg.kv_size])
            hf[q + f"self_attn.q_proj.{kind}"] = qs
            hf[q + f"self_attn.k_proj.{kind}"] = ks
            hf[q + f"self_attn.v_proj.{kind}"] = w[p + f"qkv.{kind}"][cfg.q_size + cfg.kv_size:]
        hf[q + "self_attn.o_proj.weight"] = w[p + "attn_out.weight"]
        hf[q + "input_layernorm.weight"] = w[p + "input_norm.weight"]
        hf[q + "post_attention_layernorm.weight"] = w[p + "post_attn_norm.weight"]
        hf[q + "mlp.gate_up_proj.weight"] = w[p + "ffn_up.weight"]
        hf[q + "mlp.down_proj.weight"] = w[p + "ffn_down.weight"]
    write_safetensors(tmp_path / "model.safetensors", hf)
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "glm", "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_hidden_size, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": 8192, "rope_parameters": {"rope_theta": cfg.rope_base, "partial_rotary_factor": 0.5}}))
    w2 = _load(tmp_path)
    for name in w:
        np.testing.assert_array_equal(w[name], w2[name])


def test_6b_names_and_shapes_match_the_real_chatglm3_index(shared_models):
    cfg = ModelConfig.from_dir(shared_models / "chatglm3-6b")
    real = json.loads((shared_models / "chatglm3-6b" / "pytorch_model.bin.index.json").read_text())["weight_map"]
    ours = {chatglm_name(n) for n in canonical_shapes(cfg)}
    assert ours == {n for n in real if not n.endswith("inv_freq")}
    six = SIZES["6b"]
    assert (six["num_layers"], six["hidden_size"], six["ffn_hidden_size"], six["num_attention_heads"],
            six["multi_query_group_num"]) == (28, 4096, 13696, 32, 2)
    assert canonical_shapes(cfg)["layers.0.qkv.weight"] == (4608, 4096)


def test_9b_is_the_real_glm4_9b_chat_shape(shared_models, tmp_path):
    """The 9b size (the benchmarks' GLM-4-9B row) has glm-4-9b-chat's published sizes and, in family glm4, its
    vocabulary rows; ChatGLM2/3 have no such model, and asking for one says so."""
    real = json.loads((shared_models / "glm-4-9b-chat" / "config.json").read_text())
    keys = ["num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "multi_query_group_num",
            "kv_channels"]
    assert {k: SIZES["9b"][k] for k in keys} == {k: real[k] for k in keys}
    assert SIZES["9b"]["vocab"] == "real" and REAL_VOCAB["glm4"] == real["padded_vocab_size"]
    with pytest.raises(GlmcoreError, match="9b is GLM-4-9B's shape.*--family glm4"):
        make_model("chatglm3", "9b", tmp_path / "m")
    assert not (tmp_path / "m").exists()


# ------------------------------------------------------------------ error paths

@pytest.fixture
def ckpt(make_tiny, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(make_tiny("chatglm3"), d)
    return d


def test_missing_shard(ckpt):
    next(ckpt.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="missing shard model-00002-of-00002.safetensors"):
        _load(ckpt)


def test_truncated_header(ckpt):
    f = next(ckpt.glob("model-00001-*"))
    f.write_bytes(f.read_bytes()[:5])
    with pytest.raises(CheckpointError, match="truncated"):
        _load(ckpt)


def test_corrupt_header(ckpt):
    f = next(ckpt.glob("model-00001-*"))
    data = bytearray(f.read_bytes())
    data[8:16] = b"\xff" * 8
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt header"):
        _load(ckpt)


def test_huge_header_length(ckpt):
    f = next(ckpt.glob("model-00001-*"))
    data = bytearray(f.read_bytes())
    data[:8] = struct.pack("<Q", 1 << 40)
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt header"):
        _load(ckpt)


def test_truncated_data(ckpt):
    f = next(ckpt.glob("model-00002-*"))
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated or corrupt data"):
        _load(ckpt)


def test_shape_contradicts_config(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["ffn_hidden_size"] += 8
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="has shape .* but config.json implies"):
        _load(ckpt)


def test_fewer_layers_in_config(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_layers"] = 1
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="layer 1 lie past the 1 decoder layers and 0 NextN layer"):
        _load(ckpt)


def test_unknown_tensor_name(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", {"encoder.weird.weight": np.zeros(2, np.float32)})
    cfg = ModelConfig("chatglm3", 64, 2, 4, 2, 16, 160, 1024, 512, 10000.0, 1e-5)
    with pytest.raises(CheckpointError, match="unknown tensor name 'encoder.weird.weight'"):
        load_weights(tmp_path, cfg)


def test_no_weights(tmp_path):
    with pytest.raises(CheckpointError, match="no weights found"):
        load_weights(tmp_path, None)


def test_bin_truncated_and_unsafe_pickle(tmp_path, make_tiny):
    src = make_tiny("chatglm3", "bin")
    f = sorted(src.glob("pytorch_model-*.bin"))[0]
    bad = tmp_path / "pytorch_model.bin"
    bad.write_bytes(f.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="not a PyTorch zip checkpoint"):
        load_weights(tmp_path, None)
    import torch
    torch.save({"x": torch.zeros(2), "evil": print}, bad)
    with pytest.raises(CheckpointError, match="corrupt PyTorch checkpoint .*refusing to load"):
        load_weights(tmp_path, None)
