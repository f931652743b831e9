"""One canonical description of the GLM architecture, parsed from any supported config.json."""
from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .files import read_bounded
from .tokenizer import is_tiktoken_file

# chatglm2/chatglm3/glm4: THUDM's remote-code checkpoints (model_type "chatglm", tokenizer.model);
# glm4-0414: transformers' glm4 architecture (GLM-4-0414, GLM-Z1: Glm4ForCausalLM);
# glm-edge: transformers' glm architecture (GLM-Edge, the -hf conversions: GlmForCausalLM).
# The last two ship tokenizer.json + a chat template; the family never decides an architectural number.
FAMILIES = ("chatglm2", "chatglm3", "glm4", "glm4-0414", "glm-edge")
MAX_CONFIG_BYTES = 16 << 20     # a real config.json is a few KB
# Far beyond any GLM model, small enough that no product of them overflows 64 bits.
_INT_RANGES = {"hidden_size": (1, 1 << 16), "num_layers": (1, 1024), "num_heads": (1, 1024),
               "num_kv_heads": (1, 1024), "head_dim": (4, 1024), "ffn_hidden_size": (1, 1 << 18),
               "vocab_size": (1, 1 << 22), "max_seq_len": (2, 1 << 24), "rotary_dim": (2, 1024)}


@dataclass(frozen=True)
class ModelConfig:
    family: str                 # one of FAMILIES: decides tokenizer and chat format, nothing else
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
    # Dims of each head that rotate, in interleaved pairs (2i, 2i+1) from dim 0; the rest pass through.
    # ChatGLM/GLM-4 rotate half the head; transformers' glm/glm4 take head_dim * partial_rotary_factor
    # (GLM-Edge: the whole head). 0 in a constructor call means "half the head" (the ChatGLM default).
    rotary_dim: int = 0
    # GLM-4-0414 (glm4): RMSNorms on the attention output and on the MLP output, before each residual add.
    post_norms: bool = False
    # The output layer is the embedding matrix (tie_word_embeddings: GLM-Edge).
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.rotary_dim == 0 and isinstance(self.head_dim, int):
            object.__setattr__(self, "rotary_dim", self.head_dim // 2)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        h, f, L = self.hidden_size, self.ffn_hidden_size, self.num_layers
        qkv = h * (self.q_size + 2 * self.kv_size) + (self.q_size + 2 * self.kv_size) * self.qkv_bias
        layer = qkv + self.q_size * h + h * 2 * f + f * h + (4 if self.post_norms else 2) * h
        return (1 if self.tie_embeddings else 2) * self.vocab_size * h + L * layer + h

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
        for f in ("qkv_bias", "linear_bias", "post_norms", "tie_embeddings"):
            if not isinstance(getattr(self, f), bool):
                raise ConfigError(f"{source}: {f} = {getattr(self, f)!r} is not true/false")
        if self.num_heads % self.num_kv_heads or self.head_dim % 4:
            raise ConfigError(f"{source}: {self.num_heads} attention heads cannot share {self.num_kv_heads} KV "
                              f"groups of head size {self.head_dim}; restore the file from the original checkpoint")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ConfigError(f"{source}: the rotary part ({self.rotary_dim} dims) must be an even number of dims "
                              f"within the head ({self.head_dim}); fix partial_rotary_factor or head_dim")
        if self.family not in FAMILIES:
            raise ConfigError(f"{source}: unknown family {self.family!r}; use one of {', '.join(FAMILIES)}")
        return dataclasses.replace(self, rope_base=float(self.rope_base), norm_eps=float(self.norm_eps),
                                   name=str(self.name))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: not found; point --model at a checkpoint directory that has config.json")
        fix = "restore the file from the original checkpoint"
        try:     # bounded: a config.json is a few KB; a huge one is refused before it is parsed
            raw = json.loads(read_bounded(path, MAX_CONFIG_BYTES, "config.json", fix, ConfigError).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise ConfigError(f"{path}: not valid JSON ({type(e).__name__}: {str(e)[:80]}); {fix}") from None
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
            if model_type in ("glm", "glm4"):
                return _from_hf_glm(raw, model_dir, source).validated(source)
        except KeyError as e:
            raise ConfigError(f"{source}: missing key {e.args[0]!r}; restore the file from the original checkpoint") from None
        except (TypeError, ValueError, ZeroDivisionError, OverflowError) as e:
            raise ConfigError(f"{source}: invalid value ({e}); restore the file from the original checkpoint") from None
        if model_type in ("chatglm_6b", "chatglm6b") or "position_encoding_2d" in raw:
            raise ConfigError(f"{source}: ChatGLM-6B v1 (2-D positions) is not supported; use ChatGLM2/3 or GLM-4")
        raise ConfigError(f"{source}: model_type {model_type!r} is not a GLM model; "
                          "supported: 'chatglm' (ChatGLM2/3, GLM-4), 'glm4' (GLM-4-0414, GLM-Z1) and 'glm' "
                          "(GLM-Edge, -hf)")


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


# transformers' GlmConfig/Glm4Config defaults, used exactly where the file leaves a key out (so that a
# config.json means what it means to transformers).
_HF_DEFAULTS = {"num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 131072,
                "rms_norm_eps": 1.5625e-07, "attention_bias": True, "tie_word_embeddings": False,
                "partial_rotary_factor": 0.5, "rope_theta": 10000.0, "hidden_act": "silu"}
_GLM4_9B_CHAT_VOCAB = 151552


def _from_hf_glm(raw: dict, model_dir: Path | None, source: str) -> ModelConfig:
    """transformers' glm (GlmForCausalLM) and glm4 (Glm4ForCausalLM) config.json: every number from its
    own keys. The two differ only by glm4's two extra norms per layer."""
    def get(key):
        v = raw.get(key, _HF_DEFAULTS.get(key))
        if v is None and key not in _HF_DEFAULTS:
            raise KeyError(key)
        return v

    heads = raw["num_attention_heads"]
    head_dim = get("head_dim") or raw["hidden_size"] // heads     # null: transformers' hidden/heads fallback
    # transformers 5 nests the rope keys in rope_parameters; 4.x has them at the top (rope_scaling for types).
    rope = {k: raw[k] for k in ("rope_theta", "partial_rotary_factor") if k in raw}
    rope.update(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ConfigError(f"{source}: rope_type {rope_type!r} is not supported (only the default rotary); "
                          "use a checkpoint without rope scaling")
    if get("hidden_act") != "silu":
        raise ConfigError(f"{source}: hidden_act {raw.get('hidden_act')!r} is not supported; GLM models use silu")
    factor = float(rope.get("partial_rotary_factor", _HF_DEFAULTS["partial_rotary_factor"]))
    theta = float(rope.get("rope_theta", _HF_DEFAULTS["rope_theta"]))
    if "rope_ratio" in raw:            # a chatglm-style key left in by a converter: it is what the model trained with
        theta = 10000.0 * float(raw["rope_ratio"])
    vocab = raw["vocab_size"]
    if (raw["model_type"] == "glm" and theta == 10000.0 and raw.get("max_position_embeddings") == 131072
            and vocab == _GLM4_9B_CHAT_VOCAB and factor == 0.5):
        # glm-4-9b-chat trained with rope_ratio 500, and some conversions of it to the glm layout wrote 10000.
        # transformers runs the stored value, and so do we; a real glm4 checkpoint (GLM-Z1-Rumination-32B)
        # has exactly this theta and context, so nothing is changed, only said.
        warnings.warn(f"{source}: rope_theta 10000 on a 128k glm-4-9b-chat conversion; the original trained "
                      "with rope_ratio 500 (rope_theta 5000000): if its long-context output is poor, set "
                      "\"rope_theta\": 5000000.0 in config.json")
    return ModelConfig(
        family=_hf_family(raw["model_type"], model_dir),
        hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=get("num_key_value_heads"),
        head_dim=head_dim,
        ffn_hidden_size=raw["intermediate_size"],
        vocab_size=vocab,
        max_seq_len=get("max_position_embeddings"),
        rope_base=theta,
        norm_eps=get("rms_norm_eps"),
        qkv_bias=get("attention_bias"),
        linear_bias=False,
        name=raw.get("_name_or_path", ""),
        # transformers: dim = int(head_dim * partial_rotary_factor)
        rotary_dim=int(head_dim * factor) if 0 < factor <= 1 else -1,
        post_norms=raw["model_type"] == "glm4",
        tie_embeddings=get("tie_word_embeddings"),
    )


def _hf_family(model_type: str, model_dir: Path | None) -> str:
    if model_type == "glm4":
        return "glm4-0414"
    # A glm-layout conversion of glm-4-9b-chat that kept the original tiktoken tokenizer.model (and no
    # tokenizer.json) uses GLM-4's native tokenizer and chat format.
    if model_dir is not None and not (model_dir / "tokenizer.json").is_file() \
            and is_tiktoken_file(model_dir / "tokenizer.model"):
        return "glm4"
    return "glm-edge"
