"""What every glmcore tokenizer is (the native ones in glmcore.tokenizer, tokenizer.json in
glmcore.hf_tokenizer): the common interface, and GLM-4's special tokens and split pattern they share."""
from __future__ import annotations

import re
from pathlib import Path

from .errors import TokenizerError

GLM4_SPECIALS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>",
                 "<|user|>", "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>",
                 "<|begin_of_video|>", "<|end_of_video|>"]
# GLM-4's pre-tokenizer pattern, as in ChatGLM4Tokenizer.
GLM4_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+")


class Tokenizer:
    """Common interface; see SentencePieceTokenizer and TiktokenTokenizer."""

    family: str
    n_vocab: int                 # number of valid ids, special tokens included
    eos_id: int
    pad_id: int
    special_ids: dict[str, int]  # the family's registered special tokens, name -> id

    def __init__(self, family: str, n_base: int, special_names: list[str], eos_id: int, pad_id: int,
                 path: Path):
        self.family, self.path = family, path
        self.n_base = n_base     # ids below this are ordinary vocabulary entries
        self.special_ids = {name: n_base + i for i, name in enumerate(special_names)}
        self.special_names = {i: name for name, i in self.special_ids.items()}
        self.n_vocab = n_base + len(special_names)
        self.eos_id, self.pad_id = eos_id, pad_id

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.family} n_vocab={self.n_vocab} from {self.path}>"

    def is_special(self, id: int) -> bool:
        return id in self.special_names

    @property
    def tag_ids(self) -> dict[str, int]:
        """Tokens the tokenizer reads as one wherever their text appears, name -> id: what a grammar can force as
        that token. Here the special tokens; tokenizer.json adds its other added tokens (HFTokenizer)."""
        return self.special_ids

    def _check_ids(self, ids) -> list[int]:
        out = [int(i) for i in ids]
        for i in out:
            if not 0 <= i < self.n_vocab:
                raise TokenizerError(f"token id {i} is out of range for the {self.family} vocabulary of "
                                     f"{self.n_vocab} ids ({self.path}); check the model/tokenizer pairing")
        return out

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt (/v1/completions, /tokenize) as the checkpoint's own transformers tokenizer reads one: the
        special tokens it registers (GLM-4's, all of tokenizer.json's) are the tokens where the text spells them,
        as in a prompt a client rendered with the chat template itself; the rest is encode()."""
        if not isinstance(text, str):
            raise TypeError(f"encode_prompt() takes str, not {type(text).__name__}")
        names = sorted(self.special_ids, key=len, reverse=True)      # the longest spelling first, as a trie matches
        ids: list[int] = []
        for i, part in enumerate(re.split(f"({'|'.join(map(re.escape, names))})", text) if names else [text]):
            ids += [self.special_ids[part]] if i % 2 else self.encode(part) if part else []
        return ids

    def decode(self, ids, skip_special: bool = True) -> str:
        raise NotImplementedError

    def token_bytes(self, id: int) -> bytes:
        raise NotImplementedError
