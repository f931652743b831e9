"""The built-in demo model (glmcore/data/demo-chatglm3-poet, trained by tools/train_demo.py): packaged
and small, in the real ChatGLM3 layout, its tokenizer round-trips, the training forward is the
reference's math, the greedy answer is the same on every f32 backend, and it writes 5/7-character lines."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

from glmcore.backend import LoadOptions, registry
from glmcore.chat import chat_format_for
from glmcore.config import ModelConfig
from glmcore.errors import BackendError
from glmcore.demo import MODEL_FILES, PACKAGED_DIR, demo_model_dir
from glmcore.tokenizer import SP_SPECIALS, load_tokenizer
from glmcore.weights import load_weights
from glmcore_conformance.metrics import compare, out_of_bounds
from glmcore_conformance.tolerances import TRAINED_TOLERANCES, tolerance_key

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "写一首关于春天的诗"          # the README's first command
HELDOUT = json.loads((ROOT / "tests" / "data" / "demo_heldout_prompts.json").read_text(encoding="utf-8"))
HAN = re.compile(r"[\u4e00-\u9fff]")
# Backends and the options that make them compute in f32 with f32 weights (conformance row "f32":
# top-1 agrees at every position, so greedy decoding must give the same ids).
# ascend_npu in eager mode: its graph mode compiles for minutes on a CPU (conformance covers it).
F32 = {"torch": {}, "openvino_amx": {"precision": "f32", "weights": "f32"},
       "tpu_bm1684x": {"precision": "f32", "weights": "f32"},
       "ascend_npu": {"precision": "f32", "weights": "f32", "extra": {"mode": "eager"}}}
CAPACITY = 96                       # KV positions: prompt + answer; small static graphs on tpu_bm1684x
THREADS = 1                         # a tiny model: more threads only wait on each other


@pytest.fixture(scope="module")
def demo():
    cfg = ModelConfig.from_dir(PACKAGED_DIR)
    tok = load_tokenizer(PACKAGED_DIR, cfg.family)
    return cfg, tok, chat_format_for(tok), load_weights(PACKAGED_DIR, cfg)


def line_lengths(text: str) -> list[int]:
    return [n for n in (len(HAN.findall(x)) for x in re.split(r"[，。！？]", text)) if n]


def greedy(backend: str, demo, prompt: str = PROMPT, max_new: int = 48, **opts) -> list[int]:
    cfg, tok, fmt, weights = demo
    b = registry().get(backend)
    if not registry().probe(backend).ready:
        pytest.skip(f"backend {backend} not ready here")
    batch = b.load_batch(cfg, weights, b.resolve(LoadOptions(capacity=CAPACITY, threads=THREADS, **opts)), 1)
    try:
        ids = fmt.encode_messages([{"role": "user", "content": prompt}])
        logits, out = batch.step([(0, ids)])[0], []
        while len(out) < min(max_new, CAPACITY - len(ids)):
            t = int(np.argmax(logits[:tok.n_vocab]))
            if t in fmt.stop_ids:
                break
            out.append(t)
            logits = batch.step([(0, [t])])[0]
        return out
    finally:
        batch.close()


def test_packaged_files_are_small_and_in_the_real_layout():
    assert all((PACKAGED_DIR / f).is_file() for f in MODEL_FILES + ("README.md", "loss.png"))
    assert sum(f.stat().st_size for f in PACKAGED_DIR.iterdir()) <= 16 * 2**20
    raw = json.loads((PACKAGED_DIR / "config.json").read_text())
    assert raw["model_type"] == "chatglm" and raw["rmsnorm"] and raw["multi_query_attention"]
    assert raw["multi_query_group_num"] == 2 and raw["padded_vocab_size"] % 64 == 0
    cfg = ModelConfig.from_dir(PACKAGED_DIR)
    assert cfg.family == "chatglm3" and cfg.rotary_dim == cfg.head_dim // 2
    weights = load_weights(PACKAGED_DIR, cfg)
    assert str(weights.dtype) == "bfloat16"
    assert "glmcore_synthetic" not in raw       # trained, not random


def test_tokenizer_round_trips_with_chatglm3_specials(demo):
    cfg, tok, fmt, _ = demo
    assert tok.n_vocab <= cfg.vocab_size
    assert [tok.special_ids[s] for s in SP_SPECIALS["chatglm3"]] == list(range(tok.n_base, tok.n_base + 9))
    assert fmt.stop_ids == [2, tok.special_ids["<|user|>"], tok.special_ids["<|observation|>"]]
    for text in ["床前明月光，疑是地上霜。", "续写：白日依山尽，黄河入海流。", "Hello, world! 123",
                 "罕见字：犇猋驫 🌸 tabs\tand  spaces", "<|user|> is plain text here"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(not tok.is_special(i) for i in ids)
    assert len(tok.encode("春眠不觉晓，处处闻啼鸟。")) <= 13    # common characters are single pieces


def test_demo_model_dir_materializes_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("GLMCORE_CACHE", str(tmp_path))
    notes = []
    path = demo_model_dir(notice=notes.append)
    assert path.parent == tmp_path / "demo" and "trained on classical Chinese poems" in notes[0]
    for f in MODEL_FILES:
        assert (path / f).read_bytes() == (PACKAGED_DIR / f).read_bytes()
    assert demo_model_dir(notice=notes.append) == path      # made once


def test_training_forward_is_the_reference_math(demo):
    torch = pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("train_demo", ROOT / "tools" / "train_demo.py")
    train_demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_demo)
    cfg, tok, fmt, weights = demo
    ids = fmt.encode_messages([{"role": "user", "content": PROMPT}]) + tok.encode("\n春风")
    w = {k: torch.from_numpy(np.array(weights[k], dtype=np.float32)) for k in weights}
    with torch.no_grad():
        mine = train_demo.forward(cfg, w, torch.tensor([ids]), torch.arange(len(ids))[None]).numpy()[0]
    b = registry().get("torch")
    batch = b.load_batch(cfg, weights, b.resolve(LoadOptions(threads=THREADS)), 1)
    ref = batch.step([(0, ids)], all_logits=True)[0]
    batch.close()
    assert np.abs(mine - ref).max() <= 1e-4 * np.abs(ref).max()
    assert (mine.argmax(-1) == ref.argmax(-1)).all()


@pytest.fixture(scope="module")
def torch_answer(demo):
    return greedy("torch", demo)


@pytest.mark.parametrize("backend", sorted(set(F32) - {"torch"}))
def test_greedy_answer_is_identical_on_f32_backends(backend, demo, torch_answer):
    assert greedy(backend, demo, **F32[backend]) == torch_answer


@pytest.mark.parametrize("backend,opts", [("cpu_int4", {}), ("openvino_amx", {})])
def test_quantized_defaults_still_write_poems(backend, opts, demo):
    text = demo[1].decode(greedy(backend, demo, **opts))
    lens = line_lengths(text)
    assert lens and sum(n in (5, 7) for n in lens) >= 0.75 * len(lens), text


def test_answer_is_a_poem_of_five_or_seven_character_lines(demo, torch_answer):
    text = demo[2].decode_reply(torch_answer).content
    lens = line_lengths(text)
    assert len(lens) >= 4 and all(n in (5, 7) for n in lens), text


def test_heldout_prompts_get_regular_lines(demo):
    """A fast slice of the done-when figure (tools/train_demo.py measure runs all 24 prompts)."""
    lens = [n for p in HELDOUT[:6] for n in line_lengths(demo[2].decode_reply(greedy("torch", demo, p["prompt"])).content)]
    assert sum(n in (5, 7) for n in lens) >= 0.8 * len(lens)


# Every non-f32 format against the f32 reference on trained weights, at the second, tighter rows of
# conformance/tolerances.py (TRAINED_TOLERANCES); the first rows were set on random weights.
FORMATS = [("openvino_amx", {"precision": "bf16", "weights": "f32"}), ("openvino_amx", {"weights": "int8"}),
           ("openvino_amx", {"precision": "f32", "weights": "int8"}), ("openvino_amx", {"weights": "int4"}),
           ("openvino_amx", {"precision": "f32", "weights": "int4"}), ("cpu_int4", {}),
           ("cpu_int4", {"extra": {"group_size": 128}}), ("cpu_int4", {"extra": {"sym": False}}),
           ("cpu_int4", {"extra": {"head_bits": 4}}), ("cpu_int4", {"extra": {"embed_bits": 8}}),
           ("tpu_bm1684x", {"precision": "f16", "weights": "f16"}),
           ("ascend_npu", {"precision": "bf16", "weights": "bf16", "extra": {"mode": "eager"}}),
           ("ascend_npu", {"precision": "f16", "weights": "f16", "extra": {"mode": "eager"}})]


def teacher_forced(backend: str, demo, ids: list[int], **opts) -> tuple[np.ndarray, LoadOptions]:
    cfg, tok, _, weights = demo
    b = registry().get(backend)
    if not registry().probe(backend).ready:
        pytest.skip(f"backend {backend} not ready here")
    try:
        options = b.resolve(LoadOptions(capacity=256, threads=THREADS, **opts))
    except BackendError as e:
        if "has no precision" not in str(e):
            raise
        pytest.skip(f"refused on this CPU: {e}")      # e.g. ascend_npu's host f16 without native fp16 matmul
    batch = b.load_batch(cfg, weights, options, 1)
    try:
        return np.asarray(batch.step([(0, ids)], all_logits=True)[0])[:, :tok.n_vocab], options
    finally:
        batch.close()


@pytest.fixture(scope="module")
def heldout_ids(demo):
    poems = (ROOT / "tests" / "data" / "demo_heldout_poems.txt").read_text(encoding="utf-8").splitlines()[:4]
    return demo[2].prefix + demo[1].encode("\n".join(poems))


@pytest.fixture(scope="module")
def reference_logits(demo, heldout_ids):
    return teacher_forced("torch", demo, heldout_ids)[0]


@pytest.mark.parametrize("backend,opts", FORMATS, ids=[f"{b}-{o}" for b, o in FORMATS])
def test_formats_on_trained_weights_meet_the_tighter_rows(backend, opts, demo, heldout_ids, reference_logits):
    got, options = teacher_forced(backend, demo, heldout_ids, **opts)
    key = tolerance_key(options.precision, options.weights)
    metrics = compare(reference_logits, got)
    assert not out_of_bounds(metrics, TRAINED_TOLERANCES[key].bounds()), (key, metrics)


def test_nextn_training_forward_is_the_reference_math(demo):
    """The demo's NextN layer (mtp.safetensors, trained by tools/train_demo.py mtp) is trained with the math the
    torch backend drafts with: at every position the training forward's logits equal DenseGLM.nextn's."""
    torch = pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("train_demo", ROOT / "tools" / "train_demo.py")
    train_demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_demo)
    cfg, tok, fmt, weights = demo
    assert cfg.num_mtp_layers == 1 and "mtp.0.eh_proj.weight" in weights
    ids = fmt.encode_messages([{"role": "user", "content": PROMPT}]) + tok.encode("\n春风又绿江南岸")
    w = {k: torch.from_numpy(np.array(weights[k], dtype=np.float32)) for k in weights}
    pos = torch.arange(len(ids))[None]
    with torch.no_grad():
        _, hidden = train_demo.forward(cfg, w, torch.tensor([ids]), pos, hidden=True)
        mine = train_demo.nextn_forward(cfg, w, w, torch.tensor([ids]), pos, None, hidden)[0, :-1].numpy()
    b = registry().get("torch")
    batch = b.load_batch(cfg, weights, b.resolve(LoadOptions(threads=THREADS, capacity=CAPACITY)), 1)
    batch.start_nextn()
    try:
        model, mtp = batch.model, batch.mtp
        with torch.inference_mode():
            _, h = model(torch.tensor([ids]), torch.tensor([0]), torch.tensor([0]), torch.tensor([len(ids) - 1]),
                         batch.k_cache, batch.v_cache)
            _, x = model.nextn(mtp.layer, torch.tensor([ids[1:]]), torch.tensor([0]), torch.tensor([0]), h[:, :-1],
                               mtp.k_cache, mtp.v_cache)
            ref = model.logits(model.norm(mtp.layer, "final_norm", x[0]).to(model.dtype)).numpy()
    finally:
        batch.close()
    assert np.abs(mine - ref).max() <= 1e-4 * np.abs(ref).max()
    assert (mine.argmax(-1) == ref.argmax(-1)).all()


def test_the_nextn_layer_is_kept_apart_from_the_checkpoint():
    """model.safetensors holds exactly ChatGLM3's tensors (transformers and llama.cpp's converter read it
    unchanged); the NextN layer lives in mtp.safetensors, read only because config.json declares it."""
    from glmcore.weights import NEXTN_FILE, read_safetensors
    raw = json.loads((PACKAGED_DIR / "config.json").read_text())
    own = set(read_safetensors(PACKAGED_DIR / "model.safetensors"))
    layers = {int(m.group(1)) for n in own if (m := re.match(r"transformer\.encoder\.layers\.(\d+)\.", n))}
    assert layers == set(range(raw["num_layers"]))
    side = set(read_safetensors(PACKAGED_DIR / NEXTN_FILE))
    assert raw["num_nextn_predict_layers"] == 1 and NEXTN_FILE in MODEL_FILES
    assert {n.split(".")[3] for n in side} == {str(raw["num_layers"])}
    assert {"eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight"} <= \
        {n.split(".", 4)[4] for n in side}
