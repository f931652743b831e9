"""The parsed config.json: ModelConfig, read through the architecture module of its model_type
(glmcore/arch/). Every architectural number comes from the file; the family decides only the tokenizer
and the chat format."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .files import read_bounded

# chatglm2/chatglm3/glm4: THUDM's remote-code checkpoints (model_type "chatglm", tokenizer.model);
# glm4-0414: transformers' glm4 architecture (GLM-4-0414, GLM-Z1: Glm4ForCausalLM);
# glm-edge: transformers' glm architecture (GLM-Edge, the -hf conversions: GlmForCausalLM).
# glm4-moe: GLM-4.5/4.5-Air/4.6/4.7 (glm4_moe); glm4-moe-lite: GLM-4.7-Flash (glm4_moe_lite).
# All but the first three ship tokenizer.json + a chat template; the family never decides an architectural number.
FAMILIES = ("chatglm2", "chatglm3", "glm4", "glm4-0414", "glm-edge", "glm4-moe", "glm4-moe-lite")
MAX_CONFIG_BYTES = 16 << 20     # a real config.json is a few KB
# Far beyond any GLM model, small enough that no product of them overflows 64 bits.
_INT_RANGES = {"hidden_size": (1, 1 << 16), "num_layers": (1, 1024), "num_heads": (1, 1024),
               "num_kv_heads": (1, 1024), "head_dim": (4, 1024), "ffn_hidden_size": (1, 1 << 18),
               "vocab_size": (1, 1 << 22), "max_seq_len": (2, 1 << 24), "rotary_dim": (2, 1024),
               "num_mtp_layers": (0, 16)}


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
    # Rotary pairs (2i, 2i+1) (every dense GLM) or (i, i + rotary_dim/2) (NeoX order: the MoE GLMs).
    rotary_interleaved: bool = True
    arch: str = "glm"           # the glmcore/arch module that parsed it (and lays out its tensors)
    model_type: str = ""        # config.json's model_type: the checkpoint layout the weights are stored in
    # Multi-token-prediction (NextN) layers stored after the decoder layers (num_nextn_predict_layers): every
    # MoE GLM's; on a dense checkpoint glmcore's own extension (the demo model's, in mtp.safetensors).
    num_mtp_layers: int = 0

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
        from . import arch
        return arch.of(self).num_params(self)

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
        for f in ("qkv_bias", "linear_bias", "post_norms", "tie_embeddings", "rotary_interleaved"):
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
        if path.exists() and not path.is_file():
            raise ConfigError(f"{path}: not a regular file (a FIFO, device or directory); copy the real config.json "
                              "from the checkpoint")
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
        from . import arch
        model_type = raw.get("model_type")
        module = arch.for_model_type(model_type)
        try:
            if module is not None:
                return module.parse_config(raw, source, model_dir)
        except KeyError as e:
            raise ConfigError(f"{source}: missing key {e.args[0]!r}; restore the file from the original checkpoint") from None
        except (TypeError, ValueError, ZeroDivisionError, OverflowError) as e:
            raise ConfigError(f"{source}: invalid value ({e}); restore the file from the original checkpoint") from None
        if "position_encoding_2d" in raw:
            raise ConfigError(f"{source}: ChatGLM-6B v1 (2-D positions) is not supported; use ChatGLM2/3 or GLM-4")
        raise ConfigError(f"{source}: model_type {model_type!r} is not a GLM model glmcore runs; supported: "
                          f"{arch.supported_model_types()}")
