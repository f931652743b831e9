"""GGUFs made by llama.cpp's own tools (issue 40): its convert_hf_to_gguf.py and llama-quantize on the synthetic
checkpoints, read by glmcore as their safetensors source is; the tokenizer's ids equal to llama-tokenize's; the chat
prompt equal to what llama-server renders from the file's template (its /apply-template).

Runs only where $GLMCORE_LLAMACPP names a built llama.cpp tree (conformance/llamacpp.py says how to build one,
with the targets llama-quantize and llama-tokenize; llama-server is built into that tree by the test when missing:
about 10 minutes on 2 cores); CI has none, and tests/test_gguf.py covers the same reader
on files gguf-py's writer lays out as the converter does.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from glmcore.gguf import open_gguf
from glmcore.tokenizer import load_tokenizer
from test_gguf import CONVERSATIONS, STRINGS

pytestmark = pytest.mark.slow

LLAMACPP = os.environ.get("GLMCORE_LLAMACPP")
FAMILIES = ["glm4", "glm4-0414", "chatglm3", "glm4-moe", "glm4-moe-lite"]


@pytest.fixture(scope="module")
def llamacpp():
    from glmcore_conformance.llamacpp import LlamaCpp
    if not LLAMACPP:
        pytest.skip("$GLMCORE_LLAMACPP is unset: no llama.cpp build to compare with")
    return LlamaCpp(Path(LLAMACPP))


def _tool(lc, name: str) -> str:
    assert lc.tool(name).exists(), f"$GLMCORE_LLAMACPP={LLAMACPP} lacks {name}; build it (conformance/llamacpp.py)"
    return str(lc.tool(name))


@pytest.fixture(scope="module")
def converted(llamacpp, make_tiny, tmp_path_factory):
    """family -> (checkpoint dir, f32 GGUF by llama.cpp's converter)."""
    out = {}
    for family in FAMILIES:
        d = make_tiny(family)
        f32 = tmp_path_factory.mktemp(f"lc-{family}") / "f32.gguf"
        r = subprocess.run([sys.executable, "-m", "glmcore_conformance.llamacpp", "convert", str(llamacpp.root), str(d),
                            str(f32), "--outtype", "f32"], capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0, r.stderr[-3000:]
        out[family] = d, f32
    return out


def _quantize(lc, src: Path, qtype: str) -> Path:
    dst = src.with_name(f"{qtype}.gguf")
    r = subprocess.run([_tool(lc, "llama-quantize"), str(src), str(dst), qtype], capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    return dst


@pytest.mark.parametrize("family", FAMILIES)
def test_llamacpp_f32_gguf_runs_as_the_checkpoint(converted, family):
    from test_gguf import _greedy
    d, f32 = converted[family]
    c = open_gguf(f32)
    from glmcore.config import ModelConfig
    from glmcore.weights import load_weights
    w = load_weights(d, ModelConfig.from_dir(d))
    for name in c.weights:
        assert np.array_equal(c.weights[name], np.asarray(w[name], np.float32)), name
    assert _greedy(f32) == _greedy(d)


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_ids_equal_llama_tokenize(llamacpp, converted, family, tmp_path):
    """Plain text (special tokens not parsed, no BOS). One known divergence: llama.cpp's SentencePiece merges may
    spell a control token from plain text (ChatGLM3's "sop" in "<sop>"), which the checkpoint's own tokenizer
    never does; there glmcore follows the checkpoint."""
    d, f32 = converted[family]
    c = open_gguf(f32)
    tok, own = load_tokenizer(c.tokenizer_dir, c.config.family), load_tokenizer(d, c.config.family)
    wrong = []
    for i, text in enumerate(STRINGS):
        (tmp_path / f"{i}.txt").write_text(text, encoding="utf-8")
        r = subprocess.run([_tool(llamacpp, "llama-tokenize"), "-m", str(f32), "-f", str(tmp_path / f"{i}.txt"),
                            "--ids", "--no-bos", "--no-parse-special", "--log-disable"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-1000:]
        theirs = ast.literal_eval(r.stdout.strip().splitlines()[-1])
        ours = tok.encode(text)
        spelled_control = any(i in tok.special_names for i in theirs) and ours == own.encode(text)
        if ours != theirs and not (c.config.family in ("chatglm2", "chatglm3") and spelled_control):
            wrong.append((text, ours, theirs))
    assert not wrong, (len(wrong), wrong[:3])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_llama_quantize_files_load_into_cpu_int4_exactly(llamacpp, converted, qtype, tmp_path):
    """llama-quantize's Q4_0/Q8_0: every layer weight cpu_int4 holds dequantizes to what gguf-py gives for the file."""
    from glmcore_plugins.cpu_int4.quant import dequantized_weights
    q = _quantize(llamacpp, converted["glm4"][1], qtype)
    c = open_gguf(q)
    meta, blob = _packed(q, tmp_path)
    held = dequantized_weights(meta, np.asarray(blob))
    same_type = [n for n in held if c.weights.stored(n).qtype == qtype]
    assert any(n.endswith("ffn_up.weight") for n in same_type)
    for name in same_type:
        assert np.array_equal(held[name], c.weights[name]), name
    reader = {t.name: t for t in gguf.GGUFReader(q).tensors}
    t = reader["blk.0.ffn_down.weight"]
    assert np.array_equal(held["layers.0.ffn_down.weight"], gguf.quants.dequantize(t.data, t.tensor_type))


@pytest.fixture(scope="module")
def small(llamacpp, tmp_path_factory):
    """A glm4 checkpoint wide enough for K-quants (rows of 256 inputs) and its f32 GGUF by llama.cpp's converter."""
    from glmcore.synth import make_model
    d = tmp_path_factory.mktemp("glm4-small")
    make_model("glm4", "small", d, layers=2)
    f32 = d / "f32.gguf"
    r = subprocess.run([sys.executable, "-m", "glmcore_conformance.llamacpp", "convert", str(llamacpp.root), str(d),
                        str(f32), "--outtype", "f32"], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    return d, f32


@pytest.mark.parametrize("qtype, kinds", [("Q4_K_M", {"Q4_K", "Q6_K"}), ("Q5_K_M", {"Q5_K", "Q6_K"}),
                                          ("Q6_K", {"Q6_K"})])
def test_k_quant_files_run_within_the_int4_row(llamacpp, small, qtype, kinds, tmp_path):
    """K-quant files (dequantized by gguf-py for the reference backend) give logits within the int4 row of the
    f32 source's, on torch and on cpu_int4, which packs a file with no Q4_K (nothing narrower than 5 bits) as
    int8 rows."""
    from glmcore_conformance.metrics import compare, out_of_bounds
    from glmcore_conformance.tolerances import TOLERANCES
    from test_gguf import _logits
    d, f32 = small
    q = _quantize(llamacpp, f32, qtype)
    assert kinds <= {t.tensor_type.name for t in gguf.GGUFReader(q).tensors}
    meta, _ = _packed(q, tmp_path)
    assert meta["options"]["linear_bits"] == (4 if "Q4_K" in kinds else 8)
    for backend in ("torch", "cpu_int4"):
        assert not out_of_bounds(compare(_logits(d, "torch"), _logits(q, backend)), TOLERANCES["int4"].bounds())


def _packed(path: Path, cache: Path):
    """cpu_int4's packed form of a GGUF (its default options for the file): (meta, mapped weights)."""
    from glmcore.backend import LoadOptions, registry
    from glmcore_plugins.cpu_int4.quant import read_packed
    c = open_gguf(path)
    backend = registry().get("cpu_int4")
    opts = backend.resolve(LoadOptions())
    opts.cache_dir = cache
    return read_packed(backend._packed_dir(c.config, c.weights, opts), c.config)


def test_llama_quantize_q4_k_m_keeps_its_q4_k_blocks_in_cpu_int4(llamacpp, small, tmp_path):
    """llama-quantize's Q4_K_M into cpu_int4: every Q4_K tensor held within the f16 rounding of its blocks' scale
    and min products of gguf-py's dequantization; its Q6_K layer matrices held as int8 rows; logits within the
    int4 row of the reference run of the same file."""
    from glmcore_conformance.metrics import compare, out_of_bounds
    from glmcore_conformance.tolerances import TOLERANCES
    from glmcore_plugins.cpu_int4.quant import dequantized_weights
    from test_gguf import _logits, q4_k_rounding_bound
    q = _quantize(llamacpp, small[1], "Q4_K_M")
    c = open_gguf(q)
    meta, blob = _packed(q, tmp_path)
    held = dequantized_weights(meta, np.asarray(blob))
    kinds = {n: c.weights.stored(n).qtype for n in held}
    q4_k = [n for n, k in kinds.items() if k == "Q4_K"]
    assert any(n.endswith("ffn_up.weight") for n in q4_k) and "embed.weight" in q4_k
    for name in q4_k:
        blocks = c.weights.stored(name).blocks()
        assert (np.abs(held[name] - c.weights[name]) <= q4_k_rounding_bound(blocks)).all(), name
    q6_k = sorted(n for n, k in kinds.items() if k == "Q6_K" and n != "lm_head.weight")
    assert q6_k and sorted(meta["options"]["int8_matrices"]) == q6_k
    assert not out_of_bounds(compare(_logits(q, "torch"), _logits(q, "cpu_int4")), TOLERANCES["int4"].bounds())


@pytest.fixture(scope="module")
def server_tool(llamacpp):
    """llama-server, built once into the tree if missing (bounded; the time is printed for the report)."""
    import time
    from glmcore_conformance.llamacpp import build_targets
    if not llamacpp.tool("llama-server").exists():
        t0 = time.monotonic()
        build_targets(llamacpp.root, ["llama-server"], timeout=3600)
        print(f"built llama-server in {time.monotonic() - t0:.0f} s")
    return llamacpp


# What llama.cpp renders for each family's GGUF (llama-server's default --jinja: the file's template through its own
# Jinja engine, with bos_token/eos_token, enable_thinking and OpenAI's tools; the leading BOS text stripped where
# the vocabulary adds BOS, [gMASK] for GLM-4-0414/4.5, and added back by /tokenize), and what is compared:
# - glm4-moe (GLM-4.6's template), glm4-moe-lite (GLM-4.7's): every conversation, tool calls/results and thinking
#   on/off.
# - glm4-0414: plain conversations and tools offered. Its template writes a call as an assistant turn with the tool
#   name as `metadata` and a result as role "observation"; llama.cpp keeps neither (OpenAI tool_calls and role
#   "tool" reach a template that ignores them, `metadata` is dropped), so a call and its result vanish from its
#   prompt. glmcore writes them as the template does (transformers' apply_chat_template on the template-native
#   messages): glmcore is right there, llama.cpp is not.
# - glm4 (GLM-4-9B-chat, chatglm arch): plain conversations. Its template reads tools from a message's own
#   `tools` key, which OpenAI's request cannot carry: llama.cpp renders no tools and "<|tool|>" (plain text, no
#   GLM-4 role) for results; glmcore writes the template's tools system turn and <|observation|>, as the model
#   was trained.
# - chatglm3: the checkpoint ships no template, so neither does the GGUF, and llama-server's default is then ChatML
#   (<|im_start|>user...), which ChatGLM3 never saw. Compared with llama.cpp's built-in `chatglm3` format
#   (--no-jinja --chat-template chatglm3; it takes no tools), which is the model's own (its build_chat_input).
# - glm4-moe-lite: llama-server keeps every earlier reply's thinking by default (--reasoning-preserve sets GLM-4.7's
#   clear_thinking=false); the template's own default, which transformers and vLLM render and glmcore follows,
#   clears it: compared with --no-reasoning-preserve (clear_thinking=true, the template's default rendering).
SERVER_ARGS = {"chatglm3": ["--no-jinja", "--chat-template", "chatglm3"], "glm4-moe-lite": ["--no-reasoning-preserve"]}
# - content parts ([{"type": "text", ...}]): GLM-4.5's template joins them itself (and llama.cpp passes them so);
#   the older templates take strings only, which glmcore's server joins the parts into before the format sees them.
COMPARED = {"glm4-moe": {"plain", "tools", "calls", "parts"}, "glm4-moe-lite": {"plain", "tools", "calls", "parts"},
            "glm4-0414": {"plain", "tools"}, "glm4": {"plain"}, "chatglm3": {"plain"}}


def _protocol(messages, tools) -> str:
    """What a conversation asks of a template: plain turns, tools offered, tool calls and results, content parts."""
    if any(not isinstance(m.get("content"), (str, type(None))) for m in messages):
        return "parts"
    if any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return "calls"
    return "tools" if tools else "plain"


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_rendered_as_llama_server(server_tool, converted, family):
    """llama-server's /apply-template on llama.cpp's own GGUF (the prompt its chat completions feed the model), then
    its /tokenize (BOS and special tokens as it feeds them), against glmcore's prompt ids for the same GGUF."""
    from glmcore.chat import chat_format_for
    from glmcore_conformance.llamacpp import LlamaServer
    _, f32 = converted[family]
    c = open_gguf(f32)
    tok = load_tokenizer(c.tokenizer_dir, c.config.family)
    fmt = chat_format_for(tok)
    if family == "chatglm3":        # why llama.cpp's built-in format: the file names none
        assert "tokenizer.chat_template" not in gguf.GGUFReader(f32).fields
    cases = [case for case in CONVERSATIONS if _protocol(*case[:2]) in COMPARED[family]]
    assert len(cases) >= 6
    wrong = []
    with LlamaServer(server_tool, f32, SERVER_ARGS.get(family, [])) as server:
        for messages, tools, kwargs in cases:
            prompt = server.apply_template(messages, tools, chat_template_kwargs=kwargs)
            theirs = server.tokenize(prompt)
            ours = fmt.configured(kwargs).encode_messages(messages, tools)
            if ours != theirs:
                wrong.append((messages, prompt, tok.decode(ours, skip_special=False)))
    if family == "glm4-moe-lite":   # llama-server's default, preserved thinking: glmcore's clear_thinking=false
        with LlamaServer(server_tool, f32, []) as server:
            for messages, tools, kwargs in cases:
                theirs = server.tokenize(server.apply_template(messages, tools, chat_template_kwargs=kwargs))
                if fmt.configured({**kwargs, "clear_thinking": False}).encode_messages(messages, tools) != theirs:
                    wrong.append((messages, "preserved", theirs))
    assert not wrong, (len(wrong), wrong[:2])
