"""GGUF files of the project's synthetic checkpoints, laid out as llama.cpp's convert_hf_to_gguf.py lays them out
(tests must not need a llama.cpp build): tensor names through gguf-py's own TensorNameMap for the architecture,
1-D tensors kept F32 and 2-D ones in the chosen type (as the converter's --outtype), the vocabulary as its
ChatGLMModel / Glm4Model set_vocab write it, and its metadata keys. Written with gguf-py's GGUFWriter."""
from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np

from glmcore.config import ModelConfig
from glmcore.weights import _read_raw


def write_gguf(model_dir: Path, out: Path, qtype: str = "F32", split_tensors: int = 0) -> Path:
    """model_dir (a synthetic chatglm-layout or glm4-0414 checkpoint) -> out (.gguf). split_tensors > 0 writes a
    split set of files holding that many tensors each (llama-gguf-split's layout); returns the first file."""
    cfg = ModelConfig.from_dir(model_dir)
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    arch = {"glm4": gguf.MODEL_ARCH.GLM4, "glm4_moe": gguf.MODEL_ARCH.GLM4_MOE,
            "glm4_moe_lite": gguf.MODEL_ARCH.DEEPSEEK2}.get(cfg.model_type, gguf.MODEL_ARCH.CHATGLM)
    name = gguf.MODEL_ARCH_NAMES[arch]
    # the NextN layers, where this gguf-py names them for the architecture (older ones skip them, as
    # the converter did for deepseek2 before GLM-4.7-Flash)
    mtp = getattr(cfg, "num_mtp_layers", 0) if gguf.get_tensor_name_map(arch, cfg.num_layers + 1).get_name(
        f"model.layers.{cfg.num_layers}.enorm.weight", try_suffixes=(".weight",)) else 0
    blocks = cfg.num_layers + mtp
    w = gguf.GGUFWriter(out, name, split_max_tensors=split_tensors)
    w.add_name(raw.get("_name_or_path", "").split("/")[-1])
    # the recommended sampling, as llama.cpp's converter stores generation_config.json's (gguf-py's Metadata.load)
    gen = Path(model_dir) / "generation_config.json"
    recommended = json.loads(gen.read_text()) if gen.is_file() else {}
    for key, add in (("temperature", w.add_sampling_temp), ("top_p", w.add_sampling_top_p),
                     ("top_k", w.add_sampling_top_k), ("repetition_penalty", w.add_sampling_penalty_repeat)):
        if recommended.get(key) is not None:
            add(recommended[key])
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.ffn_hidden_size)
    w.add_block_count(blocks)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(1 if arch == gguf.MODEL_ARCH.DEEPSEEK2 else cfg.num_kv_heads)   # MLA written as MQA
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_dimension_count(cfg.rotary_dim)
    w.add_rope_freq_base(cfg.rope_base)
    if arch == gguf.MODEL_ARCH.DEEPSEEK2:          # DeepseekV2Model.set_gguf_parameters
        if cfg.q_lora_rank:
            w.add_q_lora_rank(cfg.q_lora_rank)
        w.add_kv_lora_rank(cfg.kv_lora_rank)
        w.add_key_length(cfg.kv_lora_rank + cfg.rotary_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(cfg.head_dim)
        w.add_value_length_mla(cfg.v_head_dim)
    elif arch != gguf.MODEL_ARCH.CHATGLM:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if arch in (gguf.MODEL_ARCH.GLM4_MOE, gguf.MODEL_ARCH.DEEPSEEK2):    # Glm4MoeModel.set_gguf_parameters
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.experts_per_token)
        w.add_expert_feed_forward_length(cfg.moe_ffn_hidden_size)
        w.add_expert_shared_count(cfg.num_shared_experts)
        w.add_leading_dense_block_count(cfg.sparse_layers.index(True))
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(cfg.routed_scaling)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
        w.add_nextn_predict_layers(mtp)
    _vocab(w, model_dir, cfg)
    names = gguf.get_tensor_name_map(arch, blocks)
    tensors = _split_kv_b(_stack_experts(_read_raw(Path(model_dir))[0]), cfg)
    want = gguf.GGMLQuantizationType[qtype]
    for hf_name, t in tensors.items():
        layer = re.match(r"model\.layers\.(\d+)\.", hf_name)
        if hf_name.endswith("inv_freq") or (layer and int(layer.group(1)) >= blocks):
            continue
        hf_name = hf_name.removeprefix("transformer.").replace("e_score_correction_bias", "e_score_correction.bias")
        stored = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert stored is not None, hf_name
        data = np.asarray(t, np.float32)
        kind = _stored_type(stored, data, want)
        if kind == gguf.GGMLQuantizationType.F32:
            w.add_tensor(stored, data)
        else:
            payload = quantize_q4_k(data) if kind == gguf.GGMLQuantizationType.Q4_K else gguf.quants.quantize(data, kind)
            w.add_tensor(stored, payload, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out) if not split_tensors else min(Path(out).parent.glob(f"{Path(out).stem}-00001-of-*.gguf"))


# llama-quantize's Q4_K_M keeps attn_v, ffn_down (of some layers) and the output layer in Q6_K, which gguf-py cannot
# write: here Q8_0 stands in for it; a matrix whose rows are not whole 256-input super-blocks gets llama.cpp's Q5_0.
Q4_K_M_HIGHER = (".attn_v.weight", ".ffn_down.weight")


def _stored_type(stored: str, data: np.ndarray, want):
    """The type a tensor is written in: 1-D tensors and routers F32, matrices `want` (as Q4_K_M mixes it, for Q4_K)."""
    T = gguf.GGMLQuantizationType
    if data.ndim < 2 or "ffn_gate_inp" in stored or data.shape[-1] % 32 or want == T.F32:
        return T.F32
    if want != T.Q4_K:
        return want
    higher = stored == "output.weight" or stored.endswith(Q4_K_M_HIGHER)
    return T.Q8_0 if higher else T.Q5_0 if data.shape[-1] % 256 else T.Q4_K


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float [..., k] (k a multiple of 256) -> Q4_K blocks uint8 [..., k / 256 * 144], llama.cpp's block layout
    (ggml-common.h block_q4_K) with a plain min/max rounding per 32-input sub-block (not llama.cpp's search):
    f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles; w = d * sc_j * q - dmin * m_j."""
    lead, k = x.shape[:-1], x.shape[-1]
    g = np.asarray(x, np.float32).reshape(-1, 8, 32)                          # [super-blocks, sub-block, input]
    lo, hi = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
    scale, mn = (hi - lo) / 15, -lo
    d, dmin = (a.max(-1, keepdims=True) / 63 for a in (scale, mn))
    d, dmin = d.astype(np.float16), dmin.astype(np.float16)

    def six_bits(v, unit):
        unit = unit.astype(np.float32)
        return np.clip(np.rint(np.divide(v, unit, out=np.zeros_like(v), where=unit > 0)), 0, 63).astype(np.uint8)

    sc, m = six_bits(scale, d), six_bits(mn, dmin)
    s_eff, m_eff = (d.astype(np.float32) * sc)[..., None], (dmin.astype(np.float32) * m)[..., None]
    q = np.clip(np.rint(np.divide(g + m_eff, s_eff, out=np.zeros_like(g), where=s_eff > 0)), 0, 15).astype(np.uint8)
    packed = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4], axis=1)       # get_scale_min_k4's packing
    nibbles = q.reshape(-1, 4, 2, 32)                                         # sub-blocks 2i (low) and 2i + 1 (high)
    qs = (nibbles[:, :, 0] | nibbles[:, :, 1] << 4).reshape(-1, 128)
    out = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), packed, qs], axis=1)
    return out.reshape(*lead, k // 256 * 144)


def _stack_experts(tensors: dict) -> dict:
    """Glm4MoeModel.modify_tensors: each layer's experts.E.{gate,up,down}_proj stacked into one [E, out, in]."""
    out, experts = {}, {}
    for name, t in tensors.items():
        m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight", name)
        if m:
            experts.setdefault(f"{m.group(1)}.{m.group(3)}.weight", {})[int(m.group(2))] = t
        else:
            out[name] = t
    for name, by_e in experts.items():
        out[name] = np.stack([by_e[e] for e in range(len(by_e))])
    return out


def _split_kv_b(tensors: dict, cfg) -> dict:
    """DeepseekV2Model.modify_tensors: kv_b_proj per head split into k_b (transposed) and v_b."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("kv_b_proj.weight"):
            kv_b = np.asarray(t, np.float32).reshape(cfg.num_heads, cfg.qk_nope_dim + cfg.v_head_dim, -1)
            out[name.replace("kv_b_proj", "k_b_proj")] = kv_b[:, :cfg.qk_nope_dim].transpose(0, 2, 1)
            out[name.replace("kv_b_proj", "v_b_proj")] = kv_b[:, cfg.qk_nope_dim:]
        else:
            out[name] = t
    return out


def _vocab(w: gguf.GGUFWriter, model_dir: Path, cfg: ModelConfig) -> None:
    from glmcore.tokenizer import SP_SPECIALS, read_rank_file
    from glmcore.vocabulary import GLM4_SPECIALS
    T = gguf.TokenType
    if cfg.family == "glm4":            # GLM-4's tiktoken ranks, as the converter's gpt2 vocabulary
        from glmcore.hf_tokenizer import tokenizer_json
        tj = tokenizer_json(read_rank_file(Path(model_dir) / "tokenizer.model"), GLM4_SPECIALS)
        tokens = sorted(tj["model"]["vocab"], key=tj["model"]["vocab"].get) + GLM4_SPECIALS
        kinds = [T.NORMAL] * len(tj["model"]["vocab"]) + [T.CONTROL] * len(GLM4_SPECIALS)
        merges = [" ".join(m) for m in tj["model"]["merges"]]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("chatglm-bpe")
    elif cfg.family in ("glm4-0414", "glm4-moe", "glm4-moe-lite"):     # tokenizer.json's vocabulary, added tokens and merges
        tj = json.loads((Path(model_dir) / "tokenizer.json").read_text())
        vocab = {**tj["model"]["vocab"], **{a["content"]: a["id"] for a in tj["added_tokens"]}}
        tokens = sorted(vocab, key=vocab.get)
        specials = {a["content"] for a in tj["added_tokens"]}
        kinds = [T.CONTROL if t in specials else T.NORMAL for t in tokens]
        merges = [" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("glm4")
        w.add_chat_template(json.loads((Path(model_dir) / "tokenizer_config.json").read_text())["chat_template"])
    else:                               # ChatGLM2/3's SentencePiece pieces, as set_vocab_chatglm3
        import sentencepiece as spm
        sp = spm.SentencePieceProcessor(model_file=str(Path(model_dir) / "tokenizer.model"))
        specials = SP_SPECIALS[cfg.family]
        tokens, kinds, scores = [], [], []
        for i in range(sp.vocab_size()):
            tokens.append({0: "<unk>", 1: "<bos>", 2: "<eos>"}.get(i, sp.id_to_piece(i)))
            scores.append(sp.get_score(i))
            kinds.append(T.UNKNOWN if sp.is_unknown(i) else T.CONTROL if sp.is_control(i) else
                         T.BYTE if sp.is_byte(i) else T.UNUSED if sp.is_unused(i) else T.NORMAL)
        tokens += specials
        kinds += [T.CONTROL] * len(specials)
        scores += [0.0] * len(specials)
        merges = None
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("chatglm-spm")
    n = len(tokens)
    tokens += [f"[PAD{i}]" for i in range(n, cfg.vocab_size)]       # padded to the embedding rows
    kinds += [T.UNUSED] * (cfg.vocab_size - n)
    w.add_token_list(tokens)
    w.add_token_types(kinds)
    if merges is None:
        w.add_token_scores(scores + [0.0] * (cfg.vocab_size - n))
        w.add_eos_token_id(2)
    else:
        w.add_token_merges(merges)
        w.add_eos_token_id(tokens.index("<|endoftext|>"))
        w.add_eot_token_id(tokens.index("<|user|>"))
        w.add_eom_token_id(tokens.index("<|observation|>"))
        w.add_unk_token_id(tokens.index("<|endoftext|>"))
