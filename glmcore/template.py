"""A checkpoint's own chat template (tokenizer_config.json / chat_template.jinja), rendered in a jinja2
sandbox exactly as transformers' apply_chat_template renders it (glmcore.chat.TemplateFormat uses it).

The environment is transformers': ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks, loopcontrols),
its `tojson` (no HTML escaping, ensure_ascii/indent/separators/sort_keys), `raise_exception`,
`strftime_now`, and the tokenizer's special tokens as variables. The rendered text is encoded with its
special tokens matched and no post-processor tokens (apply_chat_template(tokenize=True)).
"""
from __future__ import annotations

import ctypes
import json
import re
import threading
import time
from datetime import datetime
from functools import lru_cache

from .errors import ChatError

# A template is code from the checkpoint: it renders under these budgets, so a hostile one (nested
# range(100000) loops, 'x' * 10**10, a macro calling itself, 200 MB of output) is a one-line ChatError
# and never a hang, an out-of-memory kill or a traceback. Real GLM templates render in well under 10 ms.
RENDER_SECONDS = 2.0
MAX_RENDER_CHARS = 16 << 20     # the rendered prompt; a context of 1M tokens is ~4M characters
MAX_REPEAT_CHARS = 1 << 20      # one "s * n" of a string or list inside the template


class _Budget(Exception):
    """Raised inside a render that ran past RENDER_SECONDS (delivered asynchronously to its thread)."""


@lru_cache(maxsize=1)
def _environment():
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def refuse(what):
        raise jinja2.exceptions.SecurityError(f"{what} is over the template's limit of {MAX_REPEAT_CHARS}")

    def check_sizes(args, kwargs, what):
        for v in (*args, *kwargs.values()):
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_REPEAT_CHARS:
                refuse(f"{what} of {v}")

    def check_widths(fmt: str):
        """Widths/precisions of a %-format or str.format string (a width of 10**10 allocates 10 GB)."""
        if any(int(d) > MAX_REPEAT_CHARS for d in re.findall(r"\d+", fmt)) and re.search(r"[%:.]\d|[%:]\D*\d", fmt):
            for d in re.findall(r"(?:%|:)[^a-zA-Z%{}]*?(\d+)|\.(\d+)", fmt):
                for x in d:
                    if x and int(x) > MAX_REPEAT_CHARS:
                        refuse(f"a format width of {x}")

    class Sandbox(ImmutableSandboxedEnvironment):
        """transformers' sandbox, with what can allocate without bound bounded (jinja2's sandbox bounds
        range() only): "*", "**" and "%", str methods and format widths, filter arguments."""
        intercepted_binops = frozenset(["*", "**", "%"])

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
                refuse(f"a power of {right}")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if (isinstance(seq, (str, list, tuple)) and isinstance(n, int)
                            and len(seq) * n > MAX_REPEAT_CHARS):
                        refuse(f"repeating {len(seq)} items {n} times")
            if operator == "%" and isinstance(left, str):
                check_widths(left)
            return super().call_binop(context, operator, left, right)

        def call(self, context, obj, /, *args, **kwargs):
            method = getattr(obj, "__wrapped__", obj)        # the sandbox wraps str.format
            owner = getattr(method, "__self__", None)
            if isinstance(owner, (str, list, bytes)):
                check_sizes(args, kwargs, f"an argument to {getattr(method, '__name__', 'a method')}()")
                if isinstance(owner, str) and getattr(method, "__name__", "") in ("format", "format_map"):
                    check_widths(owner)
            return super().call(context, obj, *args, **kwargs)

    def bounded(name, f):
        def filter_(*args, **kwargs):
            check_sizes(args[1:], kwargs, f"an argument to the filter {name}")
            if name == "format" and args and isinstance(args[0], str):
                check_widths(args[0])
            return f(*args, **kwargs)
        for attr in ("jinja_pass_arg",):       # pass_context / pass_environment markers
            if hasattr(f, attr):
                setattr(filter_, attr, getattr(f, attr))
        return filter_

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters = {name: bounded(name, f) for name, f in env.filters.items()}
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@lru_cache(maxsize=16)
def _compiled(template: str):
    return _environment().from_string(template)


def _render_bounded(template: str, variables: dict) -> str:
    out, size = [], 0
    for chunk in _compiled(template).generate(**variables):
        size += len(chunk)
        if size > MAX_RENDER_CHARS:
            raise ChatError(f"the checkpoint's chat template renders more than {MAX_RENDER_CHARS} characters; fix "
                            "chat_template in tokenizer_config.json")
        out.append(chunk)
    return "".join(out)


def render(template: str, messages: list[dict], tools: list[dict] | None = None,
           add_generation_prompt: bool = False, **variables) -> str:
    """The template's text for plain-JSON messages/tools, as transformers' render_jinja_template, rendered on a
    thread of its own under RENDER_SECONDS and MAX_RENDER_CHARS."""
    variables = dict(variables, messages=messages, tools=tools, documents=None,
                     add_generation_prompt=add_generation_prompt)
    result: dict = {}

    def work():
        try:
            result["text"] = _render_bounded(template, variables)
        except BaseException as e:          # handed to the caller's thread
            result["error"] = e

    worker = threading.Thread(target=work, name="glmcore-template", daemon=True)
    t0 = time.monotonic()
    worker.start()
    worker.join(RENDER_SECONDS)
    while worker.is_alive():                # past the budget: stop it at its next bytecode
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident), ctypes.py_object(_Budget))
        worker.join(0.05)
        if time.monotonic() - t0 > RENDER_SECONDS + 5:      # inside one C call: leave it, answer anyway
            break
    error = result.get("error")
    if "text" in result:
        return result["text"]
    if error is None or isinstance(error, _Budget):
        raise ChatError(f"the checkpoint's chat template took over {RENDER_SECONDS:g} s to render; fix chat_template "
                        "in tokenizer_config.json")
    raise _template_error(error) from None


def _template_error(e: BaseException) -> Exception:
    import jinja2
    if isinstance(e, ChatError):
        return e
    if isinstance(e, jinja2.exceptions.SecurityError):
        return ChatError(f"the checkpoint's chat template tried something the sandbox refuses ({e}); fix "
                         "chat_template in tokenizer_config.json")
    if isinstance(e, jinja2.exceptions.TemplateError):
        return ChatError(f"the checkpoint's chat template failed: {' '.join(str(e).split())[:200]}")
    if isinstance(e, RecursionError):
        return ChatError("the checkpoint's chat template recurses without end (a macro calling itself?); fix "
                         "chat_template in tokenizer_config.json")
    if isinstance(e, MemoryError):
        return ChatError("the checkpoint's chat template ran out of memory; fix chat_template in "
                         "tokenizer_config.json")
    if isinstance(e, Exception):            # TypeError, ValueError, ... raised by the template's own expressions
        return ChatError(f"the checkpoint's chat template failed ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:160]}); fix chat_template in tokenizer_config.json")
    raise e                                 # KeyboardInterrupt, SystemExit
