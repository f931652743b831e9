"""Hugging Face `tokenizer.json` + `tokenizer_config.json` (GLM-4-0414, GLM-Z1, GLM-Edge, the -hf
checkpoints), read with the `tokenizers` library: no remote code.

The special tokens, the eos/pad tokens and the chat template come from the files. `encode` keeps glmcore's
contract (plain text never yields a special token: the pre-tokenizer and the BPE model run without the
added-token split); prompts rendered from the checkpoint's template are encoded the way transformers'
apply_chat_template encodes them (`encode_rendered`: special tokens in the rendered text are matched).

Also writes such files from a tiktoken rank file exactly as transformers' TikTokenConverter converts GLM-4's
tokenizer (for synthetic checkpoints and tests).
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from .errors import TokenizerError
from .files import read_json_object
from .vocabulary import GLM4_PAT, Tokenizer

# Templates modelled on the published files (the real files are not in this workspace; see the tests).
# GLM-4-0414: [gMASK]<sop>, system messages first, tools without GLM-4's built-in system text.
GLM4_0414_TEMPLATE = (
    "[gMASK]<sop>{%- if tools -%}<|system|>\n# 可用工具\n{% for tool in tools %}"
    "{%- set function = tool.function if tool.get(\"function\") else tool %}\n\n## {{ function.name }}\n\n"
    "{{ function | tojson(indent=4, ensure_ascii=False) }}\n在调用上述函数时，请使用 Json 格式表示调用的参数。"
    "{%- endfor %}{%- endif -%}"
    "{%- for msg in messages %}{%- if msg.role == 'system' %}<|system|>\n{{ msg.content }}{%- endif %}{%- endfor %}"
    "{%- for message in messages if message.role != 'system' %}{%- set role = message['role'] %}"
    "{%- set content = message['content'] %}{%- set meta = message.get(\"metadata\", \"\") %}"
    "{%- if role == 'user' %}<|user|>\n{{ content }}"
    "{%- elif role == 'assistant' and not meta %}<|assistant|>\n{{ content }}"
    "{%- elif role == 'assistant' and meta %}<|assistant|>{{ meta }} \n{{ content }}"
    "{%- elif role == 'observation' %}<|observation|>\n{{ content }}{%- endif %}{%- endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# GLM-Z1-0414: as GLM-4-0414, but earlier replies keep only what follows their </think>, and the generation
# prompt opens the thinking ("<|assistant|>\n<think>": Z1 always thinks; its maintainers' advice for a reply
# without thinking is to delete that <think> from the template's last line, zai-org/GLM-4#770).
GLM_Z1_TEMPLATE = GLM4_0414_TEMPLATE.replace(
    "{%- set content = message['content'] %}",
    "{%- set content = message['content'] %}{%- if role == 'assistant' %}"
    "{%- set content = content.split('</think>')[-1].strip() %}{%- endif %}").replace(
    "{% if add_generation_prompt %}<|assistant|>{% endif %}", "{% if add_generation_prompt %}<|assistant|>\n<think>{% endif %}")
# GLM-Edge: no [gMASK]<sop>; the generation prompt is "<|assistant|>\n".
GLM_EDGE_TEMPLATE = (
    "{% for item in messages %}{% if item['role'] == 'system' %}<|system|>\n{{ item['content'] }}"
    "{% elif item['role'] == 'user' %}<|user|>\n{{ item['content'] }}"
    "{% elif item['role'] == 'assistant' %}<|assistant|>\n{{ item['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@lru_cache(maxsize=1)
def _byte_encoder() -> dict[int, str]:
    """GPT-2's bytes_to_unicode: the printable stand-in of each byte in a byte-level BPE vocabulary."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    return {v: k for k, v in _byte_encoder().items()}


def _token_str(b: bytes) -> str:
    enc = _byte_encoder()
    return "".join(enc[x] for x in b)


def tokenizer_json(ranks: dict[bytes, int], specials: list[str], prefix: list[str] | None = None) -> dict:
    """tokenizer.json of a tiktoken rank file as transformers' TikTokenConverter writes it (vocab and merges
    from the ranks, GLM-4's split pattern, byte-level, ignore_merges), the special tokens numbered after the
    ranks, and a post-processor that prepends `prefix` (GLM-4-0414: [gMASK]<sop>) when asked to."""
    merges = []
    for tok, rank in ranks.items():
        local = [(tok[:i], tok[i:], rank) for i in range(1, len(tok)) if tok[:i] in ranks and tok[i:] in ranks]
        local.sort(key=lambda x: (ranks[x[0]], ranks[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: m[2])
    n = len(ranks)
    special_ids = {t: n + i for i, t in enumerate(specials)}
    added = [{"id": special_ids[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for t in specials]
    post = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    if prefix:
        seq = [{"SpecialToken": {"id": t, "type_id": 0}} for t in prefix]
        post = {"type": "TemplateProcessing", "single": seq + [{"Sequence": {"id": "A", "type_id": 0}}],
                "pair": seq + [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {t: {"id": t, "ids": [special_ids[t]], "tokens": [t]} for t in prefix}}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": GLM4_PAT}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {_token_str(t): r for t, r in sorted(ranks.items(), key=lambda kv: kv[1])},
                  "merges": [[_token_str(a), _token_str(b)] for a, b, _ in merges]},
    }


def write_hf_tokenizer(out: Path, ranks: dict[bytes, int], specials: list[str], template: str,
                       prefix: list[str] | None, name: str, max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json in the layout of the published GLM-4-0414/GLM-Edge files."""
    tj = tokenizer_json(ranks, specials, prefix)
    (out / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    cfg = {
        "added_tokens_decoder": {str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized", "rstrip",
                                                                    "single_word", "special")}
                                 for a in tj["added_tokens"]},
        "additional_special_tokens": list(specials),
        "chat_template": template, "clean_up_tokenization_spaces": False, "do_lower_case": False,
        "eos_token": "<|endoftext|>", "extra_special_tokens": {}, "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": max_length, "pad_token": "<|endoftext|>", "padding_side": "left", "remove_space": False,
        "tokenizer_class": "PreTrainedTokenizerFast", "name_or_path": name,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=2) + "\n",
                                               encoding="utf-8")


MAX_JSON_BYTES = 256 << 20      # GLM-4-0414's tokenizer.json is ~20 MB


def _read_json(path: Path, what: str) -> dict:
    # bounded: a tokenizer.json is a few MB; a huge one is refused before it is parsed
    return read_json_object(path, MAX_JSON_BYTES, what, f"copy {what} from the original checkpoint again",
                            TokenizerError)


def _token_name(v) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _stop_ids(model_dir: Path, tok) -> list[int]:
    """generation_config.json's eos_token_id, else config.json's (what transformers' generate stops on), else
    the tokenizer's eos; ids outside the vocabulary are dropped."""
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        try:
            eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError, RecursionError):
            continue            # config.json's own reader reports a broken file; generation_config is optional
        ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < tok.n_vocab]
        if ids:
            return ids
    return [tok.eos_id]


class HFTokenizer(Tokenizer):
    """A byte-level BPE tokenizer.json (every GLM checkpoint that ships one)."""

    def __init__(self, model_dir: Path, family: str):
        import tokenizers
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        raw = _read_json(path, "tokenizer.json")
        try:
            self.tk = tokenizers.Tokenizer.from_str(json.dumps(raw))
        except Exception as e:      # the Rust side raises a bare Exception with its parse error
            raise TokenizerError(f"{path} is not a tokenizer the `tokenizers` library can read "
                                 f"({str(e)[:100]}); copy it from the original checkpoint again") from None
        if (raw.get("model") or {}).get("type") != "BPE" or (raw.get("decoder") or {}).get("type") != "ByteLevel":
            raise TokenizerError(f"{path}: only byte-level BPE tokenizers (as every GLM checkpoint ships) are "
                                 "supported; this one is "
                                 f"{(raw.get('model') or {}).get('type')}/{(raw.get('decoder') or {}).get('type')}")
        cfg_path = model_dir / "tokenizer_config.json"
        self.config = _read_json(cfg_path, "tokenizer_config.json") if cfg_path.is_file() else {}
        self.family, self.path = family, path
        n = self.tk.get_vocab_size(with_added_tokens=True)
        vocab = self.tk.get_vocab(with_added_tokens=True)
        if not vocab or sorted(vocab.values()) != list(range(len(vocab))):
            raise TokenizerError(f"{path}: token ids are not 0..{n - 1} without gaps or repeats; the file is "
                                 "corrupt, copy it from the original checkpoint again")
        self.n_vocab = len(vocab)
        every = [a for a in raw.get("added_tokens") or [] if isinstance(a, dict)
                 and isinstance(a.get("content"), str) and isinstance(a.get("id"), int)]
        for a in every:      # tokenizers reads the text as its own id: a different one here would be used silently
            if vocab.get(a["content"]) != a["id"]:
                raise TokenizerError(f"{path}: added token {a['content']!r} has id {a['id']} in added_tokens but "
                                     f"{vocab.get(a['content'])} in the vocabulary; the file is corrupt, copy it from "
                                     "the original checkpoint again")
        added = {a["content"]: a["id"] for a in every if a.get("special")}
        # every added token, special or not, is one token wherever its text appears: GLM-4.5+ ship <tool_call>,
        # </tool_call> (at least) as added tokens that are not special (decoding keeps their text)
        self._tag_ids = {a["content"]: a["id"] for a in every}
        self.special_ids = added
        self.special_names = {i: t for t, i in added.items()}
        self.n_base = min(added.values(), default=self.n_vocab)
        dec = byte_decoder()
        self._bytes = [b""] * self.n_vocab
        for tok, i in vocab.items():
            if i not in self.special_names:
                try:
                    self._bytes[i] = bytes(dec[c] for c in tok)
                except KeyError:       # a non-special added token: its text as UTF-8 (tokenizers does the same)
                    self._bytes[i] = tok.encode()

        def special(key: str, default: str | None) -> int | None:
            name = _token_name(self.config.get(key)) or default
            if name is None:
                return None
            if name not in vocab:
                raise TokenizerError(f"{cfg_path}: {key} {name!r} is not a token of {path}; the two files are "
                                     "from different checkpoints, copy both from the same one")
            return vocab[name]

        self.eos_id = special("eos_token", "<|endoftext|>" if "<|endoftext|>" in vocab else None)
        if self.eos_id is None:
            raise TokenizerError(f"{cfg_path}: no eos_token and no <|endoftext|> in {path}; copy tokenizer_config.json "
                                 "from the original checkpoint")
        pad = special("pad_token", None)
        self.pad_id = self.eos_id if pad is None else pad
        # What apply_chat_template passes to the template besides the messages (transformers' special tokens map).
        self.template_vars = {k: _token_name(self.config.get(k)) for k in
                              ("bos_token", "eos_token", "unk_token", "pad_token") if _token_name(self.config.get(k))}
        tmpl = self.config.get("chat_template")
        if isinstance(tmpl, list):      # [{"name": "default", "template": ...}, ...]
            tmpl = next((t.get("template") for t in tmpl if isinstance(t, dict) and t.get("name") == "default"), None)
        jinja = model_dir / "chat_template.jinja"      # transformers >= 4.50 writes the template beside the config
        if jinja.is_file():
            try:
                tmpl = jinja.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"{jinja}: unreadable ({e}); copy it from the original checkpoint again") from None
        if tmpl is not None and not isinstance(tmpl, str):
            raise TokenizerError(f"{cfg_path}: chat_template is not a string; copy the file from the original checkpoint")
        self.chat_template: str | None = tmpl
        self.stop_ids = _stop_ids(model_dir, self)
        # text a catastrophic pre-tokenizer regex, such as (a+)+$, fails on: refused now, not on a user's prompt
        for probe in ("a" * 40 + "!", " " * 40 + "!", "1" * 40 + "x", "你好" * 20 + "!"):
            self.encode(probe)

    @property
    def tag_ids(self) -> dict[str, int]:
        return self._tag_ids

    def encode(self, text: str) -> list[int]:
        """Plain text to ids; text that spells a special token stays text (glmcore's contract)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes str, not {type(text).__name__}")
        if not text:
            return []
        tk = self.tk

        def run():
            t = tk.normalizer.normalize_str(text) if tk.normalizer is not None else text
            pieces = tk.pre_tokenizer.pre_tokenize_str(t) if tk.pre_tokenizer is not None else [(t, None)]
            return [x.id for piece, _ in pieces for x in tk.model.tokenize(piece)]
        return self._guarded(run, text)

    def encode_rendered(self, text: str) -> list[int]:
        """A rendered chat template to ids as apply_chat_template(tokenize=True) does: special tokens in the
        text are matched, no post-processor tokens are added (the template writes its own prefix)."""
        return self._guarded(lambda: self.tk.encode(text, add_special_tokens=False).ids, text)

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt as tokenizer(text) reads it, less the post-processor's prefix: special tokens matched."""
        return self.encode_rendered(text)

    def _guarded(self, fn, text: str):
        """fn() with the `tokenizers` library's failures -- a pre-tokenizer regex that backtracks past Oniguruma's
        limit raises pyo3's PanicException, which is not even an Exception -- as a one-line TokenizerError."""
        try:
            return fn()
        except (KeyboardInterrupt, SystemExit, MemoryError):
            raise
        except BaseException as e:
            detail = (str(e).splitlines() or [""])[0][:120]
            raise TokenizerError(f"{self.path} fails on a text of {len(text)} characters ({type(e).__name__}: "
                                 f"{detail}); its pre-tokenizer or normalizer is broken: copy tokenizer.json from "
                                 "the original checkpoint again") from None

    def decode(self, ids, skip_special: bool = True) -> str:
        ids = self._check_ids(ids)
        return self.tk.decode(ids, skip_special_tokens=skip_special)

    def token_bytes(self, id: int) -> bytes:
        id = self._check_ids([id])[0]
        return self._bytes[id]
