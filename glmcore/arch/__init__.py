"""The architecture registry: one module per architecture, found by config.json's model_type.

    from glmcore.arch import for_model_type, of
    arch = for_model_type("glm4")          # the module that parses and lays out this checkpoint
    arch = of(config)                      # the module a parsed config came from

An architecture registers itself with `register(instance)` (the built-ins below; a test or a third
party may add its own the same way). docs/plugins.md has the checklist for adding one.
"""
from __future__ import annotations

from ..errors import ConfigError
from .base import Architecture, Axis, Role, Split, StoredNames, TensorSpec

_BY_NAME: dict[str, Architecture] = {}
_BY_MODEL_TYPE: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    """Add an architecture (replacing one of the same name, so a re-imported module stays one entry)."""
    old = _BY_NAME.pop(arch.name, None)
    if old is not None:
        for t in old.model_types:
            _BY_MODEL_TYPE.pop(t, None)
    taken = [t for t in arch.model_types if t in _BY_MODEL_TYPE]
    if taken:
        raise ValueError(f"model_type {taken[0]!r} is already parsed by architecture {_BY_MODEL_TYPE[taken[0]].name!r}")
    _BY_NAME[arch.name] = arch
    for t in arch.model_types:
        _BY_MODEL_TYPE[t] = arch
    return arch


def unregister(name: str) -> None:
    arch = _BY_NAME.pop(name, None)
    for t in arch.model_types if arch else ():
        _BY_MODEL_TYPE.pop(t, None)


def architectures() -> list[Architecture]:
    return list(_BY_NAME.values())


def get(name: str) -> Architecture:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ConfigError(f"unknown architecture {name!r}; known: {', '.join(_BY_NAME)}") from None


def for_model_type(model_type) -> Architecture | None:
    return _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None


def for_gguf(gguf_arch) -> Architecture | None:
    """The module that reads a GGUF file of llama.cpp architecture `gguf_arch` (general.architecture)."""
    return next((a for a in _BY_NAME.values() if gguf_arch in a.gguf_architectures), None)


def gguf_architectures() -> list[str]:
    return [g for a in _BY_NAME.values() for g in a.gguf_architectures]


def of(config) -> Architecture:
    """The architecture module of a parsed config."""
    return get(config.arch)


def for_family(family: str) -> Architecture:
    """The module that writes synthetic checkpoints of a make-model family."""
    for arch in _BY_NAME.values():
        if family in arch.synthetic_families:
            return arch
    known = [f for a in _BY_NAME.values() for f in a.synthetic_families]
    raise ConfigError(f"unknown family {family!r}; choose {', '.join(known)}")


def synthetic_families() -> list[str]:
    return [f for a in _BY_NAME.values() for f in a.synthetic_families]


def synthetic_sizes() -> list[str]:
    """Every make-model --size some family has (which family has which: Architecture.sizes)."""
    return list(dict.fromkeys(s for a in _BY_NAME.values() for f in a.synthetic_families for s in a.sizes(f)))


def supported_model_types() -> str:
    return ", ".join(f"{t!r}" for t in _BY_MODEL_TYPE)


from .glm import GLM  # noqa: E402  (the built-in architectures)
from .glm4_moe import GLM4_MOE  # noqa: E402
from .glm4_moe_lite import GLM4_MOE_LITE  # noqa: E402

register(GLM)
register(GLM4_MOE)
register(GLM4_MOE_LITE)

__all__ = ["Architecture", "Axis", "Role", "Split", "StoredNames", "TensorSpec", "architectures", "for_family",
           "for_gguf", "for_model_type", "get", "gguf_architectures", "of", "register", "synthetic_families", "unregister"]
