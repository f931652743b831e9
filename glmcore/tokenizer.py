"""Tokenizers of the GLM families, behaving exactly like THUDM's tokenization_chatglm.py.

- chatglm2 / chatglm3: a SentencePiece BPE model (tokenizer.model). Text is encoded with
  `sp.encode` (THUDM's SPTokenizer.encode); special tokens are numbered after the SentencePiece
  vocabulary: `[MASK] [gMASK] [sMASK] sop eop` (+ `<|system|> <|user|> <|assistant|> <|observation|>`
  for ChatGLM3).
- glm4: a tiktoken rank file (tokenizer.model: "base64(token) rank" per line) with GLM-4's split
  pattern; 14 special tokens numbered after the ranks, `<|endoftext|>` first.

`encode` takes plain text and never yields a special token, whatever the text contains; chat
formats (glmcore.chat) add the special tokens themselves. Only numpy/sentencepiece/tiktoken/stdlib.
"""
from __future__ import annotations

import base64
import codecs
import json
import re
import shutil
from functools import cached_property
from pathlib import Path

import sentencepiece as spm
import tiktoken

from .errors import TokenizerError  # re-exported: glmcore.tokenizer.TokenizerError
from .files import is_regular, read_bounded
from .vocabulary import GLM4_PAT, GLM4_SPECIALS, Tokenizer  # re-exported: the interface every tokenizer has

FAMILIES = ("chatglm2", "chatglm3", "glm4")
# tokenizer.json + tokenizer_config.json (glmcore.hf_tokenizer)
HF_FAMILIES = ("glm4-0414", "glm-edge", "glm4-moe", "glm4-moe-lite")
DATA_DIR = Path(__file__).resolve().parent / "data"
MAX_TOKENIZER_BYTES = 256 << 20   # GLM-4's rank file is 2.6 MB; a bound so a huge or endless file is refused

# Order matters: the ids are assigned in this order after the base vocabulary.
SP_SPECIALS = {
    "chatglm2": ["[MASK]", "[gMASK]", "[sMASK]", "sop", "eop"],
    "chatglm3": ["[MASK]", "[gMASK]", "[sMASK]", "sop", "eop",
                 "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
}
DEFAULT_SP_PIECES = 1000     # synthetic SentencePiece vocabulary (incl. 3 control + 256 byte pieces)
DEFAULT_GLM4_RANKS = 2048    # synthetic GLM-4 ranks (a prefix of the shipped rank file)
CORPUS_FILE = DATA_DIR / "corpus.txt"
GLM4_RANKS_FILE = DATA_DIR / "glm4_ranks.tiktoken"


class SentencePieceTokenizer(Tokenizer):
    """ChatGLM2/3: THUDM's SPTokenizer. encode = sp.encode(text) (dummy prefix "▁" included)."""

    def __init__(self, path: Path, family: str):
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except Exception as e:   # sentencepiece raises RuntimeError/OSError with a long message
            hint = " (it is a tiktoken rank file: use family glm4)" if is_tiktoken_file(path) else ""
            raise TokenizerError(f"{path} is not a readable SentencePiece model{hint}: "
                                 f"{str(e).splitlines()[0] if str(e) else type(e).__name__}; "
                                 "copy tokenizer.model from the original checkpoint again") from None
        n = self.sp.get_piece_size()
        try:                    # a piece that is not UTF-8 would fail every decode that meets it
            self.sp.id_to_piece(list(range(n)))
        except UnicodeDecodeError as e:
            raise TokenizerError(f"{path} holds a piece that is not UTF-8 ({e.reason} at byte {e.start}); the file is "
                                 "corrupt, copy tokenizer.model from the original checkpoint again") from None
        if self.sp.eos_id() < 0 or self.sp.unk_id() < 0 or n < 259:
            raise TokenizerError(f"{path} is a SentencePiece model without <unk>/</s> or byte pieces, not a "
                                 "ChatGLM tokenizer; copy tokenizer.model from the original checkpoint again")
        super().__init__(family, n, SP_SPECIALS[family], eos_id=self.sp.eos_id(), pad_id=self.sp.unk_id(),
                         path=path)

    @cached_property
    def _kinds(self) -> list[str]:
        # Per-piece kind: "byte" (<0xNN>), "none" (<unk>, <s>, </s>: no text), else "normal".
        sp = self.sp
        return ["byte" if sp.is_byte(i) else "none" if sp.is_control(i) or sp.is_unknown(i) else "normal"
                for i in range(self.n_base)]

    def is_special(self, id: int) -> bool:
        # Besides the registered tokens, <unk>, <s> and </s> have no text: THUDM's tokenizer maps
        # them to "" (its convert_id_to_token), so they count as special here.
        return id in self.special_names or (0 <= id < self.n_base and self._kinds[id] == "none")

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes str, not {type(text).__name__}")
        return self.sp.encode(text)

    def encode_prompt(self, text: str) -> list[int]:
        """ChatGLM2/3's tokenizer (THUDM's ChatGLMTokenizer, encode_special_tokens=False) keeps a prompt's
        spelled-out special tokens text."""
        return self.encode(text)

    def decode(self, ids, skip_special: bool = True) -> str:
        ids = self._check_ids(ids)
        if skip_special:
            # The text ids as one SentencePiece sequence: only its first piece loses the
            # dummy-prefix space.
            return self.sp.decode([i for i in ids if not self.is_special(i)])
        # As ChatGLMTokenizer.decode (transformers' _decode -> SentencePiece DecodePieces): special
        # tokens by name, <unk>/<s>/</s> as "", all in one sequence.
        pieces = [self.special_names[i] if i in self.special_names else "" if self._kinds[i] == "none"
                  else self.sp.id_to_piece(i) for i in ids]
        return self.sp.decode_pieces(pieces)

    def token_bytes(self, id: int) -> bytes:
        id = self._check_ids([id])[0]
        if self.is_special(id):
            return b""
        piece = self.sp.id_to_piece(id)
        if self._kinds[id] == "byte":
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()


class TiktokenTokenizer(Tokenizer):
    """GLM-4: ChatGLM4Tokenizer. encode = tiktoken encode with no special tokens allowed."""

    def __init__(self, path: Path, family: str = "glm4"):
        ranks = read_rank_file(path)
        super().__init__(family, len(ranks), GLM4_SPECIALS, eos_id=len(ranks), pad_id=len(ranks), path=path)
        self._bytes = [b""] * len(ranks)
        for tok, r in ranks.items():
            self._bytes[r] = tok
        self.enc = tiktoken.Encoding(name=f"glm4-{len(ranks)}", pat_str=GLM4_PAT, mergeable_ranks=ranks,
                                     special_tokens={})

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes str, not {type(text).__name__}")
        return self.enc.encode_ordinary(text)

    def decode(self, ids, skip_special: bool = True) -> str:
        # As ChatGLM4Tokenizer.convert_tokens_to_string: join token bytes, decode with errors="replace";
        # a special token (when kept) flushes the bytes before it and is inserted by name.
        ids = self._check_ids(ids)
        text, buf = [], bytearray()
        for i in ids:
            if i >= self.n_base:
                if skip_special:
                    continue
                text.append(buf.decode("utf-8", "replace"))
                buf = bytearray()
                text.append(self.special_names[i])
            else:
                buf += self._bytes[i]
        text.append(buf.decode("utf-8", "replace"))
        return "".join(text)

    def token_bytes(self, id: int) -> bytes:
        id = self._check_ids([id])[0]
        return self._bytes[id] if id < self.n_base else b""


class StreamDecoder:
    """Incremental detokenizer: push(id) returns the text that id completes. The concatenation of
    all pushes and the final flush() equals tokenizer.decode(ids, skip_special=True); it never
    emits part of a character (incomplete UTF-8 is held back), special tokens add nothing."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        if isinstance(tokenizer, SentencePieceTokenizer):
            self._first = True        # the first text piece loses its leading "▁" (dummy prefix)
            self._run: list[int] = []  # pending byte-fallback pieces, decoded together as SentencePiece does
            self._run_pos = 0          # bytes of the run already emitted
            self._run_text = ""
        else:
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, id: int) -> str:
        id = int(id)
        tok = self.tok
        if not 0 <= id < tok.n_vocab:
            tok._check_ids([id])
        if tok.is_special(id):       # no text, and skipped by decode() as if absent
            return ""
        if not isinstance(tok, SentencePieceTokenizer):
            return self._utf8.decode(tok._bytes[id])
        if tok._kinds[id] == "byte":
            self._first = False
            self._run.append(id)
            return self._run_partial()
        out = self._end_run()        # any other piece ends a byte run
        piece = tok.sp.id_to_piece(id)
        if self._first and piece.startswith("\u2581"):
            piece = piece[1:]        # the dummy prefix of the sequence's first piece
        self._first = False
        return out + piece.replace("\u2581", " ")

    def flush(self) -> str:
        """Text still held back (an incomplete UTF-8 sequence becomes U+FFFD, as decode() does)."""
        if isinstance(self.tok, SentencePieceTokenizer):
            return self._end_run()
        return self._utf8.decode(b"", final=True)

    def _run_partial(self) -> str:
        # Emit the complete, valid characters at the start of the pending bytes; leave the rest
        # (incomplete or invalid) for _end_run, where SentencePiece itself decodes the run.
        data = bytes(int(self.tok.sp.id_to_piece(i)[3:5], 16) for i in self._run)
        i, out = self._run_pos, []
        while i < len(data):
            b = data[i]
            n = 1 if b < 0x80 else 2 if 0xC2 <= b <= 0xDF else 3 if 0xE0 <= b <= 0xEF else 4 if 0xF0 <= b <= 0xF4 else 0
            if n == 0 or i + n > len(data):
                break
            try:
                out.append(data[i:i + n].decode("utf-8"))
            except UnicodeDecodeError:
                break
            i += n
        self._run_pos = i
        text = "".join(out)
        self._run_text += text
        return text

    def _end_run(self) -> str:
        if not self._run:
            return ""
        full = self.tok.sp.decode(self._run)
        done = self._run_text
        self._run, self._run_pos, self._run_text = [], 0, ""
        assert full.startswith(done), (full, done)
        return full[len(done):]


# ----------------------------------------------------------------------------- files


def is_tiktoken_file(path: Path) -> bool:
    if not is_regular(path):       # a FIFO would block open() forever; a device never ends
        return False
    try:
        with open(path, "rb") as f:
            line = f.readline(200)
    except OSError:
        return False
    return re.fullmatch(rb"[A-Za-z0-9+/=]+ \d+\r?\n?", line) is not None


def read_rank_file(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken rank file; ranks must be 0..n-1 and include all 256 single bytes."""
    ranks: dict[bytes, int] = {}
    if not is_regular(path):
        raise TokenizerError(f"{path} is not a regular file; copy tokenizer.model from the original checkpoint")
    data = read_bounded(path, MAX_TOKENIZER_BYTES, "the tokenizer file", "copy tokenizer.model from the original "
                        "checkpoint", TokenizerError)
    if data[:1] == b"\n" and not is_tiktoken_file(path):   # a protobuf: SentencePiece's ModelProto
        raise TokenizerError(f"{path} is not a tiktoken rank file (it looks like a SentencePiece model: "
                             "use family chatglm2/chatglm3, or copy GLM-4's tokenizer.model)")
    for no, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            ranks[base64.b64decode(tok, validate=True)] = int(rank)
        except ValueError:
            raise TokenizerError(f"{path} line {no} is not 'base64 rank'; copy tokenizer.model "
                                 "from the original GLM-4 checkpoint again") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks are not 0..{len(ranks) - 1} without gaps or repeats; the file is "
                             "corrupt, copy it from the original checkpoint again")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{path}: {len(missing)} single-byte tokens are missing (e.g. {missing[0]:#04x}), so "
                             "some text cannot be encoded; use a complete byte-level rank file")
    return ranks


def load_tokenizer(model_dir, family: str) -> Tokenizer:
    """Load model_dir/tokenizer.model as the given family (tokenizer_config.json, if present, is checked);
    the glm4-0414/glm-edge families read tokenizer.json (glmcore.hf_tokenizer)."""
    if family in HF_FAMILIES:
        from .hf_tokenizer import HFTokenizer
        if not (Path(model_dir) / "tokenizer.json").is_file():
            raise TokenizerError(f"{Path(model_dir) / 'tokenizer.json'} not found: copy tokenizer.json and "
                                 f"tokenizer_config.json from the original {family} checkpoint into the model directory")
        return HFTokenizer(Path(model_dir), family)
    if family not in FAMILIES:
        raise TokenizerError(f"unknown tokenizer family {family!r}: use one of {', '.join(FAMILIES + HF_FAMILIES)}")
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.model"
    if not is_regular(path):        # missing, or a FIFO/device that would hang or never end
        raise TokenizerError(f"{path} not found (or not a regular file): copy tokenizer.model from the original {family} checkpoint "
                             "into the model directory (or write a synthetic one with `glmcore make-model`)")
    cfg = _read_config(model_dir / "tokenizer_config.json")
    cls = cfg.get("tokenizer_class")
    if cls is not None and not isinstance(cls, str):
        raise TokenizerError(f"{model_dir / 'tokenizer_config.json'}: tokenizer_class is not a string; "
                             "copy the file from the original checkpoint or delete it")
    want = "ChatGLM4Tokenizer" if family == "glm4" else "ChatGLMTokenizer"
    if cls and cls != want:
        raise TokenizerError(f"{model_dir / 'tokenizer_config.json'} names tokenizer_class {cls!r} but family "
                             f"{family} uses {want}; pass the right family or fix the file")
    tok = TiktokenTokenizer(path) if family == "glm4" else SentencePieceTokenizer(path, family)
    # The config's added tokens (GLM-4) must agree with the numbering derived from the vocabulary.
    added = cfg.get("added_tokens_decoder") or {}
    if not isinstance(added, dict):
        raise TokenizerError(f"{model_dir / 'tokenizer_config.json'}: added_tokens_decoder is not an object; "
                             "copy the file from the original checkpoint or delete it")
    for id_str, entry in added.items():
        name = entry.get("content") if isinstance(entry, dict) else None
        if isinstance(name, str) and name in tok.special_ids and str(tok.special_ids[name]) != id_str:
            raise TokenizerError(f"{model_dir / 'tokenizer_config.json'} puts {name} at id {id_str} but "
                                 f"{path} implies {tok.special_ids[name]}; the two files are from different "
                                 "checkpoints, copy both from the same one")
    return tok


def _read_config(path: Path) -> dict:
    if not is_regular(path):
        return {}
    try:
        cfg = json.loads(read_bounded(path, MAX_TOKENIZER_BYTES, "tokenizer_config.json", "copy it from the "
                                      "original checkpoint", TokenizerError).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise TokenizerError(f"{path} is not valid JSON ({e}); copy it from the original checkpoint "
                             "or delete it") from None
    if not isinstance(cfg, dict):
        raise TokenizerError(f"{path} is not a JSON object; copy it from the original checkpoint or delete it")
    return cfg


# ----------------------------------------------------------------------------- synthetic tokenizers


def write_tokenizer(family: str, out_dir, vocab_size: int | None = None, tokenizer_from=None) -> int:
    """Write tokenizer.model + tokenizer_config.json for `family` into out_dir, in the layout the
    real checkpoints ship; return n_vocab (special tokens included).

    tokenizer_from=DIR copies that checkpoint's tokenizer files instead. Otherwise the tokenizer is
    synthetic: chatglm2/3 a SentencePiece BPE trained on glmcore/data/corpus.txt with the real
    model's normalizer settings (vocab_size pieces, default 1000); glm4 the first vocab_size ranks
    (default 2048) of glmcore/data/glm4_ranks.tiktoken, a byte-level BPE trained on the same text.
    """
    if family not in FAMILIES:
        raise TokenizerError(f"unknown tokenizer family {family!r}: use one of {', '.join(FAMILIES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is not None:
        if vocab_size is not None:
            raise TokenizerError("vocab_size cannot be combined with tokenizer_from: a copied tokenizer keeps "
                                 "its own vocabulary")
        src = Path(tokenizer_from)
        if not (src / "tokenizer.model").is_file():
            raise TokenizerError(f"{src / 'tokenizer.model'} not found: point tokenizer_from at a checkpoint "
                                 "directory that has its tokenizer.model (e.g. chatglm3-6b for chatglm2 too)")
        if (src / "tokenizer.model").resolve() != (out / "tokenizer.model").resolve():
            shutil.copyfile(src / "tokenizer.model", out / "tokenizer.model")
        cfg = _read_config(src / "tokenizer_config.json")
        # Reuse the source config only when it belongs to this family (chatglm2 from chatglm3's file).
        if cfg and _config_family(cfg) == family:
            if (src / "tokenizer_config.json").resolve() != (out / "tokenizer_config.json").resolve():
                shutil.copyfile(src / "tokenizer_config.json", out / "tokenizer_config.json")
        else:
            n_base = load_tokenizer(out, family).n_base if family == "glm4" else 0
            _write_config(out, family, n_base, name="THUDM/" + {"chatglm2": "chatglm2-6b", "chatglm3": "chatglm3-6b",
                                                                 "glm4": "glm-4-9b-chat"}[family])
        return load_tokenizer(out, family).n_vocab

    if family == "glm4":
        ranks = GLM4_RANKS_FILE.read_bytes().splitlines(keepends=True)
        n = DEFAULT_GLM4_RANKS if vocab_size is None else int(vocab_size)
        if not 256 <= n <= len(ranks):
            raise TokenizerError(f"glm4 synthetic vocab_size {n} out of range: use 256..{len(ranks)} ranks")
        # Every prefix of a BPE rank list is itself a valid BPE (each token still encodes to itself).
        (out / "tokenizer.model").write_bytes(b"".join(ranks[:n]))
        _write_config(out, family, n, name="glmcore/synthetic-glm4")
    else:
        n = DEFAULT_SP_PIECES if vocab_size is None else int(vocab_size)
        (out / "tokenizer.model").write_bytes(train_sentencepiece(n))
        _write_config(out, family, 0, name=f"glmcore/synthetic-{family}")
    return load_tokenizer(out, family).n_vocab


def train_sentencepiece(n_pieces: int = DEFAULT_SP_PIECES, corpus: Path = CORPUS_FILE,
                        lines: list[str] | None = None, n_chars: int | None = None) -> bytes:
    """A SentencePiece BPE model with the real chatglm3 tokenizer.model's settings (identity
    normalizer, dummy prefix, extra whitespace kept, byte fallback, digits split, whitespace-only
    pieces); deterministic (one thread, no sampling) and well under a second for ~1000 pieces.
    Trained on `lines` if given, else on the lines of `corpus`; about n_chars characters (default
    2/5 of the non-byte pieces) are kept as pieces, the rarer ones fall back to bytes."""
    import io
    source, hint = "the given lines", "raise n_pieces or lower n_chars"
    if lines is None:
        source, hint = str(corpus), "choose a vocab_size between 700 and 2000"
        lines = [ln for ln in corpus.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if n_chars is None:
        n_chars = (n_pieces - 259) * 2 // 5
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=model, model_type="bpe", vocab_size=n_pieces,
            # Normalizer: exactly the real model's (no NFKC, nothing stripped or collapsed).
            normalization_rule_name="identity", add_dummy_prefix=True, remove_extra_whitespaces=False,
            escape_whitespaces=True,
            # Trainer: the real model's choices, except coverage: the small corpus has many rare
            # Chinese characters, which go to byte fallback instead of taking pieces.
            byte_fallback=True, split_digits=True, split_by_unicode_script=True, split_by_number=True,
            split_by_whitespace=True, allow_whitespace_only_pieces=True, max_sentencepiece_length=16,
            treat_whitespace_as_suffix=False, character_coverage=_coverage(lines, n_chars),
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            input_sentence_size=0, shuffle_input_sentence=False, num_threads=1, minloglevel=2,
            vocabulary_output_piece_score=True, hard_vocab_limit=True)
    except RuntimeError as e:
        raise TokenizerError(f"cannot train a {n_pieces}-piece SentencePiece model on {source}: "
                             f"{str(e).splitlines()[0]}; {hint}") from None
    return model.getvalue()


def _coverage(lines: list[str], n_chars: int) -> float:
    """The character_coverage that keeps about n_chars characters as pieces (the rest of the
    ~900 distinct characters of the corpus, mostly rare Chinese ones, fall back to bytes), leaving
    the remaining pieces for merges."""
    counts: dict[str, int] = {}
    for ln in lines:
        for ch in "\u2581" + ln.replace(" ", "\u2581"):
            counts[ch] = counts.get(ch, 0) + 1
    freq = sorted(counts.values(), reverse=True)
    k = max(1, min(n_chars, len(freq)))
    return min(0.9999, max(0.98, sum(freq[:k]) / sum(freq)))   # SentencePiece accepts 0.98..1


def _config_family(cfg: dict) -> str | None:
    cls = cfg.get("tokenizer_class")
    if cls == "ChatGLM4Tokenizer":
        return "glm4"
    if cls == "ChatGLMTokenizer":
        return "chatglm2" if "chatglm2" in str(cfg.get("name_or_path", "")).lower() else "chatglm3"
    return None


def _write_config(out: Path, family: str, n_base: int, name: str) -> None:
    """tokenizer_config.json as the real checkpoints ship it (GLM-4's with its ids moved to n_base)."""
    if family == "glm4":
        cfg = json.loads((DATA_DIR / "glm4_tokenizer_config.json").read_text(encoding="utf-8"))
        cfg["added_tokens_decoder"] = {
            str(n_base + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                              "single_word": False, "special": True}
            for i, t in enumerate(GLM4_SPECIALS)}
    else:
        cfg = {"name_or_path": name, "remove_space": False, "do_lower_case": False,
               "tokenizer_class": "ChatGLMTokenizer",
               "auto_map": {"AutoTokenizer": ["tokenization_chatglm.ChatGLMTokenizer", None]}}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=2) + "\n",
                                               encoding="utf-8")
