"""Tokenizers against the real ChatGLM3 / GLM-4 vocabularies, and the synthetic ones we write."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import sentencepiece as spm
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glmcore.tokenizer import (FAMILIES, GLM4_PAT, GLM4_RANKS_FILE, CORPUS_FILE, SentencePieceTokenizer,
                               StreamDecoder, TiktokenTokenizer, TokenizerError, load_tokenizer,
                               read_rank_file, write_tokenizer)

MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"
needs_models = pytest.mark.skipif(not (MODELS / "chatglm3-6b" / "tokenizer.model").is_file(),
                                  reason=f"real tokenizer files not found under {MODELS}")

FIXED = [
    "", "a", "Hello, world!", "你好", "你好，世界！今天天气怎么样？", "こんにちは、世界。カタカナ",
    "😀👍🏽👨‍👩‍👧 emoji 🇨🇳", "   leading spaces", "trailing spaces   ", "a  b   c    d", "\t\ttabs\t",
    "line1\nline2\r\nline3\rline4\n\n\n", "\n", " ", "  ", "\r\n", "def f(x):\n    return x ** 2  # sq\n",
    "https://example.com/a/b?c=1&d=%20#frag", "<|user|>", "[gMASK]sop<|assistant|>", "<|endoftext|>",
    "混合 mixed 文本 text 123 4567 89.01", "Ünïcödé àccents ñ ß Ωμέγα Привет", "\u3000全角空格\u3000",
    "\x00\x01 control \x7f", "ﬁ ligature Å Å", "1234567890" * 3, "'s 't 're I'M", "{\"json\": [1, 2.5, null]}",
]


@pytest.fixture(scope="module")
def glm3():
    if not (MODELS / "chatglm3-6b" / "tokenizer.model").is_file():
        pytest.skip(f"real tokenizer files not found under {MODELS}")
    return load_tokenizer(MODELS / "chatglm3-6b", "chatglm3")


@pytest.fixture(scope="module")
def glm2():
    if not (MODELS / "chatglm3-6b" / "tokenizer.model").is_file():
        pytest.skip(f"real tokenizer files not found under {MODELS}")
    # chatglm2-6b's tokenizer.model is byte-identical to chatglm3-6b's (models/README.md).
    return load_tokenizer(MODELS / "chatglm3-6b", "chatglm2")


@pytest.fixture(scope="module")
def glm4():
    if not (MODELS / "glm-4-9b-chat-1m" / "tokenizer.model").is_file():
        pytest.skip(f"real tokenizer files not found under {MODELS}")
    return load_tokenizer(MODELS / "glm-4-9b-chat-1m", "glm4")


# ---------------------------------------------------------------- special tokens and ids


def test_chatglm3_special_ids(glm3):
    names = ["[MASK]", "[gMASK]", "[sMASK]", "sop", "eop", "<|system|>", "<|user|>", "<|assistant|>",
             "<|observation|>"]
    assert glm3.special_ids == {n: 64789 + i for i, n in enumerate(names)}
    assert glm3.n_vocab == 64798 and glm3.eos_id == 2 and glm3.pad_id == 0
    assert isinstance(glm3, SentencePieceTokenizer)


def test_chatglm2_registers_only_five(glm2):
    assert glm2.special_ids == {"[MASK]": 64789, "[gMASK]": 64790, "[sMASK]": 64791, "sop": 64792, "eop": 64793}
    assert glm2.n_vocab == 64794 and glm2.eos_id == 2


def test_glm4_special_ids_follow_config(glm4):
    cfg = json.loads((MODELS / "glm-4-9b-chat-1m" / "tokenizer_config.json").read_text())
    assert glm4.special_ids == {t["content"]: int(i) for i, t in cfg["added_tokens_decoder"].items()}
    assert list(glm4.special_ids) == cfg["additional_special_tokens"]
    assert glm4.special_ids["<|endoftext|>"] == 151329 == glm4.eos_id == glm4.pad_id
    assert glm4.n_vocab == 151343


def test_readme_pieces(glm3, glm4):
    assert glm3.encode("\n") == [30910, 13] and glm3.encode("你好") == [36474, 54591]
    assert glm4.encode("\n") == [198] and glm4.encode("你好") == [109377]


def test_glm4_same_for_both_checkpoints(glm4):
    other = load_tokenizer(MODELS / "glm-4-9b-chat", "glm4")
    for s in FIXED:
        assert other.encode(s) == glm4.encode(s)


# ---------------------------------------------------------------- encode / decode


@needs_models
@pytest.mark.parametrize("s", FIXED)
def test_fixed_strings(glm3, glm4, s):
    # SentencePiece: exactly THUDM's SPTokenizer.encode (sp.encode); identity normalizer, so
    # everything round-trips (no string here holds U+2581).
    sp = spm.SentencePieceProcessor(model_file=str(MODELS / "chatglm3-6b" / "tokenizer.model"))
    assert glm3.encode(s) == sp.encode(s)
    assert glm3.decode(glm3.encode(s)) == s
    assert glm4.decode(glm4.encode(s)) == s
    for tok in (glm3, glm4):
        assert not any(tok.is_special(i) for i in tok.encode(s)), "plain text never yields special ids"


def _thudm_glm4(path: Path) -> tiktoken.Encoding:
    """ChatGLM4Tokenizer's own construction: the special tokens registered in the Encoding."""
    ranks = {}
    for line in path.read_text().splitlines():
        if line.strip():
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    specials = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>",
                "<|begin_of_video|>", "<|end_of_video|>"]
    return tiktoken.Encoding(name="thudm", pat_str=GLM4_PAT, mergeable_ranks=ranks,
                             special_tokens={t: len(ranks) + i for i, t in enumerate(specials)})


def test_glm4_matches_thudm_construction(glm4):
    # THUDM's build_single_message: tokenizer.encode(message, disallowed_special=()).
    ref = _thudm_glm4(MODELS / "glm-4-9b-chat-1m" / "tokenizer.model")
    for s in FIXED + ["<|user|>hi<|assistant|>", "x<|endoftext|>y"]:
        assert glm4.encode(s) == ref.encode(s, disallowed_special=())
    ids = ref.encode("a<|user|>b", allowed_special="all")
    assert glm4.decode(ids, skip_special=False) == "a<|user|>b"


def test_literal_special_text_is_plain(glm3, glm4):
    for tok in (glm3, glm4):
        ids = tok.encode("<|user|>[gMASK]<sop>sop<|endoftext|>")
        assert not any(tok.is_special(i) for i in ids)
        assert tok.special_ids["<|user|>"] not in ids


def test_decode_special_handling(glm3, glm4):
    ids3 = [64790, 64792, 64795, 30910, 13, 36474, 54591, 64796]
    # As ChatGLMTokenizer.decode: one DecodePieces sequence with the names inline, so the "▁" after
    # <|user|> is not the sequence's first piece and stays a space.
    assert glm3.decode(ids3, skip_special=False) == "[gMASK]sop<|user|> \n 你好<|assistant|>"
    assert glm3.decode(ids3) == "\n 你好"
    assert glm3.decode([64796, 30910, 13], skip_special=False) == "<|assistant|> \n"
    ids4 = [151331, 151333, 151336, 198, 109377, 151337]
    assert glm4.decode(ids4, skip_special=False) == "[gMASK]<sop><|user|>\n你好<|assistant|>"
    assert glm4.decode(ids4) == "\n你好"
    # <unk>, <s>, </s> have no text (THUDM maps them to "") and count as special.
    for i in (0, 1, 2):
        assert glm3.is_special(i) and glm3.token_bytes(i) == b""
        assert glm3.decode([i, 36474]) == "你" == glm3.decode([i, 36474], skip_special=False)


def test_sentencepiece_only_u2581_does_not_roundtrip(glm3):
    # The identity normalizer keeps every character; only U+2581 itself, SentencePiece's space
    # symbol, comes back as a space.
    assert glm3.decode(glm3.encode("a\u2581b")) == "a b"
    assert glm3.decode(glm3.encode("\u2581")) == " "


def test_out_of_range_ids(glm3, glm4):
    for tok in (glm3, glm4):
        with pytest.raises(TokenizerError, match="out of range"):
            tok.decode([tok.n_vocab])
        with pytest.raises(TokenizerError):
            tok.decode([-1])


def test_token_bytes(glm3, glm4):
    s = "Hi 你好 😀\n  x"
    assert b"".join(glm4.token_bytes(i) for i in glm4.encode(s)) == s.encode()
    # SentencePiece pieces carry the dummy-prefix space; byte-fallback pieces are single bytes.
    assert b"".join(glm3.token_bytes(i) for i in glm3.encode(s)) == (" " + s).encode()
    assert glm3.token_bytes(13) == b"\n" and glm3.token_bytes(64795) == b""
    assert glm4.token_bytes(151336) == b""


text_st = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\u2581"), max_size=40)


@needs_models
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text_st)
def test_roundtrip_property(glm3, glm4, s):
    assert glm3.decode(glm3.encode(s)) == s
    assert glm4.decode(glm4.encode(s)) == s


# ---------------------------------------------------------------- streaming


def _stream(tok, ids) -> list[str]:
    dec = StreamDecoder(tok)
    return [dec.push(i) for i in ids] + [dec.flush()]


@pytest.mark.parametrize("s", ["你好👋！我是人工智能助手。", "😀👍🏽👨‍👩‍👧🇨🇳 ok", " 前导空格", "𠜎𠜱𠝹 rare 汉字 龘",
                               "line\n\n  indented", "a"])
def test_stream_equals_decode(glm3, glm4, s):
    for tok in (glm3, glm4):
        ids = tok.encode(s)
        pieces = _stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids) == s
        assert not any("\ufffd" in p for p in pieces), "never half a character"


def test_stream_with_specials(glm3, glm4):
    for tok in (glm3, glm4):
        sp = tok.special_ids
        ids = [sp["<|assistant|>"]] + tok.encode("\n") + tok.encode("你好😀") + [sp["<|user|>"]] + tok.encode("再见")
        pieces = _stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids)
        assert pieces[0] == ""


def test_stream_byte_fallback_is_held(glm3):
    ids = glm3.encode("𠜎")          # a rare character: four byte-fallback pieces
    assert len(ids) >= 4
    pieces = _stream(glm3, ids)
    assert pieces[-1] == "𠜎" or "".join(pieces) == "𠜎"
    assert all(p in ("", "𠜎") for p in pieces)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_stream_random_ids(glm3, glm4, data):
    # Arbitrary id sequences (invalid UTF-8, controls, unk, specials) still decode exactly as decode().
    for tok in (glm3, glm4):
        interesting = list(range(0, 300)) + list(range(tok.n_base - 5, tok.n_vocab))
        ids = data.draw(st.lists(st.one_of(st.sampled_from(interesting),
                                           st.integers(0, tok.n_vocab - 1)), max_size=30))
        assert "".join(_stream(tok, ids)) == tok.decode(ids)


@needs_models
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text_st)
def test_stream_random_text(glm3, glm4, s):
    for tok in (glm3, glm4):
        pieces = _stream(tok, tok.encode(s))
        assert "".join(pieces) == s
        assert not any("\ufffd" in p for p in pieces if "\ufffd" not in s)


# ---------------------------------------------------------------- loading errors


def test_missing_file(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.model not found"):
        load_tokenizer(tmp_path, "chatglm3")
    with pytest.raises(TokenizerError, match="unknown tokenizer family"):
        load_tokenizer(tmp_path, "llama")


def test_corrupt_files(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\x00\xffgarbage" * 10)
    with pytest.raises(TokenizerError, match="not a readable SentencePiece model"):
        load_tokenizer(tmp_path, "chatglm3")
    with pytest.raises(TokenizerError, match="base64 rank"):
        load_tokenizer(tmp_path, "glm4")
    (tmp_path / "tokenizer.model").write_text("IQ== 0\nIg== 2\n")
    with pytest.raises(TokenizerError, match="ranks are not"):
        load_tokenizer(tmp_path, "glm4")
    (tmp_path / "tokenizer.model").write_text("IQ== 0\nIg== 1\n")
    with pytest.raises(TokenizerError, match="single-byte tokens are missing"):
        load_tokenizer(tmp_path, "glm4")


def test_wrong_family(tmp_path, glm3):
    write_tokenizer("glm4", tmp_path / "g")
    with pytest.raises(TokenizerError, match="tokenizer_class"):
        load_tokenizer(tmp_path / "g", "chatglm3")
    (tmp_path / "g" / "tokenizer_config.json").unlink()
    with pytest.raises(TokenizerError, match="use family glm4"):
        load_tokenizer(tmp_path / "g", "chatglm3")
    write_tokenizer("chatglm3", tmp_path / "c")
    (tmp_path / "c" / "tokenizer_config.json").unlink()
    with pytest.raises(TokenizerError, match="SentencePiece"):
        load_tokenizer(tmp_path / "c", "glm4")


def test_bad_config(tmp_path):
    write_tokenizer("glm4", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        load_tokenizer(tmp_path, "glm4")
    cfg = {"tokenizer_class": "ChatGLM4Tokenizer",
           "added_tokens_decoder": {"151329": {"content": "<|endoftext|>"}}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match="different checkpoints"):
        load_tokenizer(tmp_path, "glm4")


# ---------------------------------------------------------------- synthetic tokenizers


@pytest.mark.parametrize("family", FAMILIES)
def test_write_synthetic(tmp_path, family):
    n = write_tokenizer(family, tmp_path / "a")
    write_tokenizer(family, tmp_path / "b")
    for f in ("tokenizer.model", "tokenizer_config.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), "deterministic"
    tok = load_tokenizer(tmp_path / "a", family)
    assert tok.n_vocab == n
    if family == "glm4":
        assert isinstance(tok, TiktokenTokenizer) and n == 2048 + 14
        assert list(tok.special_ids.values()) == list(range(2048, 2062)) and tok.eos_id == 2048
        cfg = json.loads((tmp_path / "a" / "tokenizer_config.json").read_text())
        assert cfg["tokenizer_class"] == "ChatGLM4Tokenizer" and "chat_template" in cfg
    else:
        assert n == 1000 + (5 if family == "chatglm2" else 9)
        assert tok.special_ids["[gMASK]"] == 1001 and tok.eos_id == 2 and tok.pad_id == 0
        assert tok.sp.is_byte(3) and tok.sp.id_to_piece(3 + 0x0A) == "<0x0A>"
    for s in FIXED:
        assert tok.decode(tok.encode(s)) == s
        assert "".join(_stream(tok, tok.encode(s))) == s


def test_synthetic_vocab_size(tmp_path):
    assert write_tokenizer("chatglm3", tmp_path / "s", vocab_size=1500) == 1509
    assert write_tokenizer("glm4", tmp_path / "g", vocab_size=512) == 526
    with pytest.raises(TokenizerError):
        write_tokenizer("glm4", tmp_path / "h", vocab_size=100)


@needs_models
def test_synthetic_sentencepiece_settings_match_real(tmp_path):
    pb = pytest.importorskip("sentencepiece.sentencepiece_model_pb2")
    write_tokenizer("chatglm3", tmp_path)
    ours, real = pb.ModelProto(), pb.ModelProto()
    ours.ParseFromString((tmp_path / "tokenizer.model").read_bytes())
    real.ParseFromString((MODELS / "chatglm3-6b" / "tokenizer.model").read_bytes())
    for f in ("name", "precompiled_charsmap", "add_dummy_prefix", "remove_extra_whitespaces", "escape_whitespaces"):
        assert getattr(ours.normalizer_spec, f) == getattr(real.normalizer_spec, f), f
    for f in ("model_type", "byte_fallback", "split_digits", "split_by_whitespace", "split_by_unicode_script",
              "split_by_number", "allow_whitespace_only_pieces", "treat_whitespace_as_suffix",
              "max_sentencepiece_length", "unk_id", "bos_id", "eos_id", "pad_id", "unk_surface"):
        assert getattr(ours.trainer_spec, f) == getattr(real.trainer_spec, f), f
    # Same piece layout as the real model: <unk> <s> </s>, then the 256 byte pieces.
    assert [p.piece for p in ours.pieces[:4]] == [p.piece for p in real.pieces[:4]]
    assert [p.type for p in ours.pieces[:259]] == [p.type for p in real.pieces[:259]]


def test_shipped_data_is_small_and_valid():
    assert GLM4_RANKS_FILE.stat().st_size < 200_000 and CORPUS_FILE.stat().st_size < 400_000
    ranks = read_rank_file(GLM4_RANKS_FILE)
    enc = tiktoken.Encoding(name="t", pat_str=GLM4_PAT, mergeable_ranks=ranks, special_tokens={})
    # A valid BPE: each token encodes to itself, so every prefix of the list is one too.
    assert all(enc._encode_single_piece(t) == [r] for t, r in ranks.items())


@needs_models
def test_real_glm4_rank_prefix_is_a_valid_bpe():
    # The claim behind truncating a rank list: checked here on the real GLM-4 file's first ranks.
    ranks = {t: r for t, r in read_rank_file(MODELS / "glm-4-9b-chat" / "tokenizer.model").items() if r < 3000}
    enc = tiktoken.Encoding(name="t", pat_str=GLM4_PAT, mergeable_ranks=ranks, special_tokens={})
    assert all(enc._encode_single_piece(t) == [r] for t, r in ranks.items())


@needs_models
def test_tokenizer_from(tmp_path):
    n = write_tokenizer("chatglm3", tmp_path / "c3", tokenizer_from=MODELS / "chatglm3-6b")
    assert n == 64798
    assert (tmp_path / "c3" / "tokenizer_config.json").read_bytes() == \
        (MODELS / "chatglm3-6b" / "tokenizer_config.json").read_bytes()
    # chatglm2 from chatglm3-6b's identical tokenizer.model gets a chatglm2 config.
    assert write_tokenizer("chatglm2", tmp_path / "c2", tokenizer_from=MODELS / "chatglm3-6b") == 64794
    assert "chatglm2" in json.loads((tmp_path / "c2" / "tokenizer_config.json").read_text())["name_or_path"]
    # glm-4-9b-chat ships no tokenizer_config.json: one is written with the real ids.
    assert write_tokenizer("glm4", tmp_path / "g", tokenizer_from=MODELS / "glm-4-9b-chat") == 151343
    cfg = json.loads((tmp_path / "g" / "tokenizer_config.json").read_text())
    real = json.loads((MODELS / "glm-4-9b-chat-1m" / "tokenizer_config.json").read_text())
    assert cfg["added_tokens_decoder"] == real["added_tokens_decoder"]
    with pytest.raises(TokenizerError, match="tokenizer.model not found"):
        write_tokenizer("chatglm2", tmp_path / "x", tokenizer_from=MODELS / "chatglm2-6b")
