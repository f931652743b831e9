"""The torch reference against an implementation nobody here wrote: transformers' GlmForCausalLM."""
import numpy as np
import pytest
import torch

from glmcore.backend import LoadOptions, registry
from glmcore.config import ModelConfig
from glmcore.weights import load_weights

transformers = pytest.importorskip("transformers")


def hf_model(cfg: ModelConfig, w) -> "transformers.GlmForCausalLM":
    hf_cfg = transformers.GlmConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps, attention_bias=cfg.qkv_bias, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base, "partial_rotary_factor": 0.5},
        pad_token_id=0, eos_token_id=2, attn_implementation="eager")
    model = transformers.GlmForCausalLM(hf_cfg).eval()
    t = {k: torch.from_numpy(w.f32(k)) for k in w}
    sd = {"model.embed_tokens.weight": t["embed.weight"], "model.norm.weight": t["final_norm.weight"],
          "lm_head.weight": t["lm_head.weight"]}
    for i in range(cfg.num_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            qs, ks, vs = t[p + f"qkv.{kind}"].split([cfg.q_size, cfg.kv_size, cfg.kv_size])
            sd.update({q + f"self_attn.q_proj.{kind}": qs, q + f"self_attn.k_proj.{kind}": ks,
                       q + f"self_attn.v_proj.{kind}": vs})
        sd.update({q + "self_attn.o_proj.weight": t[p + "attn_out.weight"],
                   q + "input_layernorm.weight": t[p + "input_norm.weight"],
                   q + "post_attention_layernorm.weight": t[p + "post_attn_norm.weight"],
                   q + "mlp.gate_up_proj.weight": t[p + "ffn_up.weight"],
                   q + "mlp.down_proj.weight": t[p + "ffn_down.weight"]})
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("family", ["chatglm2", "chatglm3", "glm4"])
def test_reference_matches_transformers(make_tiny, family, fmt):
    d = make_tiny(family, fmt)
    cfg = ModelConfig.from_dir(d)
    w = load_weights(d, cfg)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, 37).tolist()
    steps = rng.integers(0, cfg.vocab_size, 6).tolist()

    sess = registry().get("torch").load(cfg, w, LoadOptions(capacity=128))
    ours = [sess.prefill(prompt, all_logits=True)] + [sess.decode(t)[None] for t in steps]

    model = hf_model(cfg, w)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        theirs, past = [out.logits[0].numpy()], out.past_key_values
        for t in steps:
            out = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            theirs.append(out.logits[0].numpy())
            past = out.past_key_values
    diff = max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs))
    scale = float(np.abs(theirs[0]).max())
    print(f"{family}/{fmt}: max |ours - transformers| = {diff:.3g} (logit scale {scale:.1f})")
    assert diff < 1e-4 * max(1.0, scale)
    assert all((a.argmax(-1) == b.argmax(-1)).all() for a, b in zip(ours, theirs))
