"""The `glmcore` command line: run, chat, serve, backends, make-model, convert, conformance, bench."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field, replace

from . import __version__, arch
from .backend import registry
from .events import ReasoningDelta, TextDelta, ToolCallEvent
from .engine.prompt_cache import DEFAULT_CACHE_MIB
from .engine.speculative import Method
from .scheduler import OVERFLOW_POLICIES, Speculation, WindowPolicy
from .structured import grammar_from_files, reply_constraint
from .errors import ContextOverflow, ChatError, GlmcoreError
from .files import check_text, decode_text, read_bounded
from .options import add_load_args, load_options
from .sampling import SamplingParams


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default (except where there is none)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


def add_gen_args(p: argparse.ArgumentParser) -> None:
    d = SamplingParams()
    p.add_argument("--system", help="system prompt")
    p.add_argument("--max-new-tokens", type=int, default=256, help="most tokens in one reply")
    # left out: what the checkpoint recommends (generation_config.json / a GGUF's general.sampling.*), else these
    given = "the checkpoint's generation_config.json, else"
    p.add_argument("--temperature", type=float, help=f"0 = greedy (default: {given} {d.temperature:g})")
    p.add_argument("--top-p", type=float, help=f"nucleus sampling mass, 1 = off (default: {given} {d.top_p:g})")
    p.add_argument("--top-k", type=int, help=f"sample among the k likeliest, 0 = off (default: {given} {d.top_k})")
    p.add_argument("--repetition-penalty", type=float, help=f"1 = off (default: {given} {d.repetition_penalty:g})")
    p.add_argument("--presence-penalty", type=float, default=d.presence_penalty,
                   help="subtracted from the logit of each token already generated (OpenAI's; -2..2, 0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty,
                   help="subtracted once per time a token was generated (OpenAI's; -2..2, 0 = off)")
    p.add_argument("--seed", type=int, help="random seed (default: a fresh one per run)")
    p.add_argument("--overflow", choices=OVERFLOW_POLICIES, default="error",
                   help="when the context is full: error, or slide a StreamingLLM window")
    p.add_argument("--n-keep", type=int, default=4, help="window: tokens kept as attention sinks")
    p.add_argument("--n-discard", type=int, help="window: tokens discarded per slide (default half)")
    p.add_argument("--show-thinking", action="store_true",
                   help="print a reasoning model's thinking (GLM-Z1): dimmed on a terminal, in <think> tags otherwise "
                        "(default: hidden; a terminal shows a dim 'thinking...' while it lasts)")
    p.add_argument("--no-thinking", action="store_true",
                   help="ask the chat template for a reply without thinking (enable_thinking=false); only where the "
                        "template has that switch (GLM-Z1's has none: it always thinks)")


class ThinkingView:
    """How a reply's thinking reaches stdout: hidden (a terminal shows a dim "thinking..." until the answer
    starts), or shown dimmed on a terminal and between <think> tags in a pipe, so a script can strip it."""

    MARK = "thinking..."

    def __init__(self, show: bool, tty: bool):
        self.show, self.tty, self.state = show, tty, None      # None | "thinking" | "answer"

    def reasoning(self, text: str) -> str:
        first, self.state = self.state is None, "thinking"
        if not self.show:
            return f"\x1b[2m{self.MARK}\x1b[0m" if first and self.tty else ""
        if self.tty:                    # dim from the first piece until the answer resets it
            return ("\x1b[2m" if first else "") + text
        return ("<think>\n" if first else "") + text

    def answer(self) -> str:
        """What goes out before the first answer text or tool call."""
        was, self.state = self.state, "answer"
        if was != "thinking":
            return ""
        if not self.show:
            return f"\x1b[{len(self.MARK)}D\x1b[K" if self.tty else ""    # erase the mark
        return "\x1b[0m\n\n" if self.tty else "\n</think>\n\n"

    def end(self) -> str:
        return self.answer() if self.state == "thinking" else ""


def thinking_view(a) -> ThinkingView:
    return ThinkingView(a.show_thinking, sys.stdout.isatty())


def template_kwargs(a) -> dict | None:
    return {"enable_thinking": False} if a.no_thinking else None


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", choices=[m.value for m in Method], default="off",
                   help="speculative decoding, drafts verified in one batched step (a backend with native batched "
                        "steps): ngram by prompt lookup, mtp by the checkpoint's NextN layer (the MoE GLMs' and "
                        "the demo model's, on torch, cpu_int4, openvino_amx and ascend_npu); the output is the one "
                        "without it")
    p.add_argument("--draft-tokens", type=int, default=4, help="with --speculative: most drafted tokens per step")


def speculation(a) -> Speculation:
    return Speculation(a.speculative, a.draft_tokens)


def sampling(a, defaults: SamplingParams = SamplingParams()) -> SamplingParams:
    """The flags' SamplingParams; a flag left out is the loaded checkpoint's recommendation (`defaults`). Called
    before the load too (with glmcore's defaults), so a bad flag is refused before the weights load."""
    given = {k: getattr(a, k) for k in ("temperature", "top_p", "top_k", "repetition_penalty")
             if getattr(a, k) is not None}
    return replace(defaults, **given, seed=a.seed, presence_penalty=a.presence_penalty,
                   frequency_penalty=a.frequency_penalty)


def _pipeline(a):
    from .pipeline import Pipeline
    window = WindowPolicy(a.overflow, a.n_keep, a.n_discard)
    return Pipeline(a.model, a.backend, load_options(a), window, speculation=speculation(a))


def _messages(system: str | None) -> list[dict]:
    return [{"role": "system", "content": system}] if system else []


def cmd_run(a) -> int:
    if (a.prompt is None) == (a.prompts is None):
        raise GlmcoreError("give either --prompt TEXT or --prompts FILE (one prompt a line)")
    if a.slots is not None and a.slots < 1:     # as `serve --slots 0`: an error, not a hidden meaning
        raise GlmcoreError(f"invalid --slots {a.slots}: use a positive number (omit it for one slot per prompt, "
                           f"up to {DEFAULT_MAX_SLOTS})")
    if a.prompts is not None:
        return _run_batch(a)
    sampling(a)
    grammar = grammar_from_files(a.json_schema, a.grammar)
    pipe = _pipeline(a)
    params = sampling(a, pipe.model.sampling)
    messages = _messages(a.system) + [{"role": "user", "content": a.prompt}]
    _stream_reply(pipe, messages, None, params, a.max_new_tokens, grammar=grammar, view=thinking_view(a),
                  template_kwargs=template_kwargs(a))
    print(f"[{pipe.model.backend.name}] {pipe.timings.line()}", file=sys.stderr)
    return 0


def _run_batch(a) -> int:
    """--prompts FILE: every line a prompt, run together through the continuous-batching scheduler."""
    import time

    from .chat import as_message
    from .model import load_model
    from .pipeline import chat_request
    fix = "give a UTF-8 text file, one prompt a line"
    data = read_bounded(a.prompts, MAX_PROMPTS_BYTES, "--prompts", fix)
    prompts = [line for line in decode_text(data, f"--prompts {a.prompts!r}", fix).splitlines() if line.strip()]
    if not prompts:
        raise GlmcoreError(f"--prompts {a.prompts!r} has no prompt; write one prompt a line")
    sampling(a)
    window = WindowPolicy(a.overflow, a.n_keep, a.n_discard)
    grammar = grammar_from_files(a.json_schema, a.grammar)
    # a slot holds a whole context of KV cache: a file of 100,000 prompts must not ask for 100,000 of them
    m = load_model(a.model, a.backend, load_options(a), slots=min(a.slots or DEFAULT_MAX_SLOTS, len(prompts)),
                   token_budget=a.token_budget, speculation=speculation(a))
    params = sampling(a, m.sampling)
    sched = m.scheduler
    start = time.perf_counter()
    handles = []
    opening, constraint = reply_constraint(m.chat_format, m.config.vocab_size, grammar)
    for text in prompts:
        messages = [as_message(x) for x in _messages(a.system) + [{"role": "user", "content": text}]]
        request = chat_request(m.chat_format.configured(template_kwargs(a)), messages, None, params, a.max_new_tokens,
                               window)
        request.prompt, request.constraint = list(request.prompt) + opening, constraint
        handles.append(sched.submit(request))
    sched.run()
    wall = time.perf_counter() - start
    for i, (text, h) in enumerate(zip(prompts, handles), 1):
        reply = m.chat_format.configured(template_kwargs(a)).decode_reply(opening + h.tokens)
        calls = "".join(f"\n[tool call] {c.name}({json.dumps(c.arguments, ensure_ascii=False)})" for c in reply.tool_calls)
        thought = f"<think>\n{reply.reasoning}\n</think>\n\n" if a.show_thinking and reply.reasoning else ""
        print(f"--- [{i}] {text}\n{thought}{reply.content}{calls}")
        if h.error is not None:
            print(f"error in prompt {i}: {h.error}", file=sys.stderr)
        elif h.context_full:
            print(f"note: reply {i} stopped because the context of {sched.capacity} tokens is full; raise --ctx or "
                  "use --overflow window", file=sys.stderr)
    generated = sum(len(h.tokens) for h in handles)
    prompt_tok = sum(h.timings.prompt_tokens for h in handles)
    print(f"[{m.backend.name}] {len(prompts)} prompts on {sched.batch.n_slots} slots"
          f"{'' if sched.native else ' (adapter: not natively batched)'} | prompt {prompt_tok} tok, "
          f"generated {generated} tok in {wall:.2f} s | {generated / wall:.1f} tok/s aggregate | {sched.steps} steps"
          + (f" | drafted {sched.drafted}, accepted {sched.accepted}" if sched.drafted else ""),
          file=sys.stderr)
    m.close()
    return 1 if any(h.error is not None for h in handles) else 0


def _stream_reply(pipe, messages, tools, params, max_new_tokens, shown: list | None = None, grammar=None,
                  view: ThinkingView | None = None, template_kwargs: dict | None = None) -> None:
    """Stream one reply to stdout; `shown` collects the text written (what the user saw if interrupted)."""
    view = view or ThinkingView(False, False)
    view.state = None                   # a new reply
    for event in pipe.chat(messages, tools=tools, stream=True, params=params, max_new_tokens=max_new_tokens,
                           grammar=grammar, template_kwargs=template_kwargs):
        if isinstance(event, ReasoningDelta):
            sys.stdout.write(view.reasoning(event.text))
            sys.stdout.flush()
            continue
        sys.stdout.write(view.answer())
        if isinstance(event, TextDelta):
            sys.stdout.write(event.text)
            sys.stdout.flush()
            if shown is not None:
                shown.append(event.text)
        elif isinstance(event, ToolCallEvent):
            call = event.call
            sys.stdout.write(f"\n[tool call] {call.name}({json.dumps(call.arguments, ensure_ascii=False)})")
    sys.stdout.write(view.end() + "\n")
    sys.stdout.flush()
    if pipe.context_full:
        print(f"note: the reply stopped because the context of {pipe.model.scheduler.capacity} tokens is full; "
              "raise --ctx or use --overflow window", file=sys.stderr)


CHAT_HELP = ("commands: /system TEXT (none: clear it), /tools FILE.json (/tools none: clear them), /think on|off, "
             "/reset, /quit")
MAX_PROMPTS_BYTES = 64 << 20     # run --prompts: far more than one batch can hold, and never an endless read
MAX_TOOLS_BYTES = 4 << 20        # chat /tools: the server's body limit
MAX_LINE_CHARS = 1 << 20         # one line of chat input from a pipe
DEFAULT_MAX_SLOTS = 64           # run --prompts without --slots: one slot per prompt, up to this many


def _load_tools(arg: str, chat_format) -> tuple[list, list[str]]:
    """The tools of `/tools FILE.json` (a list of OpenAI tools, or one tool object) and their names."""
    fix = "give a JSON file with a list of tools"
    data = read_bounded(arg, MAX_TOOLS_BYTES, "tools from", fix, ChatError)
    try:
        tools = json.loads(decode_text(data, f"/tools {arg!r}", fix, ChatError))
    except (ValueError, RecursionError) as e:
        raise ChatError(f"cannot read tools from {arg!r} ({type(e).__name__}: {str(e)[:80]}); {fix}") from None
    if isinstance(tools, dict):
        tools = [tools]
    return tools, [f["name"] for f in chat_format.check_tools(tools)]


@dataclass
class ChatState:
    """What `glmcore chat` holds between turns: the system prompt, the tools and the messages so far."""
    system: str | None = None
    tools: list | None = None
    history: list = field(default_factory=list)
    thinking: bool | None = None     # /think on|off: the template's enable_thinking (None: the template's default)

    setup_overflows: bool = False    # the system prompt and tools alone do not fit the context

    def template_kwargs(self) -> dict | None:
        return None if self.thinking is None else {"enable_thinking": self.thinking}

    def messages(self) -> list:
        return _messages(self.system) + self.history


def _input(prompt: str) -> str:
    """input(), bounded: a terminal's lines are typed, but piped stdin (/dev/zero) may never end a line."""
    try:
        piped = not sys.stdin.isatty() and sys.stdin.fileno() >= 0
    except (OSError, ValueError, AttributeError):     # a stand-in stdin without a file (an embedding, a test)
        piped = False
    if not piped:
        return input(prompt)
    print(prompt, end="", flush=True)
    line = sys.stdin.readline(MAX_LINE_CHARS + 1)
    if not line:
        raise EOFError
    if len(line) > MAX_LINE_CHARS:
        # the rest of that line is read and dropped (a bounded amount: stdin from /dev/zero never ends a line)
        dropped = len(line)
        while not line.endswith("\n") and line:
            if dropped > MAX_DROPPED_CHARS:
                raise GlmcoreError(f"a line of input is longer than {MAX_DROPPED_CHARS >> 20} Mi characters and goes "
                                   "on; is stdin a stream without lines? Send text lines")
            line = sys.stdin.readline(MAX_LINE_CHARS)
            dropped += len(line)
        raise _LongLine(f"that line has {dropped} characters, more than {MAX_LINE_CHARS >> 20} Mi; it was not sent: "
                        "send shorter lines (or a file of prompts with `glmcore run --prompts`)")
    return line.rstrip("\n")


class _LongLine(GlmcoreError):
    """One line of input too long to take: refused, and the session goes on."""


MAX_DROPPED_CHARS = 64 << 20     # of one over-long line, read and dropped before giving up


def _read_line(prompt: str) -> str | None:
    """One line of stdin (EOFError at the end); a line that is too long or not UTF-8 is an error for that line
    only."""
    while True:
        try:
            line = _input(prompt)
        except _LongLine as e:
            print(f"error: {e}", file=sys.stderr)
            continue
        try:
            return check_text(line, "the line", "type it again as UTF-8 text")
        except GlmcoreError as e:
            print(f"error: {e}", file=sys.stderr)


def cmd_chat(a) -> int:
    sampling(a)
    pipe = _pipeline(a)
    params = sampling(a, pipe.model.sampling)
    state = ChatState(a.system, thinking=False if a.no_thinking else None)
    # undecodable bytes arrive as surrogates and are refused per line, instead of ending the session
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
    print(f"glmcore chat on {pipe.model.backend.name} ({pipe.model.config.family}); {CHAT_HELP}", file=sys.stderr)
    while True:
        try:
            line = _read_line("user> ")
        except EOFError:
            return 0
        if not line.strip():
            continue
        if line.startswith("/"):
            cmd, _, arg = line.partition(" ")
            arg = arg.strip()
            if cmd == "/quit":
                return 0
            if cmd == "/reset":
                state.history = []
                pipe.reset()
                if state.setup_overflows:    # keeping them would fail the next turn again
                    state.system, state.tools, state.setup_overflows = None, None, False
                    print("(conversation, system prompt and tools cleared: they alone overflowed the context)",
                          file=sys.stderr)
                else:
                    print("(conversation cleared)", file=sys.stderr)
            elif cmd == "/system":
                state.system = None if arg.lower() in ("", "none") else arg
                state.history, state.setup_overflows = [], False
                print(f"(system prompt {'set' if state.system else 'cleared'}; conversation cleared)",
                      file=sys.stderr)
            elif cmd == "/think":
                if arg.lower() not in ("on", "off"):
                    print("usage: /think on|off", file=sys.stderr)
                elif not pipe.model.chat_format.thinking_switch:
                    print("error: this model's chat template has no thinking switch (enable_thinking); /think does "
                          "not apply to it", file=sys.stderr)
                else:
                    state.thinking = arg.lower() == "on"
                    print(f"(thinking {arg.lower()} from the next reply)", file=sys.stderr)
            elif cmd == "/tools" and arg.lower() == "none":
                state.tools, state.history, state.setup_overflows = None, [], False
                print("(tools cleared; conversation cleared)", file=sys.stderr)
            elif cmd == "/tools" and not arg:
                names = [f["name"] for f in pipe.model.chat_format.check_tools(state.tools)] if state.tools else []
                print(f"({len(names)} tools loaded{': ' + ', '.join(names) if names else ''}) usage: /tools FILE.json "
                      "loads tools, /tools none clears them", file=sys.stderr)
            elif cmd == "/tools":
                try:
                    tools, names = _load_tools(arg, pipe.model.chat_format)
                except GlmcoreError as e:
                    print(f"error: {e}", file=sys.stderr)
                    continue
                state.tools, state.history, state.setup_overflows = tools, [], False
                print(f"({len(names)} tools loaded: {', '.join(names)}; conversation cleared)", file=sys.stderr)
            else:
                print(f"unknown command {cmd}; {CHAT_HELP}", file=sys.stderr)
            continue
        state.history.append({"role": "user", "content": line})
        if not _chat_turn(pipe, state, params, a.max_new_tokens, thinking_view(a), state.template_kwargs()):
            return 0


def _chat_turn(pipe, state: ChatState, params, max_new_tokens, view: ThinkingView | None = None,
               template_kwargs: dict | None = None) -> bool:
    """One user turn: replies, and the tool results they ask for. Returns whether the session goes on."""
    history = state.history
    while True:
        print("assistant> ", end="", flush=True)
        shown: list[str] = []
        try:
            _stream_reply(pipe, state.messages(), state.tools, params, max_new_tokens, shown, view=view,
                          template_kwargs=template_kwargs)
        except KeyboardInterrupt:
            # Ctrl-C ends this reply, not the session. The cache holds a half-generated turn, so the
            # next turn starts from the conversation (with the text shown so far) again.
            pipe.reset()
            history.append({"role": "assistant", "content": "".join(shown).strip()})
            print("\n(reply interrupted)", file=sys.stderr)
            return True
        except ContextOverflow as e:
            # the conversation no longer fits: say so and keep the session (the user can /reset)
            history.pop()
            if _setup_overflows(pipe, state):
                state.setup_overflows = True
                print(f"\nerror: {e}; the system prompt and tools alone fill the context: /reset clears them "
                      "(or shorten them: /system TEXT, /tools none)", file=sys.stderr)
            else:
                print(f"\nerror: {e}; /reset starts a new conversation", file=sys.stderr)
            return True
        reply = pipe.cached[-1]
        history.append(reply)
        print(f"[{pipe.timings.line()}]", file=sys.stderr)
        if not reply.tool_calls:
            return True
        for call in reply.tool_calls:
            try:
                result = _read_line(f"tool result for {call.name}> ")
            except EOFError:
                return False
            if result.strip() == "/quit":
                return False
            if result.strip() == "/reset":
                history.clear()
                pipe.reset()
                print("(conversation cleared)", file=sys.stderr)
                return True
            history.append({"role": "tool", "content": result})


def _setup_overflows(pipe, state: ChatState) -> bool:
    """Whether the system prompt and tools alone, with an empty user turn, leave no room in the context."""
    if not (state.system or state.tools):
        return False
    from .chat import as_message
    messages = [as_message(m) for m in _messages(state.system) + [{"role": "user", "content": ""}]]
    n = len(pipe.model.chat_format.encode_messages(messages, tools=state.tools))
    return n >= pipe.model.scheduler.capacity


def cmd_backends(a) -> int:
    reg = registry()
    rows = []
    for name in reg.names():
        entry = reg.entries[name]
        pr = reg.probe(name)
        caps = entry.backend.capabilities() if entry.backend else None
        rows.append({
            "backend": name, "ready": pr.ready, "device": pr.device,
            "precisions": list(caps.precisions) if caps else [], "weights": list(caps.weight_formats) if caps else [],
            "why not": pr.reason, "install": pr.install, "details": pr.details,
            "batching": _batching(caps),
            "prompt cache": ("serve --cache-ram: slots' KV kept in host RAM" if caps.kv_export else
                             "none (its KV cannot be exported)") if caps else "",
            "architectures": entry.backend.architectures() if entry.backend else [],
        })
    if a.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    for r in rows:
        status = "ready" if r["ready"] else "not ready"
        print(f"{r['backend']:<14} {status:<10} device={r['device']}  precisions={','.join(r['precisions'])}  "
              f"weights={','.join(r['weights'])}")
        if not r["ready"]:
            print(f"{'':<14} why: {r['why not']}" + (f"  fix: {r['install']}" if r["install"] else ""))
        for k, v in {**r["details"], "batching": r["batching"], "prompt cache": r["prompt cache"],
                     "architectures": "; ".join(r["architectures"])}.items():
            print(f"{'':<14} {k}: {v}")
    from .autoselect import BENCH_SHAPES, cached, choose, describe
    if any(r["ready"] for r in rows):       # which one runs without --backend, with the numbers behind it
        dense = choose(reg)
        print("\n".join(describe(dense, reg.best())))
        if dense is not None and dense.results:   # measured (not pinned): the other architectures' choices too,
            for arch_name in sorted(BENCH_SHAPES.keys() - {"glm"}):      # where a checkpoint of them was loaded
                if (choice := cached(None, arch_name)) is not None:
                    print("\n".join(describe(choice, reg.best())))
    return 0


def _batching(caps) -> str:
    if caps is None:
        return ""
    if caps.native_batch:
        return "native batched steps" + (f" (up to {caps.max_slots} sequences)" if caps.max_slots else "")
    return "core adapter: one session per sequence (correct, not faster)"


def cmd_cache(a) -> int:
    from . import cache
    if a.action == "list":
        found = cache.entries()
        for e in found:
            age = (time.time() - e.last_used) / 86400
            print(f"{e.size / 2**20:10.1f} MiB  used {age:5.1f} days ago  {e.state:<12}  {e.name}")
        print(f"{sum(e.size for e in found) / 2**20:10.1f} MiB in {len(found)} entries under {cache.cache_root()}")
    elif a.action == "remove":
        if not a.names:
            raise GlmcoreError("cache remove: name the entries to remove (as `glmcore cache list` shows them), "
                               "or `all`")
        found = {e.name: e for e in cache.entries()}
        chosen = [e for e in found.values() if e.ours] if a.names == ["all"] else []
        for name in [] if a.names == ["all"] else a.names:
            if name.rstrip("/") not in found:
                raise GlmcoreError(f"cache remove: no entry {name!r}; see `glmcore cache list`")
            chosen.append(found[name.rstrip("/")])
        foreign = [e.name for e in chosen if not e.ours]
        if foreign:
            raise GlmcoreError(f"cache remove: {foreign[0]} has no glmcore seal, so glmcore did not write it and "
                               "will not delete it; remove it yourself if it is yours to delete")
        for e in chosen:
            cache.remove(e)
            print(f"removed {e.name} ({e.size / 2**20:.1f} MiB)")
    else:
        if not a.older_than >= 0:       # nan compares false both ways
            raise GlmcoreError(f"invalid --older-than {a.older_than}: use a number of days >= 0")
        gone = cache.prune(a.older_than)
        for e in gone:
            print(f"removed {e.name} ({e.size / 2**20:.1f} MiB, {e.state})")
        print(f"freed {sum(e.size for e in gone) / 2**20:.1f} MiB")
    return 0


def cmd_make_model(a) -> int:
    from .synth import make_model
    if not 0 <= a.seed < 2**64:
        raise GlmcoreError(f"invalid --seed {a.seed}: use an integer from 0 to 2**64-1")
    if a.generated_weights and (a.shards is not None or a.format != "safetensors"):
        raise GlmcoreError("--generated-weights writes no weight files: drop --shards/--format")
    try:
        cfg = make_model(a.family, a.size, a.out, fmt=a.format, shards=a.shards, seed=a.seed,
                         tokenizer_from=a.tokenizer_from, dtype=a.dtype, progress=progress, layers=a.layers,
                         generated=a.generated_weights)
    except OSError as e:            # the output directory cannot be written (a read-only or virtual filesystem)
        raise GlmcoreError(f"--out {a.out}: cannot write the checkpoint there ({e.strerror or e}); choose "
                           "another directory") from None
    how = "weights generated when read, none on disk" if a.generated_weights else "random weights"
    print(f"wrote {a.family} {a.size} ({cfg.num_params() / 1e6:.1f}M parameters, {how}) to {a.out}")
    return 0


def cmd_convert(a) -> int:
    from .cache import new_output_dir, seal
    from .model import open_checkpoint, resolve_backend
    if not a.model:
        raise GlmcoreError("--model is empty; name a checkpoint directory or a .gguf file")
    ckpt = open_checkpoint(a.model)
    cfg = ckpt.config
    backend = resolve_backend(a.backend, cfg)
    opts = load_options(a)
    if opts.tp != 1:
        raise GlmcoreError("--tp splits a model while it runs; convert writes one converted model, drop --tp")
    for key in ("seq_len", "group_size", "quantize", "quant", "calib"):
        if getattr(a, key) is not None:
            opts.extra[key] = getattr(a, key)
    opts = backend.resolve(opts)
    weights = ckpt.weights()
    out = new_output_dir(a.out)
    try:
        backend.convert(cfg, weights, opts, out, progress)
        seal(out, source=weights.fingerprint())      # what it holds and which checkpoint it came from
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)       # it was new or empty: a failed convert leaves nothing
        raise
    print(f"converted {a.model} for {backend.name} into {out}")
    return 0


def cmd_serve(a) -> int:
    from .server import ServeOptions, serve    # lazily: the web stack is the optional extra glmcore[server]
    api_key = a.api_key if a.api_key is not None else os.environ.get("GLMCORE_API_KEY")
    if a.api_key is None and api_key is not None:
        check_text(api_key, "$GLMCORE_API_KEY")
        if not api_key.strip():
            raise GlmcoreError("$GLMCORE_API_KEY is set but empty; give it a key, or unset it to serve without one")
    so = ServeOptions(a.host, a.port, a.slots, a.token_budget, a.max_queue,
                      api_key, a.served_name, a.max_body_mb << 20,
                      a.grace, a.read_timeout, a.log_level, a.replicas, a.ray_address,
                      _names(a.allowed_hosts), _names(a.cors_origins), speculation(a),
                      None if a.max_thinking_tokens == -1 else a.max_thinking_tokens, a.cache_ram)
    so.check()
    if so.replicas != 1 or so.ray_address:       # replicas of the server behind Ray Serve's proxy
        from .server.replicas import serve_replicas
        return serve_replicas(a.model, a.backend, load_options(a), so)
    return serve(a.model, a.backend, load_options(a), so)


def _names(value: str | None) -> tuple[str, ...]:
    """A comma-separated option's entries."""
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="glmcore", description="Run GLM chat models on any hardware.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("run", help="answer one prompt, streamed")
    add_load_args(p)
    add_gen_args(p)
    add_spec_args(p)
    p.add_argument("--prompt", help="the user message")
    p.add_argument("--prompts", metavar="FILE", help="a file of prompts, one a line, run together as one batch")
    p.add_argument("--slots", type=int, help="with --prompts: sequences in flight at once (default: one per prompt, "
                   "at most 64)")
    p.add_argument("--json-schema", metavar="FILE", help="the reply is JSON matching this JSON Schema (constrained)")
    p.add_argument("--grammar", metavar="FILE", help="the reply matches this Lark grammar (llguidance's dialect)")
    p.add_argument("--token-budget", type=int, default=256,
                   help="with --prompts: tokens per batched step (decode tokens + prefill chunks) (default: %(default)s)")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("chat", help="interactive multi-turn chat")
    add_load_args(p)
    add_gen_args(p)
    add_spec_args(p)
    p.set_defaults(fn=cmd_chat)

    p = sub.add_parser("backends", help="list backends: ready or why not")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=cmd_backends)

    p = sub.add_parser("cache", help="list, remove or prune converted models and synthetic checkpoints")
    p.add_argument("action", choices=["list", "remove", "prune"], help="what to do")
    p.add_argument("names", nargs="*", help="remove: entries as `list` shows them, or all")
    p.add_argument("--older-than", type=float, default=30.0,
                   help="prune: also remove entries unused for this many days")
    p.set_defaults(fn=cmd_cache)

    p = sub.add_parser("make-model", help="write a synthetic checkpoint in a family's real layout")
    p.add_argument("--family", required=True, choices=arch.synthetic_families(),
                   help="glm4-0414: GLM-4-0414/Z1 layout (transformers glm4); glm-edge: GLM-Edge layout (glm)")
    p.add_argument("--size", default="tiny", choices=arch.synthetic_sizes(),
                   help="architecture size (6b: chatglm families; 9b/32b: glm4-0414; air/355b: glm4-moe; "
                        "flash: glm4-moe-lite)")
    p.add_argument("--layers", type=int, help="fewer layers of the size's width (e.g. --size 32b --layers 4)")
    p.add_argument("--out", required=True, help="a new or empty directory")
    p.add_argument("--format", default="safetensors", choices=["safetensors", "bin"], help="weight file format")
    p.add_argument("--shards", type=int, help="number of weight files (default: 2 for tiny, ~2 GiB each otherwise)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--dtype", choices=["f32", "f16", "bf16"], help="default f32 for tiny/small, bf16 otherwise")
    p.add_argument("--tokenizer-from", help="copy the tokenizer files of a real checkpoint directory (glm4-moe: "
                   "GLM-4's tokenizer.model, whose ranks with GLM-4.5's special tokens make GLM-4.5's tokenizer "
                   "and the real 151552-row vocabulary)")
    p.add_argument("--generated-weights", action="store_true",
                   help="write no weight files: glmcore makes the weights from --seed whenever it reads the model "
                        "(for shapes that do not fit on the disk; `glmcore convert --backend cpu_int4` streams them "
                        "into the packed form one tensor at a time). Other programs cannot read such a checkpoint")
    p.set_defaults(fn=cmd_make_model)

    p = sub.add_parser("convert", help="write a backend's converted model (IR, ONNX parts, packed int4)")
    add_load_args(p, model_help="checkpoint dir or .gguf file to convert (required)")
    p.add_argument("--out", required=True, help="a new or empty directory")
    p.add_argument("--seq-len", type=int, help="tpu_bm1684x: fixed context")
    p.add_argument("--quantize", help="tpu_bm1684x: F16|BF16|W8F16|W4F16")
    p.add_argument("--group-size", type=int, help="cpu_int4: quantization group")
    p.add_argument("--quant", choices=["rtn", "gptq"], help="cpu_int4, openvino_amx int4: rtn (round to nearest, "
                   "the default) or gptq (calibrated on --calib, same format)")
    p.add_argument("--calib", help="with --quant gptq: a UTF-8 text file to calibrate on (default: the sample "
                   "shipped with glmcore)")
    p.set_defaults(fn=cmd_convert)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs glmcore[server])")
    add_load_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback only by default)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port)")
    p.add_argument("--slots", type=int, default=4, help="sequences generated at once (continuous batching)")
    p.add_argument("--token-budget", type=int, default=256,
                   help="tokens per batched step: more admits prompts faster, fewer keeps decoding smoother")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429")
    p.add_argument("--cache-ram", type=int, metavar="MIB", help="host RAM for the prompt cache: conversations that "
                   "leave their slots keep their KV there and come back without a new prefill (0: off; default: "
                   f"{DEFAULT_CACHE_MIB} MiB, as llama.cpp's, on backends that can export their KV: see `glmcore "
                   "backends`)")
    add_spec_args(p)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $GLMCORE_API_KEY, else none)")
    p.add_argument("--allowed-hosts", metavar="NAMES", help="comma-separated host names clients may reach the server "
                   "by, besides the listening address and localhost (other Host headers get 421; '*': any). Default: "
                   "any when listening on 0.0.0.0 or ::")
    p.add_argument("--cors-origins", metavar="ORIGINS", help="comma-separated web origins whose pages may call the API "
                   "from a browser, e.g. http://localhost:3000 (default: none; the chat page at / needs none)")
    p.add_argument("--max-thinking-tokens", "--reasoning-budget", type=int, metavar="N",
                   help="a thinking model's thought ends after N tokens with its own </think> and the answer follows, "
                   "where a request names no budget (its max_thinking_tokens / thinking_budget_tokens); -1 or none: "
                   "no limit")
    p.add_argument("--served-name", help="the model id clients send (default: the model directory's name)")
    p.add_argument("--max-body-mb", type=int, default=4, help="largest request body, MiB (413 above)")
    p.add_argument("--grace", type=float, default=10.0, help="seconds running requests get to finish on SIGTERM")
    p.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a request's head, and then its body, may take to arrive (slower clients are cut off)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="N copies of the engine behind Ray Serve's HTTP proxy, one process each (glmcore[ray])")
    p.add_argument("--ray-address", help="with --replicas: join this Ray cluster (default: a local instance "
                   "started and stopped with the command)")
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("conformance", help="check backends against the torch reference", add_help=False)
    p.set_defaults(fn=None)
    p = sub.add_parser("bench", help="measure prefill/decode speed and memory", add_help=False)
    p.set_defaults(fn=None)
    p = sub.add_parser("eval", help="perplexity (one backend or a table across backends) and lm-evaluation-harness "
                       "tasks", add_help=False)
    p.set_defaults(fn=None)
    for p in sub.choices.values():
        p.formatter_class = _HelpFormatter
    return ap


def _check_args(a) -> None:
    """Every text argument is UTF-8: argv bytes that are not arrive as surrogates (surrogateescape) and would
    crash a tokenizer or a file name later; refuse them here, naming the option."""
    for dest, value in vars(a).items():
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str):
                check_text(v, f"--{dest.replace('_', '-')}", "pass UTF-8 text")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = build_parser()
    try:
        from .parallel import torchrun_world
        if torchrun_world() > 1:          # one rank of a torchrun job: rank 0 runs the command, the others follow
            from . import parallel
            if os.environ.get("RANK", "0") != "0":
                return parallel.follower_main()
            parallel.group(torchrun_world())
        if argv and argv[0] in ("conformance", "bench"):
            import importlib
            module = importlib.import_module(f"glmcore_conformance.{'suite' if argv[0] == 'conformance' else 'bench'}")
            return module.main(argv[1:])
        if argv and argv[0] == "eval":
            from .evaluate.cli import main as eval_main
            return eval_main(argv[1:])
        a = ap.parse_args(argv)
        _check_args(a)
        return a.fn(a)
    except GlmcoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception:       # not bad input (that is a GlmcoreError): a bug in glmcore
        import traceback
        traceback.print_exc()
        print(f"error: this is a bug in glmcore {__version__}, not a problem with your input; please report it "
              "with the traceback above", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
