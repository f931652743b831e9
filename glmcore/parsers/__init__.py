"""Reply parsers: one module per reply format, each a small object with feed(piece) -> events, close() -> events
and the grammar that constrains a call in its own format. A chat format (glmcore.chat) names its tool parser;
a thinking template adds the reasoning parser in front of it.

- segments: plain text (ChatGLM2, GLM-Edge), ChatGLM3's python-style and GLM-4/0414's JSON calls
- glm45: GLM-4.5 / 4.6 / 4.7 XML calls
- reasoning: <think>...</think> split from the answer
"""
from .base import Markup, ToolParser  # noqa: F401
from .glm45 import XmlCallParser  # noqa: F401
from .reasoning import ThinkSplitter, split_reasoning  # noqa: F401
from .segments import ChatGLM3Parser, GLM4Parser, PlainParser  # noqa: F401
