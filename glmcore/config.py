"""One canonical description of the GLM architecture, parsed from any supported config.json."""
from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .tokenizer import is_tiktoken_file

FAMILIES = ("chatglm2", "chatglm3", "glm4")
# Far beyond any GLM model, small enough that no product of them overflows 64 bits.
_INT_RANGES = {"hidden_size": (1, 1 << 16), "num_layers": (1, 1024), "num_heads": (1, 1024),
               "num_kv_heads": (1, 1024), "head_dim": (4, 1024), "ffn_hidden_size": (1, 1 << 18),
               "vocab_size": (1, 1 << 22), "max_seq_len": (2, 1 << 24)}


@dataclass(frozen=True)
class ModelConfig:
    family: str                 # chatglm2 | chatglm3 | glm4: decides tokenizer and chat format
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int           # multi_query_group_num
    head_dim: int               # kv_channels
    ffn_hidden_size: int
    vocab_size: int             # padded: rows of the embedding and output layer
    max_seq_len: int
    rope_base: float            # 10000 * rope_ratio
    norm_eps: float
    qkv_bias: bool = True
    linear_bias: bool = False
    name: str = ""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        # GLM rotates the first half of each head's dims, in interleaved pairs.
        return self.head_dim // 2

    def num_params(self) -> int:
        h, f, L = self.hidden_size, self.ffn_hidden_size, self.num_layers
        qkv = h * (self.q_size + 2 * self.kv_size) + (self.q_size + 2 * self.kv_size) * self.qkv_bias
        layer = qkv + self.q_size * h + h * 2 * f + f * h + 2 * h
        return 2 * self.vocab_size * h + L * layer + h

    def validated(self, source: str = "config.json") -> "ModelConfig":
        """Refuse values no GLM checkpoint has, before any size is computed from them: every later
        shape, offset and buffer size (also in the C kernels) derives from these numbers."""
        for f, (lo, hi) in _INT_RANGES.items():
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ConfigError(f"{source}: {f} = {v!r} is not an integer in {lo}..{hi}; restore the file from "
                                  "the original checkpoint")
        for f in ("rope_base", "norm_eps"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e12:
                raise ConfigError(f"{source}: {f} = {v!r} is not a positive number; restore the file from the "
                                  "original checkpoint")
        for f in ("qkv_bias", "linear_bias"):
            if not isinstance(getattr(self, f), bool):
                raise ConfigError(f"{source}: {f} = {getattr(self, f)!r} is not true/false")
        if self.num_heads % self.num_kv_heads or self.head_dim % 4:
            raise ConfigError(f"{source}: {self.num_heads} attention heads cannot share {self.num_kv_heads} KV "
                              f"groups of head size {self.head_dim}; restore the file from the original checkpoint")
        return dataclasses.replace(self, rope_base=float(self.rope_base), norm_eps=float(self.norm_eps),
                                   name=str(self.name))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: not found; point --model at a checkpoint directory that has config.json")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e}); restore the file from the original checkpoint") from None
        return cls.from_dict(raw, source=str(path), model_dir=Path(model_dir))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json", model_dir: Path | None = None) -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: holds a JSON {type(raw).__name__}, not an object; restore the file "
                              "from the original checkpoint")
        model_type = raw.get("model_type")
        try:
            if model_type == "chatglm":
                return _from_chatglm(raw, model_dir).validated(source)
            if model_type == "glm":
                return _from_hf_glm(raw).validated(source)
        except KeyError as e:
            raise ConfigError(f"{source}: missing key {e.args[0]!r}; restore the file from the original checkpoint") from None
        except (TypeError, ValueError, ZeroDivisionError, OverflowError) as e:
            raise ConfigError(f"{source}: invalid value ({e}); restore the file from the original checkpoint") from None
        if model_type in ("chatglm_6b", "chatglm6b") or "position_encoding_2d" in raw:
            raise ConfigError(f"{source}: ChatGLM-6B v1 (2-D positions) is not supported; use ChatGLM2/3 or GLM-4")
        raise ConfigError(f"{source}: model_type {model_type!r} is not a GLM model; "
                          "supported: 'chatglm' (ChatGLM2/3, GLM-4) and 'glm' (transformers)")


def _from_chatglm(raw: dict, model_dir: Path | None) -> ModelConfig:
    if raw.get("position_encoding_2d") or "inner_hidden_size" in raw:
        raise ConfigError("config.json: ChatGLM-6B v1 (2-D positions) is not supported; use ChatGLM2/3 or GLM-4")
    if not raw.get("rmsnorm", True) or raw.get("apply_residual_connection_post_layernorm", False):
        raise ConfigError("config.json: only rmsnorm=true, apply_residual_connection_post_layernorm=false is supported")
    heads = raw["num_attention_heads"]
    return ModelConfig(
        family=_chatglm_family(raw, model_dir),
        hidden_size=raw["hidden_size"],
        num_layers=raw["num_layers"],
        num_heads=heads,
        num_kv_heads=raw["multi_query_group_num"] if raw.get("multi_query_attention") else heads,
        head_dim=raw.get("kv_channels", raw["hidden_size"] // heads),
        ffn_hidden_size=raw["ffn_hidden_size"],
        vocab_size=raw["padded_vocab_size"],
        max_seq_len=raw["seq_length"],
        rope_base=10000.0 * float(raw.get("rope_ratio", 1.0)),
        norm_eps=raw["layernorm_epsilon"],
        qkv_bias=raw.get("add_qkv_bias", True),
        linear_bias=raw.get("add_bias_linear", False),
        name=raw.get("_name_or_path", ""),
    )


def _chatglm_family(raw: dict, model_dir: Path | None) -> str:
    """ChatGLM2, ChatGLM3 and GLM-4 share model_type 'chatglm'; tell them apart by vocabulary and name."""
    if raw["padded_vocab_size"] >= 150000:
        return "glm4"
    if model_dir is not None and is_tiktoken_file(model_dir / "tokenizer.model"):
        return "glm4"
    names = [raw.get("_name_or_path", "")]
    if model_dir is not None and (model_dir / "tokenizer_config.json").is_file():
        try:
            names.append(json.loads((model_dir / "tokenizer_config.json").read_text()).get("name_or_path", ""))
        except (ValueError, OSError, AttributeError):
            pass    # load_tokenizer reports a broken tokenizer_config.json
    return "chatglm2" if any("chatglm2" in str(n).lower() for n in names) else "chatglm3"


def _from_hf_glm(raw: dict) -> ModelConfig:
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim", raw["hidden_size"] // heads)
    rope = {**raw, **(raw.get("rope_parameters") or {})}   # transformers 5 nests them in rope_parameters
    if rope.get("partial_rotary_factor", 0.5) != 0.5:
        raise ConfigError("config.json: partial_rotary_factor must be 0.5 for a GLM model")
    theta = float(rope.get("rope_theta", 10000.0))
    if "rope_ratio" in raw:
        theta = 10000.0 * float(raw["rope_ratio"])
    elif theta == 10000.0 and raw.get("max_position_embeddings") == 131072:
        # Known mis-conversion of glm-4-9b-chat (trained with rope_ratio 500): trust the model, not the key.
        warnings.warn("config.json: rope_theta 10000 on a 128k GLM-4 checkpoint; using 5000000 (rope_ratio 500)")
        theta = 5_000_000.0
    return ModelConfig(
        family="glm4",
        hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads", heads),
        head_dim=head_dim,
        ffn_hidden_size=raw["intermediate_size"],
        vocab_size=raw["vocab_size"],
        max_seq_len=raw.get("max_position_embeddings", 131072),
        rope_base=theta,
        norm_eps=raw.get("rms_norm_eps", 1e-5),
        qkv_bias=raw.get("attention_bias", True),
        linear_bias=False,
        name=raw.get("_name_or_path", ""),
    )
