"""--model FILE.gguf (issue 40): GGUFs in llama.cpp's layout of the synthetic checkpoints run as their safetensors
source does; quantized tensors dequantize exactly as gguf-py's own dequantizer; hostile files are refused in one
line. Files are written by gguf-py's GGUFWriter (tests/gguf_kit.py), never by a llama.cpp build."""
from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from glmcore.config import ModelConfig
from glmcore.errors import CheckpointError
from glmcore.gguf import open_gguf
from glmcore.pipeline import Pipeline
from glmcore.sampling import SamplingParams
from glmcore.weights import load_weights
from gguf_kit import write_gguf

FAMILIES = ["glm4", "glm4-0414", "chatglm3", "glm4-moe", "glm4-moe-lite"]
# 50 texts for tokenizer checks (here against the checkpoint's own tokenizer; in test_gguf_llamacpp.py
# against llama-tokenize)
STRINGS = ["Hello world", " leading space", "trailing space ", "  two  spaces", "\n\nnewlines\n", "\ttabs\tand more",
           "你好，世界", "写一首关于春天的诗", "日本語のテキスト", "한국어 텍스트", "Ünïcödé àccents", "emoji 🙂🚀",
           "numbers 1234567890", "3.14159 and 2,718", "x=y+z*2", "def f(a):\n    return a", "{\"json\": [1, 2]}",
           "<|user|> stays text", "[gMASK]<sop> too", "it's they're we've I'm you'll he'd", "IT'S LOUD",
           "a" * 50, "ab" * 30, "混合 mixed 文本 text", "URL https://example.com/a?b=c", "email@example.com",
           "tabs\t\tdouble", "\r\nwindows line", "¿Qué tal?", "Привет, мир", "مرحبا بالعالم", "שלום עולם",
           "नमस्ते दुनिया", "Γειά σου Κόσμε", "snake_case_name", "CamelCaseName", "kebab-case-name", "100%",
           "$5.00 & €3,50", "a\u200bzero width", "   ", "!!!???...", "— em dash – en dash", "«quotes» “curly”",
           "line1\nline2\nline3", "1+1=2", "tokenizer test 🙂 你好 123", "end.", "x", "GLM-4.5 and GLM-4.7-Flash"]
TEXTS = STRINGS[:6] + [""]
# Conversations for the chat template checks (here against transformers' apply_chat_template, in
# test_gguf_llamacpp.py against llama-server's /apply-template): (messages, tools, chat_template_kwargs), tools
# and tool calls in OpenAI's form (the arguments a JSON string).
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "天气 of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                          "required": ["city"]}}}
_CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "北京", "days": 2}'}}]}
CONVERSATIONS = [
    ([{"role": "user", "content": "你好"}], None, {}),
    ([{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Hello world"}], None, {}),
    ([{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
      {"role": "user", "content": "写一首关于春天的诗"}], None, {}),
    ([{"role": "system", "content": "be kind"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
      {"role": "user", "content": "c\nd"}, {"role": "assistant", "content": "e"}, {"role": "user", "content": "f"}],
     None, {}),
    ([{"role": "user", "content": "hi"}], None, {"enable_thinking": False}),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "reasoning_content": "think x"},
      {"role": "user", "content": "z"}], None, {"enable_thinking": False}),
    ([{"role": "user", "content": "Weather in 北京?"}], [WEATHER], {}),
    ([{"role": "user", "content": "Weather in 北京?"}, _CALL,
      {"role": "tool", "tool_call_id": "call_0", "content": "晴 25°C"}], [WEATHER], {}),
    ([{"role": "system", "content": "use tools"}, {"role": "user", "content": "Two cities"},
      {"role": "assistant", "content": "Checking both.", "tool_calls": [
          {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
          {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
      {"role": "tool", "tool_call_id": "a", "content": "rain"}, {"role": "tool", "tool_call_id": "b", "content": "sun"},
      {"role": "assistant", "content": "Paris rain, Rome sun."}, {"role": "user", "content": "thanks"}],
     [WEATHER], {"enable_thinking": False}),
    ([{"role": "user", "content": "Weather?"}, _CALL, {"role": "tool", "tool_call_id": "call_0", "content": "{\"t\": 3}"}],
     [WEATHER], {"enable_thinking": True}),
    # the template reads these spellings of special tokens in the client's text: an earlier reply's inline
    # thinking is split off, and a user's own /nothink is not written twice
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>old</think>answer"},
      {"role": "user", "content": "r"}], None, {}),
    ([{"role": "user", "content": "q /nothink"}], None, {"enable_thinking": False}),
    # the thinking of a call made after the last user message is kept
    ([{"role": "user", "content": "w?"}, {**_CALL, "reasoning_content": "I should call it."},
      {"role": "tool", "tool_call_id": "call_0", "content": "snow"}], [WEATHER], {}),
    # OpenAI's content parts, which GLM-4.5's template joins itself
    ([{"role": "user", "content": [{"type": "text", "text": "part one "}, {"type": "text", "text": "two"}]}], None, {}),
]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GLMCORE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def files(make_tiny, tmp_path_factory):
    """family -> (checkpoint dir, {type: gguf path})."""
    out = {}
    for family in FAMILIES:
        d = make_tiny(family)
        tmp = tmp_path_factory.mktemp(f"gguf-{family}")
        out[family] = d, {q: write_gguf(d, tmp / f"{q}.gguf", q) for q in ("F32", "Q8_0", "Q4_0")}
    return out


def _greedy(model, prompt="你好 hello") -> tuple[list[int], str]:
    p = Pipeline(model, backend="torch")
    try:
        ids = [p.tokenizer.encode(t) for t in TEXTS]
        reply = p.chat([{"role": "user", "content": prompt}], params=SamplingParams(temperature=0), max_new_tokens=10)
        rendered = p.model.chat_format.encode_messages([_msg("system", "be brief"), _msg("user", prompt)])
        return ids, reply.content, rendered
    finally:
        p.model.close()


def _msg(role, content):
    from glmcore.chat import as_message
    return as_message({"role": role, "content": content})


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_is_the_checkpoint(files, family):
    """Config, every canonical tensor (bit for bit), tokenizer ids, the rendered chat and greedy text."""
    d, ggufs = files[family]
    cfg = ModelConfig.from_dir(d)
    c = open_gguf(ggufs["F32"])
    w = load_weights(d, cfg)
    if family == "glm4-moe-lite" and not any(n.startswith("mtp.") for n in c.weights):
        # gguf-py releases before GLM-4.7-Flash name no NextN tensors for deepseek2 (its converter skipped them)
        cfg = dataclasses.replace(cfg, num_mtp_layers=0)
        w = {n: t for n, t in w.items() if not n.startswith("mtp.")}
    assert dataclasses.replace(c.config, name=cfg.name) == cfg
    assert sorted(c.weights) == sorted(w)
    for name in w:
        assert np.array_equal(c.weights[name], np.asarray(w[name], np.float32)), name
    assert _greedy(ggufs["F32"]) == _greedy(d)


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_from_the_metadata_encodes_as_the_checkpoints(files, family):
    """The tokenizer rebuilt from tokenizer.ggml.* gives the checkpoint's own tokenizer's ids and text."""
    from glmcore.tokenizer import load_tokenizer
    d, ggufs = files[family]
    c = open_gguf(ggufs["Q8_0"])
    ours, theirs = load_tokenizer(c.tokenizer_dir, c.config.family), load_tokenizer(d, c.config.family)
    assert (ours.n_vocab, ours.eos_id, ours.special_ids) == (theirs.n_vocab, theirs.eos_id, theirs.special_ids)
    for text in STRINGS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantized_gguf_runs_and_dequantizes_as_gguf_py(files, qtype):
    d, ggufs = files["glm4-0414"]
    c = open_gguf(ggufs[qtype])
    reader = gguf.GGUFReader(ggufs[qtype])
    raw = {t.name: t for t in reader.tensors}
    # split q/k/v stored tensors are the rows of the canonical fused qkv, each as gguf-py dequantizes it
    parts = [gguf.quants.dequantize(raw[f"blk.1.attn_{x}.weight"].data, raw[f"blk.1.attn_{x}.weight"].tensor_type)
             for x in "qkv"]
    assert np.array_equal(c.weights["layers.1.qkv.weight"], np.concatenate(parts))
    assert c.weights.stored("layers.1.ffn_down.weight").qtype == qtype
    src = load_weights(d, ModelConfig.from_dir(d))
    w, q = np.asarray(src["layers.1.ffn_down.weight"], np.float32), c.weights["layers.1.ffn_down.weight"]
    step = np.abs(w.reshape(w.shape[0], -1, 32)).max(-1, keepdims=True) / (127 if qtype == "Q8_0" else 8)
    assert np.all(np.abs(q.reshape(step.shape[0], -1, 32) - w.reshape(step.shape[0], -1, 32)) <= step * 1.01)
    ids, text, rendered = _greedy(ggufs[qtype])
    ref_ids, _, ref_rendered = _greedy(d)
    assert (ids, rendered) == (ref_ids, ref_rendered) and text


def test_q8_0_logits_within_the_int8_tolerance(files):
    """Teacher-forced logits of the Q8_0 file against the f32 source, held to conformance's int8 row."""
    from glmcore_conformance.metrics import compare, out_of_bounds
    from glmcore_conformance.tolerances import TOLERANCES
    d, ggufs = files["glm4"]
    assert not out_of_bounds(compare(_logits(d, "torch"), _logits(ggufs["Q8_0"], "torch")),
                             TOLERANCES["int8"].bounds())


def _logits(model, backend: str) -> np.ndarray:
    """Teacher-forced logits of a fixed id sequence, one decode step per id."""
    from glmcore.model import load_model
    lm = load_model(model, backend)
    try:
        return np.stack([lm.scheduler.batch.step([(0, [i])])[0] for i in [5, 99, 7, 300, 12, 1000, 42, 3]])
    finally:
        lm.close()


def test_split_set_loads_as_one_file(files, tmp_path):
    d, _ = files["glm4"]
    first = write_gguf(d, tmp_path / "m.gguf", "F32", split_tensors=6)
    assert first.name == "m-00001-of-00003.gguf", sorted(p.name for p in tmp_path.iterdir())
    whole = open_gguf(files["glm4"][1]["F32"])
    split = open_gguf(first)
    assert all(np.array_equal(split.weights[n], whole.weights[n]) for n in whole.weights)
    (tmp_path / "m-00002-of-00003.gguf").unlink()
    with pytest.raises(CheckpointError, match="m-00002-of-00003.gguf is missing"):
        open_gguf(first)


def test_cli_run_takes_a_gguf(files, capsys):
    from glmcore.cli import main
    assert main(["run", "--model", str(files["glm4-0414"][1]["Q8_0"]), "--backend", "torch", "--prompt", "hi",
                 "--max-new-tokens", "4", "--temperature", "0"]) == 0


# ------------------------------------------------------------------ hostile files

def _s(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, kind: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", kind) + payload


STR, U32, F32_, ARR = 8, 4, 6, 9


def _file(kvs: list[bytes], infos: list[tuple[str, list[int], int, int]], data: bytes = b"", n_kv=None,
          n_tensors=None) -> bytes:
    """A GGUF v3 file: header, the kv bytes, tensor infos (name, dims, type, offset), padding, data."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(infos) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    body = b"".join(kvs) + b"".join(_s(n) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
                                    + struct.pack("<IQ", t, off) for n, dims, t, off in infos)
    blob = head + body
    return blob + bytes(-len(blob) % 32) + data


ARCH = _kv("general.architecture", STR, _s("chatglm"))


@pytest.mark.parametrize("blob, match", [
    (b"GGUF", "truncated"),
    (b"GGML" + bytes(20), "magic"),
    (_file([ARCH], [], n_kv=1 << 40), "metadata keys"),
    (_file([ARCH], [], n_tensors=1 << 40), "tensors"),
    (_file([ARCH, _kv("tokenizer.ggml.tokens", ARR, struct.pack("<IQ", STR, 1 << 60))], []), "array of"),
    (_file([ARCH, _kv("x", ARR, struct.pack("<IQ", ARR, 1))], []), "nested"),
    (_file([ARCH, _kv("x", STR, struct.pack("<Q", 1 << 50))], []), "string of"),
    (_file([ARCH, _kv("x", 99, b"")], []), "unknown metadata value type"),
    (_file([ARCH], [("t", [1 << 50, 1 << 20], 0, 0)]), "absurd dimensions"),
    (_file([ARCH], [("t", [4, 0], 0, 0)], bytes(64)), "token_embd.weight is missing"),     # zero width: legal
    (_file([ARCH], [("t", [4] * 5, 0, 0)]), "5 dimensions"),
    (_file([ARCH], [("t", [32], 0, 0)], bytes(64)), "truncated"),
    (_file([ARCH], [("t", [8], 250, 0)], bytes(64)), "unknown type"),
    (_file([ARCH], [("t", [256], int(gguf.GGMLQuantizationType.IQ4_XS), 0)], bytes(256)), "IQ4_XS.*Q4_K"),
    (_file([ARCH], [("a", [8], 0, 0), ("b", [8], 0, 0)], bytes(64)), "overlap"),
    (_file([ARCH], [("a", [8], 0, 4)], bytes(64)), "alignment"),
    (_file([ARCH], [("a", [8], 0, 0), ("a", [8], 0, 32)], bytes(64)), "duplicated"),
    (_file([_kv("general.architecture", U32, struct.pack("<I", 7))], []), "not str"),
    (_file([_kv("general.architecture", STR, _s("llama"))], []), "'llama' is not a GLM model"),
    (_file([ARCH], []), "token_embd.weight is missing"),
    (_file([ARCH], [("token_embd.weight", [8, 4], 0, 0)], bytes(128)), "chatglm.attention.head_count is missing"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_hostile_gguf_is_one_line(tmp_path, blob, match):
    path = tmp_path / "bad.gguf"
    path.write_bytes(blob)
    with pytest.raises(CheckpointError, match=match) as e:
        open_gguf(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_zero_width_shared_expert_as_the_converter_writes_it(make_tiny, tmp_path):
    """transformers writes the shared expert at n_shared_experts 0 as zero-width tensors and llama.cpp's converter
    keeps them ([0, hidden] is a legal GGUF shape: only negative sizes are not): read as the checkpoint directory
    reads them, as no tensor of the model, and the file runs as transformers' model does."""
    import shutil
    import torch
    from glmcore.backend import LoadOptions, registry
    from test_glm4_moe import close, hf_logits, transformers_variant
    d = tmp_path / "ckpt"
    model = transformers_variant(d, "glm4-moe", {"n_shared_experts": 0, "vocab_size": 2112})
    assert any(t.numel() == 0 for n, t in model.named_parameters() if "shared_experts" in n)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(make_tiny("glm4-moe") / f, d / f)
    c = open_gguf(write_gguf(d, tmp_path / "m.gguf", "F32"))
    assert c.config.num_shared_experts == 0 and not [n for n in c.weights if "shared" in n]
    ids = [int(t) for t in np.random.default_rng(2).integers(0, 2112, 20)]
    with torch.no_grad(), registry().get("torch").load_batch(c.config, c.weights, LoadOptions(capacity=64), 1) as b:
        close(b.step([(0, ids)], all_logits=True)[0], hf_logits(model, ids))


def test_tensor_of_the_wrong_shape_is_refused(files, tmp_path):
    """A file whose metadata disagrees with a tensor's shape (here: one layer too many) names the tensor."""
    d, _ = files["glm4"]
    path = write_gguf(d, tmp_path / "m.gguf", "F32")
    data = bytearray(path.read_bytes())
    key = b"chatglm.block_count"
    at = data.index(key) + len(key) + 4
    data[at:at + 4] = struct.pack("<I", 3)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="layers.2.* is missing"):
        open_gguf(path)


# ------------------------------------------------------------------ cpu_int4 keeps Q4_0 / Q8_0 blocks

@pytest.mark.parametrize("family", ["glm4", "glm4-moe", "glm4-moe-lite"])
@pytest.mark.parametrize("qtype, bits", [("Q4_0", 4), ("Q8_0", 8)])
def test_cpu_int4_holds_the_blocks_without_requantizing(files, qtype, bits, tmp_path, family):
    """Every weight cpu_int4 packs from a Q4_0/Q8_0 file dequantizes exactly to gguf-py's dequantization of the
    file; its logits agree with the reference run of the same file within the int8-activation row (the experts'
    row for the MoE GLMs). Latent attention's kv_b is packed as two derived halves (transposed key part), which
    the file does not hold: those are quantized from the file's values, so that model is held to the int4 row."""
    from glmcore.backend import LoadOptions, registry
    from glmcore_conformance.metrics import compare, out_of_bounds
    from glmcore_conformance.tolerances import TOLERANCES
    from glmcore_plugins.cpu_int4.quant import dequantized_weights, read_packed
    backend = registry().get("cpu_int4")
    if not registry().probe("cpu_int4").ready:
        pytest.skip("cpu_int4's C library cannot be built here")
    path = files[family][1][qtype]
    c = open_gguf(path)
    opts = backend.resolve(LoadOptions())
    opts.cache_dir = tmp_path
    meta, blob = read_packed(backend._packed_dir(c.config, c.weights, opts), c.config)
    assert (meta["options"]["linear_bits"], meta["options"]["embed_bits"], meta["options"]["head_bits"]) == (bits,) * 3
    held = dequantized_weights(meta, np.asarray(blob))
    reader = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert np.array_equal(held["embed.weight"], gguf.quants.dequantize(reader["token_embd.weight"].data,
                                                                        reader["token_embd.weight"].tensor_type))
    derived = {n for n in held if n.endswith("kv_b.weight")}
    for name in set(held) - derived:
        assert np.array_equal(held[name], c.weights[name]), name
    row = "int8" if family == "glm4" else "int4+experts" if derived else "int8+experts"
    assert not out_of_bounds(compare(_logits(path, "torch"), _logits(path, "cpu_int4")), TOLERANCES[row].bounds())


# ------------------------------------------------------------------ cpu_int4 keeps Q4_K blocks (asymmetric g32)

def q4_k_rounding_bound(blocks: np.ndarray) -> np.ndarray:
    """Per weight of Q4_K blocks [rows, bytes]: how far cpu_int4's asymmetric g32 form may be from gguf-py's
    dequantization, the products s = d * sc_j and m = dmin * m_j each rounded once to f16 (relative 2^-11, and
    f16's subnormal spacing): 15 |ds| + |dm|."""
    b = blocks.reshape(-1, 144)
    d, dmin = (b[:, i:i + 2].copy().view(np.float16).astype(np.float64) for i in (0, 2))
    sc, m = gguf.quants.Q4_K.get_scale_min(b[:, 4:16].copy())
    per_group = 2.0 ** -11 * (15 * np.abs(d * sc) + np.abs(dmin * m)) + 16 * 2.0 ** -25
    return np.repeat(per_group.reshape(blocks.shape[0], -1), 32, axis=1)


def test_q4_k_blocks_become_asymmetric_int4_codes_and_f16_products():
    """Blocks of random bytes (every scale, min and nibble pattern) packed as cpu_int4 tiles and read back as the
    kernels read them: gguf-py's dequantization within the f16 rounding of the products, and no further (a
    wrong nibble order or scale unpacking is off by whole steps). A product beyond f16 is refused (None)."""
    from glmcore_plugins.cpu_int4.gguf_import import q4_k_codes
    from glmcore_plugins.cpu_int4.quant import tile4, untile
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (48, 3, 144), dtype=np.uint8)
    blocks[..., :4] = np.array([0.01, 0.002], np.float16).view(np.uint8)
    blocks[::7, :, :4] = np.array([3e-7, 2e-7], np.float16).view(np.uint8)         # subnormal products
    blocks = blocks.reshape(48, -1)
    want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K)
    q, scales, mins = q4_k_codes(blocks)
    held = untile(tile4(q, scales, mins, 32), 48, 768, 4, 32, True, "f16")
    err = np.abs(held - want)
    assert (err <= q4_k_rounding_bound(blocks)).all() and err.max() > 0
    blocks[0, :2] = np.array([60000], np.float16).view(np.uint8)
    assert q4_k_codes(blocks) is None


@pytest.mark.parametrize("family", [pytest.param("glm4", marks=pytest.mark.slow), "glm4-0414", "glm4-moe",
                                    "glm4-moe-lite"])
def test_cpu_int4_keeps_the_q4_k_blocks_of_a_q4_k_m_file(family, tmp_path_factory, tmp_path):
    """A Q4_K_M-style file (Q4_K matrices; attn_v, ffn_down and the output layer in a higher type): cpu_int4 packs
    asymmetric int4 g32 with f16 scales and mins, and every Q4_K row it holds (GLM-4-0414's q and k rows beside its
    Q8_0 v rows in one q|k|v matrix too) is gguf-py's dequantization within the f16 rounding of the products; the
    matrices stored wider (ffn_down) are int8 rows; its logits agree with the reference run of the same file within
    the int4 row."""
    from glmcore.backend import LoadOptions, registry
    from glmcore.synth import make_model
    from glmcore_conformance.metrics import compare, out_of_bounds
    from glmcore_conformance.tolerances import TOLERANCES
    from glmcore_plugins.cpu_int4.quant import dequantized_weights, read_packed
    backend = registry().get("cpu_int4")
    if not registry().probe("cpu_int4").ready:
        pytest.skip("cpu_int4's C library cannot be built here")
    d = tmp_path_factory.mktemp(f"{family}-small")
    make_model(family, "small", d, layers=2)            # rows of whole 256-input super-blocks (glm4: 45 s)
    path = write_gguf(d, tmp_path / "q4_k_m.gguf", "Q4_K")
    c = open_gguf(path)
    opts = backend.resolve(LoadOptions())
    opts.cache_dir = tmp_path
    meta, blob = read_packed(backend._packed_dir(c.config, c.weights, opts), c.config)
    # the matrices the file stores wider than 4 bits (the kit's stand-ins: Q8_0, and Q5_0 where rows are not whole
    # super-blocks, as GLM-4.7-Flash's q_b)
    wider = sorted(n for n in meta["tensors"] if meta["tensors"][n]["kind"] == "tiles" and n in c.weights
                   and n != "lm_head.weight" and c.weights.stored(n).qtype in ("Q8_0", "Q5_0"))
    options = {**meta["options"], "int8_matrices": sorted(meta["options"]["int8_matrices"])}
    assert any(n.endswith("ffn_down.weight") for n in wider) and options == {"group_size": 32, "sym": False, "scale_dtype": "f16", "embed_bits": 4,
                                 "head_bits": 8, "linear_bits": 4, "int8_matrices": wider}
    held = dequantized_weights(meta, np.asarray(blob))
    for name in wider:          # as int8 rows: within half an int8 step of the file's values
        t = c.weights[name]
        assert meta["tensors"][name]["bits"] == 8
        assert (np.abs(held[name] - t) <= np.abs(t).max(axis=1, keepdims=True) / 254 + 1e-7).all(), name
    checked = mixed = 0
    for name in held:
        t, at = c.weights.stored(name), 0
        for p in t.parts:
            rows = slice(at, at + p.shape[0])
            at += p.shape[0]
            if p.qtype == "Q4_K":
                err = np.abs(held[name][rows] - p.array().reshape(p.shape[0], -1))
                assert (err <= q4_k_rounding_bound(p.data.reshape(p.shape[0], -1))).all(), name
                checked += 1
                mixed += t.qtype is None
    # a q|k|v put together from parts of two types: GLM-4-0414's and GLM-4.5's (glm4: one fused attn_qkv; Flash: none)
    assert checked > 4 and (mixed > 0) == (family in ("glm4-0414", "glm4-moe"))
    row = TOLERANCES["int4+experts" if family.startswith("glm4-moe") else "int4"]      # the rows the suite holds
    assert not out_of_bounds(compare(_logits(path, "torch"), _logits(path, "cpu_int4")), row.bounds())


def test_a_k_quant_files_whole_kv_b_stored_wider_packs_both_halves_as_int8(make_tiny):
    """Older conversions of GLM-4.7-Flash keep kv_b whole (attn_kv_b); stored in Q6_K beside Q4_K matrices, it is
    named by the halves cpu_int4 packs it as (a canonical name there would not be a packed tensor)."""
    from types import SimpleNamespace
    from glmcore.config import ModelConfig
    from glmcore.weights import canonical_shapes
    from glmcore_plugins.cpu_int4.gguf_import import k_quant_options
    from glmcore_plugins.cpu_int4.quant import KV_B_PARTS, packed_layout
    cfg = ModelConfig.from_dir(make_tiny("glm4-moe-lite"))
    stored = {n: SimpleNamespace(shape=s, qtype="Q6_K" if n == "layers.1.kv_b.weight" else "Q4_K")
              for n, s in canonical_shapes(cfg).items()}
    o = k_quant_options(stored)
    assert sorted(o.int8_matrices) == ["layers.1." + k for k in KV_B_PARTS]
    lay = packed_layout(cfg, o)
    assert all(lay["layers.1." + k]["bits"] == 8 for k in KV_B_PARTS) and lay["layers.0.kv_b_uk.weight"]["bits"] == 4


def test_cpu_int4_quantization_options_still_apply_to_a_gguf(files, tmp_path):
    from glmcore.backend import LoadOptions, registry
    from glmcore_plugins.cpu_int4.quant import read_packed
    backend = registry().get("cpu_int4")
    if not registry().probe("cpu_int4").ready:
        pytest.skip("cpu_int4's C library cannot be built here")
    c = open_gguf(files["glm4"][1]["Q8_0"])
    opts = backend.resolve(LoadOptions(extra={"group_size": 64}))
    opts.cache_dir = tmp_path
    meta, _ = read_packed(backend._packed_dir(c.config, c.weights, opts), c.config)
    assert meta["options"]["group_size"] == 64 and meta["options"]["linear_bits"] == 4


def test_identity_is_the_content_not_only_the_header(files, tmp_path):
    """Two files alike but for a weight get different fingerprints (conversion caches key on them)."""
    path = files["glm4"][1]["F32"]
    data = bytearray(path.read_bytes())
    at = gguf.GGUFReader(path).tensors[-1].data_offset
    data[at:at + 4] = struct.pack("<f", 123.0)      # the first value of the last tensor
    other = tmp_path / "other.gguf"
    other.write_bytes(bytes(data))
    assert open_gguf(other).weights.fingerprint() != open_gguf(path).weights.fingerprint()


def test_eval_perplexity_of_a_gguf_is_its_sources(files, tmp_path, capsys):
    import re
    from glmcore.cli import main
    d, ggufs = files["glm4-0414"]
    text = tmp_path / "text.txt"
    text.write_text(" ".join(STRINGS) * 3, encoding="utf-8")
    found = []
    for model in (d, ggufs["F32"]):
        assert main(["eval", "--model", str(model), "--perplexity", str(text), "--ctx", "32", "--chunks", "3",
                     "--backend", "torch", "--threads", "1"]) == 0
        found.append(re.search(r"Final estimate: PPL = ([\d.]+)", capsys.readouterr().out).group(1))
    assert found[0] == found[1]


@pytest.mark.parametrize("family", ["glm4-0414", "glm4-moe-lite"])
def test_two_ranks_open_the_gguf_too(files, capsys, family):
    """--tp 2: every rank opens the GGUF itself (the weights are never sent) and the text is one rank's (GLM-4.7-Flash:
    kv_b put back together from the file's k_b and v_b, then split by heads)."""
    from glmcore.cli import main
    args = ["run", "--backend", "torch", "--model", str(files[family][1]["Q8_0"]), "--prompt", "hi",
            "--max-new-tokens", "6", "--temperature", "0", "--threads", "1"]
    assert main(args) == 0
    alone = capsys.readouterr().out
    assert main(args + ["--tp", "2"]) == 0
    assert capsys.readouterr().out == alone


@pytest.mark.parametrize("family, shipped", [("glm4-moe", "glm45_chat_template.jinja"),
                                             ("glm4-moe-lite", "glm47_chat_template.jinja")])
def test_moe_gguf_template_renders_as_transformers(files, family, shipped):
    """A GGUF holding the real chat template of the synthetic checkpoint's model (GLM-4.6's for glm4-moe,
    GLM-4.7's for GLM-4.7-Flash): glmcore's prompt (text and ids) for each conversation is transformers'
    apply_chat_template on the checkpoint's tokenizer with the same template (the reference for the hub files),
    tools, tool calls/results, thinking on/off and earlier turns' thinking cleared."""
    from transformers import PreTrainedTokenizerFast

    from glmcore.chat import chat_format_for
    from glmcore.tokenizer import load_tokenizer
    d, ggufs = files[family]
    template = gguf.GGUFReader(ggufs["F32"]).fields["tokenizer.chat_template"].contents()
    assert template == (Path(__file__).parents[1] / "glmcore" / "data" / shipped).read_text()
    c = open_gguf(ggufs["F32"])
    fmt = chat_format_for(load_tokenizer(c.tokenizer_dir, c.config.family))
    reference = PreTrainedTokenizerFast.from_pretrained(d)
    for messages, tools, kwargs in CONVERSATIONS:
        ours = fmt.configured(kwargs)
        theirs = dict(tools=tools, chat_template=template, add_generation_prompt=True, **kwargs)
        # the template iterates a call's arguments: transformers takes them as a dict (the OpenAI JSON string
        # parsed, as vLLM, llama.cpp and glmcore do)
        parsed = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
            c["function"]["arguments"])}} for c in m["tool_calls"]]} if "tool_calls" in m else m for m in messages]
        text = reference.apply_chat_template(parsed, tokenize=False, **theirs)
        assert ours.render(messages, tools) == text, messages
        assert ours.encode_messages(messages, tools) == reference.apply_chat_template(parsed, **theirs)["input_ids"]
