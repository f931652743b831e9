"""A request's fields as the core takes them: messages (roles, text parts, tool calls and their results), tools and
tool_choice, sampling, thinking (reasoning_effort, a thought budget), the /v1/completions prompt. Each refusal is a
400 naming the field."""
from __future__ import annotations

import json

from ..chat import Message, as_message
from ..errors import GlmcoreError, TokenizerError
from ..sampling import SamplingParams
from ..structured import is_token
from .protocol import ApiError, ChatRequest, parse_arguments


def sampling(req, model) -> SamplingParams:
    """The request's SamplingParams (choice 0's seed: choice i of n draws with seed + i); what it leaves out is the
    checkpoint's recommendation (LoadedModel.sampling)."""
    d, n_vocab = model.sampling, model.tokenizer.n_vocab
    bias = {}
    for key, value in (req.logit_bias or {}).items():
        if not key.strip().isdigit() or int(key) >= n_vocab:
            raise ApiError(400, f"'logit_bias' names the token id {key[:20]!r}, which is not in the vocabulary "
                           f"(0..{n_vocab - 1}); use token ids of this model (see /tokenize)", "logit_bias",
                           "invalid_value")
        if abs(value) > SamplingParams.MAX_BIAS:
            raise ApiError(400, f"'logit_bias' gives token {key} the bias {value}; use values in [-100, 100]",
                           "logit_bias", "invalid_value")
        bias[int(key)] = float(value)
    try:
        return SamplingParams(d.temperature if req.temperature is None else req.temperature,
                              d.top_p if req.top_p is None else req.top_p,
                              d.top_k if req.top_k is None else max(req.top_k, 0),
                              d.repetition_penalty if req.repetition_penalty is None else req.repetition_penalty,
                              req.seed, req.presence_penalty or 0.0, req.frequency_penalty or 0.0, bias)
    except GlmcoreError as e:
        raise ApiError(400, str(e)) from None


def n_choices(state, req) -> int:
    """n, bounded by the slots: the n sequences run side by side, sharing the prompt's cache."""
    n = req.n or 1
    slots = state.scheduler.batch.n_slots
    if n > slots:
        raise ApiError(400, f"'n' is {n}, more than this server's {slots} slots (its n sequences run side by side); "
                       f"ask for at most {slots}, or start the server with more --slots", "n", "invalid_value")
    return n


def max_new(state, req, n_prompt: int) -> int:
    n = getattr(req, "max_completion_tokens", None) or req.max_tokens
    return n if n is not None else max(1, state.scheduler.capacity - n_prompt)


def _text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for i, part in enumerate(content):
        if part.get("type") != "text":
            raise ApiError(400, f"{where}.{i}: content part type {part.get('type')!r} is not supported: this model "
                           "reads text parts only ({\"type\": \"text\", \"text\": ...})", f"{where}.{i}",
                           "unsupported_value")
        if not isinstance(part.get("text"), str):
            given = "missing" if "text" not in part else json.dumps(part["text"], ensure_ascii=True)[:40]
            raise ApiError(400, f"{where}.{i}.text is {given}, not a string; send the part's text as a string",
                           f"{where}.{i}.text", "invalid_value")
        parts.append(part["text"])
    return "".join(parts)


def to_messages(state, req: ChatRequest) -> list[Message]:
    if not req.messages:
        raise ApiError(400, "'messages' is empty; send at least one message", "messages")
    out = []
    open_calls: list[str] | None = None       # ids of the last assistant turn's calls not yet answered
    for i, m in enumerate(req.messages):
        calls = [{"id": c.id, "function": {"name": c.function.name, "arguments": parse_arguments(
                  c.function.arguments, f"messages.{i}.tool_calls.{j}.function.arguments")}}
                 for j, c in enumerate(m.tool_calls or [])]
        if calls and m.role != "assistant":
            raise ApiError(400, f"messages.{i}: only assistant messages have tool_calls", f"messages.{i}.tool_calls")
        # a tool result answers a call of the assistant turn before it: one result per call, in a row
        if m.role == "tool":
            if not open_calls:
                raise ApiError(400, f"messages.{i}: a tool message must follow an assistant message with "
                               "tool_calls (one tool message per call); put the call before its result",
                               f"messages.{i}.role", "invalid_value")
            if m.tool_call_id and any(open_calls) and m.tool_call_id not in open_calls:
                raise ApiError(400, f"messages.{i}: tool_call_id {m.tool_call_id[:40]!r} answers no call of the "
                               "assistant message before it", f"messages.{i}.tool_call_id", "invalid_value")
            open_calls.remove(m.tool_call_id if m.tool_call_id in open_calls else open_calls[0])
        else:
            open_calls = [c["id"] for c in calls] if calls else None
        role = "system" if m.role == "developer" else m.role
        try:
            msg = as_message({"role": role, "content": _text(m.content, f"messages.{i}.content"),
                              "tool_calls": calls, "reasoning_content": m.reasoning_content})
        except GlmcoreError as e:
            raise ApiError(400, f"messages.{i}: {e}", f"messages.{i}") from None
        if role == "assistant":
            msg.ids = state.reply_ids.get(msg)
        out.append(msg)
    return out


def tool_setup(fmt, req: ChatRequest) -> tuple[list | None, bool, list[str]]:
    """(tools for the prompt, whether replies are parsed for calls, the functions a reply must call: one is
    forced by writing its name, several are chosen among by constrained decoding of the name line)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "'tool_choice' asks for a tool call but 'tools' is empty; send the tools",
                           "tool_choice")
        return None, False, []
    tools = [t.model_dump(exclude_unset=True) for t in req.tools]     # the client's own dicts, as sent
    try:
        names = [f["name"] for f in fmt.check_tools(tools)]
    except GlmcoreError as e:
        raise ApiError(400, str(e), "tools") from None
    if choice in (None, "auto"):
        return tools, True, []
    if choice == "none":
        return tools, False, []
    if choice == "required":
        return tools, True, names
    name = choice.function.name                  # the protocol checked the shape {"type", "function": {"name"}}
    if name not in names:
        raise ApiError(400, f"tool_choice names the function {name[:40]!r}, which is not in 'tools' "
                       f"({', '.join(names)})", "tool_choice", "invalid_value")
    return tools, True, [name]


def continuing(fmt, req):
    """The configured format, continuing the last message where the request asks (vLLM's continue_final_message,
    which needs add_generation_prompt false: the turn is left open, not a new one begun)."""
    if not req.continue_final_message:
        return fmt
    if req.add_generation_prompt:
        raise ApiError(400, "'continue_final_message' continues the last message, so no new turn is begun: send "
                       "\"add_generation_prompt\": false with it", "add_generation_prompt", "invalid_value")
    try:        # (a last message that is not an assistant's text is refused where the prompt is rendered)
        return fmt.continuing()
    except GlmcoreError as e:
        raise ApiError(400, str(e), "continue_final_message", "unsupported_value") from None


def check_model(state, name: str) -> None:
    if name != state.name:
        raise ApiError(404, f"the model {name!r} does not exist here; this server serves {state.name!r} "
                       "(see /v1/models)", "model", "model_not_found")


def thinking_setup(state, fmt, req: ChatRequest) -> tuple[dict | None, int | None]:
    """(chat_template_kwargs with reasoning_effort mapped onto the template's enable_thinking switch, the thought's
    token budget: the request's max_thinking_tokens / thinking_budget_tokens, else the server's default)."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        if not fmt.thinking_switch:
            raise ApiError(400, f"'reasoning_effort' maps onto the chat template's enable_thinking switch, and this "
                           f"{fmt.family} checkpoint's template has none; drop it", "reasoning_effort",
                           "unsupported_value")
        kwargs.setdefault("enable_thinking", req.reasoning_effort not in ("none", "minimal"))
    asked = req.max_thinking_tokens if req.max_thinking_tokens is not None else req.thinking_budget_tokens
    budget = None if asked == -1 else asked
    if budget is not None and not fmt.thinking:
        field = "max_thinking_tokens" if req.max_thinking_tokens is not None else "thinking_budget_tokens"
        raise ApiError(400, f"'{field}' bounds a thinking model's thought; this {fmt.family} checkpoint's template "
                       "writes no <think>: drop it", field, "unsupported_value")
    if asked is None and fmt.thinking and is_token(fmt.tok, "</think>"):   # (a text </think> cannot be forced)
        budget = state.thinking_budget
    if kwargs.get("enable_thinking") is False:
        budget = None           # the prompt closes the thought already
    return kwargs or None, budget


def prompt_ids(state, prompt, add_prefix: bool = True) -> list[int]:
    """/v1/completions' prompt: text or token ids, or a batch of one of either ([text], [[ids]]: what lm-eval
    sends). Text is read as transformers' tokenizer(prompt) reads it (no chat template; special tokens spelled in
    it are the tokens where the checkpoint's tokenizer registers them: a prompt the client rendered itself), after
    the model's [gMASK]<sop> prefix unless add_prefix is false or the text begins with it (not twice, as
    llama-server)."""
    tok = state.model.tokenizer
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise ApiError(400, f"'prompt' holds {len(prompt)} prompts; this server takes one per request", "prompt",
                           "unsupported_value")
        prompt = prompt[0]
    if isinstance(prompt, str):
        state.check_size(len(prompt), "prompt")
        try:
            ids = tok.encode_prompt(prompt)
            prefix = list(state.model.chat_format.prefix)
            if add_prefix and ids[:len(prefix)] != prefix:
                ids = prefix + ids
        except TokenizerError as e:
            raise ApiError(500, f"the model's tokenizer failed on this request: {e}", type="server_error",
                           code="tokenizer_error") from None
        except (ValueError, UnicodeError) as e:     # a tokenizer refusing text the protocol let through
            raise ApiError(400, f"'prompt' cannot be tokenized ({str(e)[:80]}); send plain Unicode text",
                           "prompt") from None
    else:
        ids = list(prompt)
        bad = [i for i in ids if not 0 <= i < tok.n_vocab]
        if bad:
            raise ApiError(400, f"'prompt' holds token id {bad[0]}, outside 0..{tok.n_vocab - 1}", "prompt")
    if len(ids) == 0:
        raise ApiError(400, "'prompt' is empty", "prompt")
    return ids


def prompt_chars(messages: list[Message], tools) -> int:
    """A lower bound on the rendered prompt's length: every content, call and tool as compact JSON (templates
    only add to it -- markers, indentation), computed without rendering anything."""
    def compact(v) -> int:
        return len(json.dumps(v, ensure_ascii=False, separators=(",", ":")))
    return (sum(len(m.content) + sum(compact(c.arguments) for c in m.tool_calls) for m in messages)
            + sum(compact(t.get("function", t)) for t in tools or []))
