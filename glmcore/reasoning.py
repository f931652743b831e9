"""Moved: the reasoning parser is glmcore.parsers.reasoning (one module per reply format)."""
from .parsers.reasoning import CLOSE, OPEN, ThinkSplitter, split_reasoning  # noqa: F401
