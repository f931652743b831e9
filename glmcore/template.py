"""A checkpoint's own chat template (tokenizer_config.json / chat_template.jinja), rendered in a jinja2
sandbox exactly as transformers' apply_chat_template renders it, as a glmcore ChatFormat.

The environment is transformers': ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks, loopcontrols),
its `tojson` (no HTML escaping, ensure_ascii/indent/separators/sort_keys), `raise_exception`,
`strftime_now`, and the tokenizer's special tokens as variables. The rendered text is encoded with its
special tokens matched and no post-processor tokens (apply_chat_template(tokenize=True)).
"""
from __future__ import annotations

import copy
import json
from datetime import datetime

from .chat import ChatFormat, Message, _functions, as_message, parse_glm4_call
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


class TemplateFormat(ChatFormat):
    """Prompts from the checkpoint's template; replies parsed in GLM-4's segment format (<|assistant|>
    separates segments, a segment's first line names a tool, its body is JSON arguments)."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        if not tokenizer.chat_template:
            raise ChatError(f"{tokenizer.path.parent}: tokenizer_config.json has no chat_template; copy it from the "
                            "original checkpoint (glmcore does not guess a format for tokenizer.json checkpoints)")
        self.family = tokenizer.family
        self.template = tokenizer.chat_template
        self.stop_ids = list(tokenizer.stop_ids)
        self.assistant_id = self.special.get("<|assistant|>")
        # GLM templates call tool results "observation" and write a call as an assistant turn with the tool
        # name as metadata; other templates take OpenAI's roles and tool_calls as they are.
        self.glm_roles = "observation" in self.template
        # GLM-4-0414's generation prompt ends at <|assistant|>: the reply opens with a metadata line (a tool name
        # or nothing). GLM-Edge's ends with "<|assistant|>\n": the reply is plain text.
        self.segmented = self.glm_roles and self.assistant_id is not None
        # A template that rewrites earlier replies (GLM-Z1 drops their thinking) cannot extend a cached
        # conversation with the reply as generated: the pipeline then builds the whole prompt again.
        self.can_continue = "</think>" not in self.template
        # A template that speaks of <think> is a reasoning model's: its replies' thinking is split off.
        self.thinking = "<think>" in self.template or "</think>" in self.template
        self.variables: dict = {}       # a request's chat_template_kwargs (configured)
        self._derive()

    def _derive(self) -> None:
        # what the template writes before any turn ([gMASK]<sop> for GLM-4-0414, nothing for GLM-Edge)
        self.prefix = self.tok.encode_rendered(self.render([], None, False))
        # GLM-Z1's generation prompt is "<|assistant|>\n<think>": its replies start inside the thinking
        probe = [{"role": "user", "content": "?"}]
        self.opens_thinking = self.thinking and self.render(probe, None, True).rstrip().endswith("<think>")

    def configured(self, template_kwargs: dict | None) -> "TemplateFormat":
        """This format rendering with a request's chat_template_kwargs as template variables (as vLLM and
        transformers pass them). enable_thinking=False is refused where the template cannot honour it: GLM-Z1's
        template has no such switch and opens every reply with <think> (its models were trained only to think)."""
        if not template_kwargs:
            return self
        reserved = sorted(set(template_kwargs) & {"messages", "tools", "documents", "add_generation_prompt"})
        if reserved:
            raise ChatError(f"chat_template_kwargs cannot set {', '.join(reserved)}: send them as the request's own "
                            "fields")
        if (template_kwargs.get("enable_thinking") is False and "enable_thinking" not in self.template
                and self.thinking):
            raise ChatError("this checkpoint's chat template always thinks (it has no enable_thinking switch and "
                            "opens every reply with <think>, as GLM-Z1's does); drop enable_thinking=false, or use "
                            "a non-reasoning checkpoint such as GLM-4-0414")
        out = copy.copy(self)
        out.variables = {**self.variables, **template_kwargs}
        out._derive()
        return out

    def _dicts(self, messages: list[Message]) -> list[dict]:
        out = []
        for m in messages:
            role = "observation" if m.role == "tool" and self.glm_roles else m.role
            if m.ids is not None and m.role == "assistant":
                content = self.tok.decode(m.ids, skip_special=False)
                out.append({"role": role, "content": content.lstrip("\n") if self.glm_roles else content})
                continue
            # thinking as transformers' templates take it (GLM-Z1's drops it from earlier replies anyway)
            extra = {"reasoning_content": m.reasoning} if m.role == "assistant" and m.reasoning else {}
            if not self.glm_roles:
                d = {"role": role, "content": m.content, **extra}
                if m.tool_calls:
                    d["tool_calls"] = [{"type": "function", "id": c.id, "function": {"name": c.name,
                                        "arguments": c.arguments}} for c in m.tool_calls]
                out.append(d)
                continue
            if m.content or not m.tool_calls:
                d = {"role": role, "content": m.content, **extra}
                if m.metadata:
                    d["metadata"] = m.metadata
                out.append(d)
            for c in m.tool_calls:
                out.append({"role": "assistant", "metadata": c.name,
                            "content": json.dumps(c.arguments, ensure_ascii=False)})
        return out

    def render(self, messages, tools=None, add_generation_prompt: bool = True, **variables) -> str:
        functions = _functions(tools)
        tools_json = [{"type": "function", "function": f} for f in functions] or None
        return render(self.template, self._dicts([as_message(m) for m in messages]), tools_json,
                      add_generation_prompt, **{**self.tok.template_vars, **self.variables, **variables})

    def _build(self, messages, tools, add_generation_prompt):
        ids = self.tok.encode_rendered(self.render(messages, tools, add_generation_prompt))
        # Turn starts: where the prompt of the messages before each user message ends, when that prompt is
        # a prefix of the whole one (it is for GLM's templates); else one span.
        starts, seen_user = [], False
        for k, m in enumerate(messages):
            if m.role == "user" or (not seen_user and m.role != "system"):
                seen_user = True
                head = self.tok.encode_rendered(self.render(messages[:k], tools, False))
                if ids[:len(head)] == head:
                    starts.append(len(head))
        return ids, self._spans(starts, len(ids))

    def encode_continuation(self, new_messages, n_previous_turns: int) -> list[int]:
        if not self.can_continue:
            raise ChatError("this chat template rewrites earlier replies; build the whole prompt again")
        # The reply stopped on a stop token (not fed): the new messages render as the template renders them
        # after the template's own opening (the [gMASK]<sop> of GLM-4-0414, nothing for GLM-Edge).
        full = self.render(new_messages, None, True)
        opening = self.render([], None, False)
        if not full.startswith(opening):
            raise ChatError("this chat template does not render a conversation as its opening plus the turns")
        return self.tok.encode_rendered(full[len(opening):])

    def call_prefix(self, name: str) -> list[int]:
        return self.tok.encode(f"{name}\n")

    def call_plausible(self, body):
        return self.glm_roles and (not body or body.startswith("{"))

    def parse_call(self, body):
        return parse_glm4_call(body)
