"""A checkpoint's own chat template (tokenizer_config.json / chat_template.jinja), rendered in a jinja2
sandbox exactly as transformers' apply_chat_template renders it (glmcore.chat.TemplateFormat uses it).

The environment is transformers': ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks, loopcontrols),
its `tojson` (no HTML escaping, ensure_ascii/indent/separators/sort_keys), `raise_exception`,
`strftime_now`, and the tokenizer's special tokens as variables. The rendered text is encoded with its
special tokens matched and no post-processor tokens (apply_chat_template(tokenize=True)).
"""
from __future__ import annotations

import json
from datetime import datetime

from .errors import ChatError


def _environment():
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def render(template: str, messages: list[dict], tools: list[dict] | None = None,
           add_generation_prompt: bool = False, **variables) -> str:
    """The template's text for plain-JSON messages/tools, as transformers' render_jinja_template."""
    import jinja2
    try:
        compiled = _environment().from_string(template)
        return compiled.render(messages=messages, tools=tools, documents=None,
                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.SecurityError as e:
        raise ChatError(f"the checkpoint's chat template tried something the sandbox refuses ({e}); fix "
                        "chat_template in tokenizer_config.json") from None
    except jinja2.exceptions.TemplateError as e:
        raise ChatError(f"the checkpoint's chat template failed: {e}") from None
