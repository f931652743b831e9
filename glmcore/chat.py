"""Chat formats of the GLM families: messages (and tools) -> prompt token ids, reply text -> message.

- chatglm2: one text prompt "[Round N]\\n\\n问：{q}\\n\\n答：{a}" joined by "\\n\\n", encoded in one
  go after `[gMASK]sop` (chatglm2-6b's build_prompt + tokenizer(prompt)).
- chatglm3: `[gMASK]sop` + per message `<|role|>` + encode(f"{metadata}\\n") + encode(content)
  (ChatGLM3's build_single_message); tools go into the system turn as ChatGLM3's demo put them;
  a tool call is `<|assistant|>{name}\\n` + "```python\\ntool_call(k=v, ...)\\n```".
- glm4: `[gMASK]<sop>` + per message `<|role|>` + encode(f"{metadata}\\n{content}"), as the
  chat_template of glm-4-9b-chat renders and tokenizes it; tools as that template's system turn;
  a tool call is `<|assistant|>{name}\\n{json arguments}`.

Replies are parsed without eval: ChatGLM3's tool_call(...) with `ast`, GLM-4's arguments with json.
"""
from __future__ import annotations

import copy
import json
import re
import secrets
from dataclasses import dataclass, field

from .errors import ChatError
from .events import ChatEvent, ReasoningDelta, ToolCall  # ToolCall re-exported
from .parsers import ChatGLM3Parser, GLM4Parser, PlainParser, ThinkSplitter, XmlCallParser
from .parsers.reasoning import CLOSE, OPEN
from .parsers.base import NAME as _NAME, Markup
from .template import render as render_template

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Message:
    role: str                        # system | user | assistant | tool ("observation" is an alias of tool)
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    metadata: str = ""               # ChatGLM3/GLM-4 text after <|role|> on the same line
    error: str | None = None         # parse_reply: why a reply that looked like a tool call was kept as text
    # An assistant turn's token ids as generated (after <|assistant|>): re-encoding the text may give other
    # ids, so a server that sends them keeps the cached conversation a prefix of the next prompt.
    ids: list[int] | None = field(default=None, compare=False, repr=False)
    # A reasoning model's thinking (the <think> span of its reply, GLM-Z1); the answer is `content`. None: not
    # given, so a template reads thinking written inline in content (<think>...</think>answer); "" given empty,
    # so content is the answer as it stands (transformers' templates test `reasoning_content is string`).
    reasoning: str | None = None

    def __post_init__(self):
        if self.role == "observation":
            self.role = "tool"
        if self.role not in ROLES:
            raise ChatError(f"unknown message role {self.role!r}: use one of {', '.join(ROLES)} (or observation)")
        if self.content is None:
            self.content = ""
        self.tool_calls = [_as_tool_call(c) for c in self.tool_calls or []]
        self.metadata = self.metadata or ""


def _as_tool_call(c) -> ToolCall:
    """Accept ToolCall, {"name", "arguments"} or OpenAI's {"id", "function": {"name", "arguments": json}}."""
    if isinstance(c, ToolCall):
        return c
    if isinstance(c, dict):
        f = c.get("function", c)
        args = f.get("arguments", f.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ChatError(f"tool call {f.get('name')!r} has arguments that are not JSON ({e}); "
                                 "pass a dict or a JSON object string") from None
        return ToolCall(name=f["name"], arguments=args, id=c.get("id", ""))
    raise TypeError(f"a tool call must be a ToolCall or a dict, not {type(c).__name__}")


def as_message(m) -> Message:
    if isinstance(m, Message):
        return m
    reasoning = m.get("reasoning_content")
    return Message(role=m["role"], content=m.get("content") or "", metadata=m.get("metadata") or "",
                   tool_calls=list(m.get("tool_calls") or []),
                   reasoning=m.get("reasoning") if reasoning is None else reasoning)


def _functions(tools) -> list[dict]:
    """OpenAI tools ({"type": "function", "function": {...}}) or bare function dicts -> function dicts."""
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise ChatError(f"tools must be a list of tool objects, not a {type(tools).__name__}")
    out = []
    for t in tools or []:
        if isinstance(t, dict) and t.get("type", "function") == "function":
            f = t.get("function", t)
            if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not _NAME.fullmatch(f["name"]):
                raise ChatError(f"tool {str(t)[:80]} has no valid function name: use the OpenAI schema "
                                 '{"type": "function", "function": {"name": ..., "parameters": ...}}')
            if any(g["name"] == f["name"] for g in out):    # a call would not say which one it means
                raise ChatError(f"two tools are named {f['name']!r}; give each tool its own name")
            out.append(f)
        else:
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise ChatError(f"tool type {kind!r} is not supported: only function tools (OpenAI schema)")
    return out


class ChatFormat:
    """Prompt building and reply parsing for one family; get one with chat_format_for(tokenizer)."""

    family: str
    stop_ids: list[int]
    tool_parser: type = PlainParser   # the reply format's tool parser (glmcore.parsers)
    can_continue = True  # encode_continuation can extend a cached conversation (False: encode it whole)
    thinking = False     # replies may open with <think>...</think> (split off as Message.reasoning)
    thinking_switch = False   # the template takes enable_thinking (reasoning_effort maps onto it)
    opens_thinking = False   # the generation prompt itself ends with <think> (GLM-Z1): replies start thinking
    continue_final = False   # the last message is an assistant turn left open (TemplateFormat.continuing)

    def continuing(self) -> "ChatFormat":
        """This format with the last message, an assistant's, left open for the reply to continue (vLLM's
        continue_final_message, Anthropic's assistant prefill): TemplateFormat's; the native formats refuse."""
        raise ChatError(f"continuing the last assistant message (a prefill) needs a checkpoint with a chat template; "
                        f"this {self.family} checkpoint uses glmcore's native format: end with a user message")

    def configured(self, template_kwargs: dict | None) -> "ChatFormat":
        """This format with a request's chat_template_kwargs (vLLM's name). glmcore's native formats render no
        template: they take only enable_thinking, which their models (none of them thinks) satisfy as they are."""
        extra = sorted(set(template_kwargs or {}) - {"enable_thinking"})
        if extra:
            raise ChatError(f"chat_template_kwargs {', '.join(map(repr, extra))} apply to checkpoints that ship a chat "
                            f"template (tokenizer.json); this {self.family} checkpoint uses glmcore's native format: "
                            "drop them")
        return self

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.special = tokenizer.special_ids

    # -- prompts
    def check_tools(self, tools) -> list[dict]:
        """The function dicts of `tools`; a ChatError names what this family cannot take."""
        return _functions(tools)

    def encode_messages(self, messages, tools: list[dict] | None = None,
                        add_generation_prompt: bool = True) -> list[int]:
        """The whole prompt, [gMASK]sop prefix included."""
        return self._build([as_message(m) for m in messages], tools, add_generation_prompt)[0]

    def turn_spans(self, messages, tools: list[dict] | None = None,
                   add_generation_prompt: bool = True) -> list[tuple[int, int]]:
        """[start, end) of each turn of encode_messages' output. The first span is the prefix and the
        leading system/tools turn; each later span starts at a user message and runs to the next
        (assistant replies, tool calls and results stay with the user message they answer)."""
        return self._build([as_message(m) for m in messages], tools, add_generation_prompt)[1]

    def encode_continuation(self, new_messages, n_previous_turns: int) -> list[int]:
        """Tokens to append to a cache that holds an earlier prompt and the reply generated to it
        (without the stop token): the new messages and the generation prompt."""
        raise NotImplementedError

    def _build(self, messages: list[Message], tools, add_generation_prompt: bool):
        raise NotImplementedError

    @staticmethod
    def _spans(starts: list[int], total: int) -> list[tuple[int, int]]:
        bounds = sorted(set([0] + [s for s in starts if 0 < s < total]))
        return [(a, b) for a, b in zip(bounds, bounds[1:] + [total])]

    # -- replies
    def parse_reply(self, text: str, tools: list[dict] | None = None) -> Message:
        """The assistant message in a generated reply: plain content or tool calls. Text decoded with
        skip_special=False may hold <|assistant|> between segments (text, then a tool call).
        A reply that looks like a tool call but cannot be parsed comes back as content with .error."""
        stream = ToolCallStream(self, tools)
        stream.feed(text)
        stream.close()
        return stream.message

    def call_prefix(self, name: str) -> list[int]:
        """Ids that open a call of `name` right after the generation prompt's <|assistant|> in a segmented reply
        format (ChatGLM3, GLM-4): the model then writes only its arguments (a server forcing tool_choice)."""
        return self.tool_parser.call_prefix(self.tok, name)

    def decode_reply(self, ids, tools: list[dict] | None = None) -> Message:
        """parse_reply of generated ids (stop tokens are dropped; <|assistant|> separates segments)."""
        stream = ToolCallStream(self, tools)
        for i in ids:
            if i not in self.stop_ids:
                stream.push(i)
        stream.close()
        return stream.message


class ChatGLM2Format(ChatFormat):
    family = "chatglm2"      # plain text replies; no tool calls

    def check_tools(self, tools) -> list[dict]:
        if tools:
            raise ChatError("ChatGLM2 has no tool calling: use ChatGLM3 or GLM-4 for tools")
        return []

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.stop_ids = [tokenizer.eos_id]
        self.prefix = [self.special["[gMASK]"], self.special["sop"]]
        # sp.encode puts the dummy-prefix "▁" before text; in a continuation (text after a reply)
        # it must go. "\n" is byte-fallback, never merged, so encode("\n...") = dummy + encode_rest.
        self._dummy = tokenizer.encode("\n")[:-1]

    def _rounds(self, messages: list[Message], first_round: int) -> tuple[str, list[str]]:
        """System text (ChatGLM2 has no system role: it goes before the rounds) and the rounds' texts."""
        system, rounds, i = [], [], 0
        while i < len(messages):
            m = messages[i]
            if m.role == "system":
                if rounds:
                    raise ChatError("ChatGLM2 has no system role: put the system message first")
                system.append(m.content)
                i += 1
                continue
            if m.role != "user" or m.tool_calls:
                raise ChatError(f"ChatGLM2 expects user/assistant rounds, got {m.role!r} at message {i}: "
                                 "it has no tool calling and no observation role")
            text = f"[Round {first_round + len(rounds)}]\n\n问：{m.content}"
            if i + 1 < len(messages) and messages[i + 1].role == "assistant":
                a = messages[i + 1]
                if a.tool_calls:
                    raise ChatError("ChatGLM2 has no tool calling: remove tool_calls from the history")
                text += f"\n\n答：{a.content}"
                i += 2
            else:
                if i + 1 < len(messages):
                    raise ChatError(f"ChatGLM2 expects user/assistant rounds, got {messages[i + 1].role!r} "
                                     f"after a user message at {i}")
                i += 1
            rounds.append(text)
        return "\n\n".join(system), rounds

    def _build(self, messages, tools, add_generation_prompt):
        if tools:
            raise ChatError("ChatGLM2 has no tool calling: use ChatGLM3 or GLM-4 for tools")
        system, rounds = self._rounds(messages, 1)
        if rounds and add_generation_prompt and messages[-1].role == "user":
            rounds[-1] += "\n\n答："
        # chatglm2-6b builds one string and tokenizes it once; each "\n\n[Round" boundary starts with
        # byte-fallback "\n" pieces, so a prefix of the text encodes to a prefix of the ids.
        texts = ([system] if system else []) + rounds
        ids = self.prefix + (self.tok.encode("\n\n".join(texts)) if texts else [])
        # Each round's span starts with the "\n\n" before its "[Round N]" (round 1: right after
        # the prefix and the system text).
        starts = [len(self.prefix) + (len(self.tok.encode("\n\n".join(texts[:k]))) if k else 0)
                  for k in range(1 if system else 0, len(texts))]
        return ids, self._spans(starts, len(ids))

    def encode_continuation(self, new_messages, n_previous_turns: int) -> list[int]:
        msgs = [as_message(m) for m in new_messages]
        system, rounds = self._rounds(msgs, n_previous_turns + 1)
        if system:
            raise ChatError("ChatGLM2 has no system role: a system message can only open the conversation")
        if not rounds:
            return []
        text = "\n\n" + "\n\n".join(rounds) + ("\n\n答：" if msgs[-1].role == "user" else "")
        ids = self.tok.encode(text)
        assert ids[:len(self._dummy)] == self._dummy
        return ids[len(self._dummy):]


class _RoleFormat(ChatFormat):
    """ChatGLM3 and GLM-4: `<|role|>metadata\\ncontent` turns after a [gMASK]sop prefix."""

    sop: str

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.prefix = [self.special["[gMASK]"], self.special[self.sop]]
        self.assistant_id = self.special["<|assistant|>"]
        self.stop_ids = [tokenizer.eos_id, self.special["<|user|>"], self.special["<|observation|>"]]

    def _turn(self, role: str, metadata: str, content: str) -> list[int]:
        raise NotImplementedError

    def _tools_turn(self, functions: list[dict], messages: list[Message]) -> tuple[list[int], list[Message]]:
        raise NotImplementedError

    def _call_text(self, call: ToolCall) -> str:
        raise NotImplementedError

    def _message(self, m: Message) -> list[int]:
        if m.ids is not None and m.role == "assistant":
            return [self.assistant_id] + list(m.ids)
        role = "observation" if m.role == "tool" else m.role
        ids = []
        if m.content or not m.tool_calls:
            ids += self._turn(role, m.metadata, m.content)
        for call in m.tool_calls:      # each call is its own assistant turn, the tool name as metadata
            ids += self._turn("assistant", call.name, self._call_text(call))
        return ids

    def _build(self, messages, tools, add_generation_prompt):
        ids = list(self.prefix)
        functions = _functions(tools)
        if functions:
            head, messages = self._tools_turn(functions, messages)
            ids += head
        starts = []
        seen_user = False
        for m in messages:
            if m.role == "user":
                starts.append(len(ids))
                seen_user = True
            elif not seen_user and m.role != "system":
                starts.append(len(ids))    # a conversation that does not open with a user message
                seen_user = True
            ids += self._message(m)
        if add_generation_prompt:
            ids.append(self.assistant_id)
        return ids, self._spans(starts, len(ids))

    def encode_continuation(self, new_messages, n_previous_turns: int) -> list[int]:
        # The reply stopped on <|user|>/<|observation|> (not fed), so the next turn starts with it.
        ids = []
        for m in new_messages:
            ids += self._message(as_message(m))
        return ids + [self.assistant_id]


class ChatGLM3Format(_RoleFormat):
    family = "chatglm3"
    tool_parser = ChatGLM3Parser
    sop = "sop"
    TOOLS_SYSTEM = "Answer the following questions as best as you can. You have access to the following tools:"

    def _turn(self, role, metadata, content):
        # build_single_message: metadata line and content are encoded apart (each gets the "▁" prefix).
        return [self.special[f"<|{role}|>"]] + self.tok.encode(f"{metadata}\n") + self.tok.encode(content)

    def _tools_turn(self, functions, messages):
        # ChatGLM3's build_chat_input: system content + "\n" + json.dumps(tools, indent=4, ensure_ascii=False);
        # its demo's system text when the conversation has none.
        rest = list(messages)
        system = self.TOOLS_SYSTEM
        if rest and rest[0].role == "system":
            system = rest.pop(0).content
        content = system + "\n" + json.dumps(functions, indent=4, ensure_ascii=False)
        return self._turn("system", "", content), rest

    def _call_text(self, call):
        # The ChatGLM3 tool-call block; repr() writes values that ast.literal_eval reads back.
        args = ", ".join(f"{k}={v!r}" for k, v in call.arguments.items())
        return f"```python\ntool_call({args})\n```"



class GLM4Format(_RoleFormat):
    family = "glm4"
    tool_parser = GLM4Parser
    sop = "<sop>"
    TOOLS_SYSTEM = ("你是一个名为 GLM-4 的人工智能助手。你是基于智谱AI训练的语言模型 GLM-4 模型开发的，"
                    "你的任务是针对用户的问题和要求提供适当的答复和支持。")

    def _turn(self, role, metadata, content):
        # The chat_template renders "<|role|>{metadata}\n{content}" and skips empty content; the
        # text between two special tokens is tokenized as one piece.
        if not content:
            return []
        return [self.special[f"<|{role}|>"]] + self.tok.encode(f"{metadata}\n{content}")

    def _tools_turn(self, functions, messages):
        # As transformers renders the template (trim_blocks=True): the first "\n" after each
        # `{% if tool['type'] == 'function' %}` is dropped, so a single "\n" precedes "## name".
        text = "\n" + self.TOOLS_SYSTEM + "\n\n# 可用工具"
        for f in functions:
            text += f"\n## {f['name']}\n\n{json.dumps(f, ensure_ascii=False, indent=4)}"
            text += "\n在调用上述函数时，请使用 Json 格式表示调用的参数。"
        return [self.special["<|system|>"]] + self.tok.encode(text), list(messages)

    def _call_text(self, call):
        return json.dumps(call.arguments, ensure_ascii=False)



class TemplateFormat(ChatFormat):
    """Prompts from the checkpoint's template; replies parsed in the format the template writes (GLM-4.5+'s
    XML calls, GLM-4-0414's segments, plain text)."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        if not tokenizer.chat_template:
            raise ChatError(f"{tokenizer.path.parent}: tokenizer_config.json has no chat_template; copy it from the "
                            "original checkpoint (glmcore does not guess a format for tokenizer.json checkpoints)")
        self.family = tokenizer.family
        self.template = tokenizer.chat_template
        # the role and prefix tokens the template writes must be the tokenizer's special tokens: otherwise the
        # prompt spells them as text and the model reads a chat format it was never trained on
        missing = sorted({t for t in re.findall(r"<\|[a-z_]+\|>|\[gMASK\]|<sop>", self.template)
                          if t not in tokenizer.special_ids})
        if missing:
            raise ChatError(f"{tokenizer.path}: the chat template writes {', '.join(missing)}, which "
                            f"{'is not a special token' if len(missing) == 1 else 'are not special tokens'} of "
                            "tokenizer.json; the files are from different checkpoints: copy tokenizer.json and "
                            "tokenizer_config.json from the same one")
        self.stop_ids = list(tokenizer.stop_ids)
        self.assistant_id = self.special.get("<|assistant|>")
        # The template is the protocol. GLM-4.5+ templates write calls as XML (<tool_call>NAME<arg_key>...) from
        # OpenAI's tool_calls and role "tool". GLM-4-0414's call tool results "observation" and write a call as an
        # assistant turn with the tool name as metadata; its generation prompt ends at <|assistant|>, so the reply
        # opens with a metadata line (a tool name or nothing). GLM-Edge's ends with "<|assistant|>\n": plain text.
        xml = "<arg_key>" in self.template and "<tool_call>" in self.template
        self.glm_roles = "observation" in self.template and not xml
        self.tool_parser = (XmlCallParser if xml else GLM4Parser if self.glm_roles and self.assistant_id is not None
                            else PlainParser)
        # A template that rewrites earlier replies (GLM-Z1 drops their thinking) cannot extend a cached
        # conversation with the reply as generated: encode_continuation refuses it (encode the whole conversation).
        self.can_continue = "</think>" not in self.template
        # A template that speaks of <think> is a reasoning model's: its replies' thinking is split off.
        self.thinking = "<think>" in self.template or "</think>" in self.template
        self.thinking_switch = self.thinking and "enable_thinking" in self.template
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

    def continuing(self) -> "TemplateFormat":
        """The last message, an assistant's, is rendered open: the prompt ends where its text does, cut where
        transformers' apply_chat_template(continue_final_message=True) cuts it, and the reply continues it (in the
        answer: the template closed the turn's thinking before its text)."""
        out = copy.copy(self)
        out.continue_final, out.opens_thinking = True, False
        return out

    def _dicts(self, messages: list[Message], text=lambda s: s) -> list[dict]:
        """The messages as the template takes them; text(s) is applied to what the client wrote (not to a
        reply re-encoded from its generated ids, whose special tokens are the model's own)."""
        out = []
        for m in messages:
            role = "observation" if m.role == "tool" and self.glm_roles else m.role
            if m.ids is not None and m.role == "assistant":
                content = self.tok.decode(m.ids, skip_special=False)
                out.append({"role": role, "content": content.lstrip("\n") if self.glm_roles else content})
                continue
            # thinking as transformers' templates take it (GLM-Z1's drops it from earlier replies anyway)
            given = m.role == "assistant" and m.reasoning is not None
            extra = {"reasoning_content": text(m.reasoning)} if given else {}
            content = text(m.content) if isinstance(m.content, str) else m.content
            if not self.glm_roles:
                d = {"role": role, "content": content, **extra}
                if m.tool_calls:
                    d["tool_calls"] = [{"type": "function", "id": c.id, "function": {"name": c.name,
                                        "arguments": _map_strings(c.arguments, text)}} for c in m.tool_calls]
                out.append(d)
                continue
            if m.content or not m.tool_calls:
                d = {"role": role, "content": content, **extra}
                if m.metadata:
                    d["metadata"] = text(m.metadata)
                out.append(d)
            for c in m.tool_calls:
                out.append({"role": "assistant", "metadata": c.name,
                            "content": text(json.dumps(c.arguments, ensure_ascii=False))})
        return out

    def render(self, messages, tools=None, add_generation_prompt: bool = True, text=lambda s: s,
               continue_final: bool | None = None, **variables) -> str:
        """The template's text; continue_final (default: the format's) leaves the last message open."""
        functions = _functions(tools)
        tools_json = [{"type": "function", "function": _map_strings(f, text)} for f in functions] or None
        messages = [as_message(m) for m in messages]
        if continue_final is None:
            continue_final = self.continue_final and bool(messages)
        dicts = self._dicts(messages, text)
        if continue_final:
            # transformers' way: a tag after the text, the prompt cut at it (and the text's end stripped where the
            # template strips it)
            if messages[-1].role != "assistant" or messages[-1].tool_calls or not isinstance(dicts[-1]["content"], str):
                raise ChatError("continuing the last message needs it to be an assistant's text (no tool calls); end "
                                "with the assistant text the reply should continue")
            dicts[-1]["content"] += CONTINUE_TAG
        out = render_template(self.template, dicts, tools_json, add_generation_prompt and not continue_final,
                              **{**self.tok.template_vars, **self.variables, **variables})
        if continue_final:
            at = out.rfind(CONTINUE_TAG.strip())
            if at < 0:
                raise ChatError("the chat template drops the last assistant message's text, so the reply cannot "
                                "continue it; end with a user message")
            out = out[:at] if out[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else out[:at].rstrip()
        return out

    def _encode(self, messages, tools, add_generation_prompt, skip: str = "",
                continue_final: bool = False) -> list[int]:
        """The rendered prompt's ids, the special tokens the template writes matched, and those spelled in the
        client's text (a user typing "<|assistant|>") kept as text, as the native tokenizers keep them: each is
        rendered as a marker that no text holds, and encoded as plain text. skip: a rendered opening to drop.

        Except a spelling the template reads: GLM-4.5's splits an assistant's "<think>…</think>" off its content
        and writes no second /nothink after a user's. A marker would change what it renders, so such a spelling
        is left as written and means to the prompt what it means to the template (transformers' rendering). And a
        switch a user is meant to type (USER_SWITCHES) is the token wherever it is written, whatever the template
        reads (GLM-4.7's reads no /nothink; its model still knows the token)."""
        names = sorted(self.tok.special_ids, key=len, reverse=True)
        guarded = [n for n in names if n not in USER_SWITCHES]
        render = lambda text=lambda s: s: self.render(messages, tools, add_generation_prompt, text=text,
                                                      continue_final=continue_final)
        mark = f"glmcoretext{secrets.token_hex(8)}x"

        def marked(kept: list[str]) -> str:
            spelled = re.compile("|".join(map(re.escape, kept)))
            return render(lambda s: spelled.sub(lambda m: f"{mark}{names.index(m.group(0))}x", s))

        def unmarked(text: str) -> str:
            return re.sub(f"{mark}(\\d+)x", lambda m: names[int(m.group(1))], text)

        rendered = marked(guarded) if guarded else render()
        if mark in rendered and unmarked(rendered) != (plain := render()):
            kept = [n for n in guarded if f"{mark}{names.index(n)}x" in rendered and unmarked(marked([n])) == plain]
            rendered = marked(kept) if kept else plain
            if unmarked(rendered) != plain:         # the kept ones together still change it: none kept
                rendered = plain
        if not rendered.startswith(skip):
            raise ChatError("this chat template does not render a conversation as its opening plus the turns")
        ids, parts = [], re.split(f"{mark}(\\d+)x", rendered[len(skip):])
        for i, part in enumerate(parts):
            ids += self.tok.encode(names[int(part)]) if i % 2 else self.tok.encode_rendered(part) if part else []
        return ids

    def _build(self, messages, tools, add_generation_prompt):
        ids = self._encode(messages, tools, add_generation_prompt, continue_final=self.continue_final)
        # Turn starts: where the prompt of the messages before each user message ends, when that prompt is
        # a prefix of the whole one (it is for GLM's templates); else one span.
        starts, seen_user = [], False
        for k, m in enumerate(messages):
            if m.role == "user" or (not seen_user and m.role != "system"):
                seen_user = True
                head = self._encode(messages[:k], tools, False)
                if ids[:len(head)] == head:
                    starts.append(len(head))
        return ids, self._spans(starts, len(ids))

    def encode_continuation(self, new_messages, n_previous_turns: int) -> list[int]:
        if not self.can_continue:
            raise ChatError("this chat template rewrites earlier replies; build the whole prompt again")
        # The reply stopped on a stop token (not fed): the new messages render as the template renders them
        # after the template's own opening (the [gMASK]<sop> of GLM-4-0414, nothing for GLM-Edge).
        return self._encode(new_messages, None, True, skip=self.render([], None, False))



# Special tokens a user is meant to type in a message: GLM-4.5's documented way to turn thinking off for a turn
# is "/nothink" at the end of it. Encoded as the token (as transformers, vLLM and llama.cpp encode the rendered
# prompt); every other special spelled in a client's text stays text (TemplateFormat._encode).
USER_SWITCHES = frozenset({"/nothink"})
# What transformers appends to the text of a message it continues (apply_chat_template's continue_final_message)
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _map_strings(value, f):
    """value (parsed JSON) with f applied to every string in it, keys included."""
    if isinstance(value, str):
        return f(value)
    if isinstance(value, dict):
        return {_map_strings(k, f): _map_strings(v, f) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, f) for v in value]
    return value


def chat_format_for(tokenizer) -> ChatFormat:
    from .tokenizer import HF_FAMILIES
    if tokenizer.family in HF_FAMILIES:
        # tokenizer.json checkpoints: their own template and stop ids (glmcore.template renders it)
        return TemplateFormat(tokenizer)
    cls = {"chatglm2": ChatGLM2Format, "chatglm3": ChatGLM3Format, "glm4": GLM4Format}.get(tokenizer.family)
    if cls is None:
        raise ChatError(f"no chat format for tokenizer family {tokenizer.family!r}")
    return cls(tokenizer)


# ----------------------------------------------------------------------------- reply parsing


class ToolCallStream:
    """A reply's events as it streams: the format's reasoning parser (thinking goes out as ReasoningDelta), then
    its tool parser (TextDelta, ToolCallStart, ToolCallDelta, ToolCallEvent; glmcore.parsers).

    feed(text) takes decoded text (tags are found in it); push(id) takes token ids and decodes them, a special
    token going on as Markup, so text that only spells a tag stays text. After close(), .message is the reply as
    parse_reply gives it: a call that could not be parsed leaves the whole reply as content, with .error."""

    def __init__(self, chat_format: "ChatFormat", tools: list[dict] | None = None, calls: bool = True):
        self.fmt = chat_format
        self.parser = chat_format.tool_parser(_functions(tools) if tools else None, calls)
        self._think = ThinkSplitter(chat_format.opens_thinking) if chat_format.thinking else None
        self._reasoning = self._r_held = ""
        self._decoder = None
        self.message: Message | None = None
        self.reasoning_tokens = 0

    @property
    def errors(self) -> list[str]:
        return self.parser.errors

    def push(self, id: int) -> list[ChatEvent]:
        tok = self.fmt.tok
        if self._decoder is None:
            from .tokenizer import StreamDecoder
            self._decoder = StreamDecoder(tok)
            # read from ids, a tag that is a special token is one only as that token
            self.parser.lexer.text_tags = tuple(t for t in self.parser.lexer.tags if t not in tok.special_ids)
        thinking = self._think is not None and self._think.state == "think"
        if tok.is_special(id):          # the format's tags go on as Markup; other special tokens add no text
            name = tok.special_names.get(id)
            known = name in self.parser.tags or (self._think is not None and name in (OPEN, CLOSE))
            events = self._text(self._decoder.flush()) + (self._text(Markup(name)) if known else [])
        else:
            events = self._text(self._decoder.push(id))
        if thinking or (self._think is not None and self._think.state == "think"):
            self.reasoning_tokens += 1      # <think>, the thought and </think> (usage's reasoning_tokens)
        return events

    def feed(self, text: str) -> list[ChatEvent]:
        return self._text(text)

    def close(self) -> list[ChatEvent]:
        events = self._text(self._decoder.flush()) if self._decoder is not None else []
        if self._think is not None:
            events += self._split(self._think.close())
        events += self.parser.close()
        p = self.parser
        reasoning = self._reasoning or None     # a reply without thinking renders the same either way
        if p.errors:
            self.message = Message("assistant", content=p.fallback(), error="; ".join(p.errors), reasoning=reasoning)
        else:
            self.message = Message("assistant", content=p.content, tool_calls=list(p.calls), reasoning=reasoning)
        return events

    def _text(self, text: str) -> list:
        if not text:
            return []
        if self._think is None or self._think.state == "answer":
            return self.parser.feed(text)
        if isinstance(text, Markup) and text in self.parser.ends_thinking:
            return self._split(self._think.close()) + self.parser.feed(text)   # thinking never spans segments
        return self._split(self._think.feed(text))

    def _split(self, parts) -> list:
        events = []
        for kind, part in parts:
            events += self.parser.feed(part) if kind == "answer" else self._reason(part)
        return events

    def _reason(self, text: str) -> list:
        # stripped at both ends like the answer: the template writes "<think>\n", the model "\n</think>\n\n"
        text = self._r_held + (text.lstrip() if not self._reasoning else text)
        body = text.rstrip()
        self._r_held = text[len(body):]
        if not body:
            return []
        self._reasoning += body
        return [ReasoningDelta(body)]
