"""Constrained decoding: a request's grammar (JSON Schema, json_object, regex, Lark, a choice of strings)
becomes a per-step bitmask of the token ids that may come next, computed by llguidance.

glmcore's tokenizers give llguidance its token table: each id's bytes (SentencePiece's "▁" as a space,
byte-fallback pieces as their byte), special tokens ([gMASK], <sop>, <|user|>, <unk>, ...) and tokenizer.json's
other added tokens (GLM-4.5's <think>, <tool_call>, ...: one token wherever written) marked with llguidance's
0xFF prefix so text can never match them and a grammar names them as tokens, and ids past the real vocabulary
(the padded rows of the output layer) empty, which llguidance never allows. llguidance over xgrammar, measured
on both tokenizer kinds (`benchmarks/bench_structured.py --compare`, ChatGLM3 / GLM-4): a new JSON Schema compiles
in 3-7 ms against xgrammar's 0.3-0.6 s (a server compiles one per request), and its slowest mask steps are
shorter (p99 4-6 ms against 6-18 ms); xgrammar's median step is faster (0.003 against 0.02 ms), but both
are far below what applying a mask to 151,552 logits costs.

The scheduler owns the loop: per step it asks every constrained request's Matcher for its bitmask
(`mask_rows`), sets the disallowed logits to -inf before sampling, advances the Matcher with the sampled
token, and ends the request when the grammar is complete (`Matcher.stopped`) or dead-ended.
"""
from __future__ import annotations

import json
import os
import queue
import re
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import numpy as np

from .errors import GlmcoreError


class GrammarError(GlmcoreError):
    """A grammar that cannot be compiled, or a JSON Schema that uses what the compiler does not support."""


KINDS = ("json_schema", "json_object", "regex", "lark", "choice")
# Compact JSON: a model (and certainly a random-weight one) may otherwise spend its whole budget on
# whitespace; "," and ":" without spaces are what json.dumps(separators=...) writes.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
SPECIAL_MARK = b"\xff"       # llguidance's prefix of a special token's bytes: never matched by text


def _llg():
    try:
        import llguidance
    except ImportError:
        raise GrammarError("constrained decoding needs llguidance: pip install llguidance") from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What a reply must match. kind: json_schema (spec: the schema dict), json_object (any JSON object),
    regex (spec: the pattern, whole-reply match), lark (spec: a Lark grammar in llguidance's dialect, rule
    `start`), choice (spec: a list of strings, the reply is exactly one of them)."""
    kind: str
    spec: object = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}: use one of {', '.join(KINDS)}")
        ok = {"json_schema": lambda s: isinstance(s, (dict, bool)), "json_object": lambda s: s is None,
              "regex": lambda s: isinstance(s, str) and s, "lark": lambda s: isinstance(s, str) and s.strip(),
              "choice": lambda s: isinstance(s, (list, tuple)) and s and all(isinstance(c, str) for c in s)}
        if not ok[self.kind](self.spec):
            want = {"json_schema": "a JSON Schema object", "json_object": "nothing", "regex": "a non-empty pattern",
                    "lark": "a non-empty Lark grammar", "choice": "a non-empty list of strings"}[self.kind]
            raise GrammarError(f"a {self.kind} grammar takes {want}, not {json.dumps(self.spec)[:60]}")
        check_limits(self.kind, self.spec)

    @classmethod
    def json_schema(cls, schema) -> "Grammar":
        return cls("json_schema", schema)

    @classmethod
    def json_object(cls) -> "Grammar":
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        return cls("regex", pattern)

    @classmethod
    def lark(cls, text: str) -> "Grammar":
        return cls("lark", text)

    @classmethod
    def choice(cls, options: Sequence[str]) -> "Grammar":
        return cls("choice", tuple(options))

    def part(self, name: str) -> dict:
        """This grammar as a named entry of llguidance's grammar list (referenced as @name from Lark)."""
        if self.kind == "json_schema":
            schema = self.spec if isinstance(self.spec, dict) else {} if self.spec else {"not": {}}
            return {"name": name, "json_schema": {**schema, "x-guidance": JSON_OPTIONS}}
        if self.kind == "json_object":
            return {"name": name, "json_schema": {"type": "object", "x-guidance": JSON_OPTIONS}}
        if self.kind == "regex":
            return {"name": name, "lark_grammar": f"start: {regex_terminal(self.spec)}"}
        if self.kind == "choice":
            return {"name": name, "lark_grammar": "start: " + " | ".join(lark_string(c) for c in self.spec)}
        return {"name": name, "lark_grammar": self.spec}


def regex_terminal(pattern: str) -> str:
    """A regex as a Lark /.../ terminal (a "/" inside must be escaped)."""
    return "/" + re.sub(r"(?<!\\)/", r"\\/", pattern) + "/"


def lark_string(text: str) -> str:
    """A literal as a Lark string (JSON escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


# ----------------------------------------------------------------------------- what the compiler can take

# llguidance's compiler recurses once per link of a rule chain (Lark `r0: r1`, `r1: r2`, ...) or a $ref chain, with
# no bound of its own: ~3 KB of stack a Lark link, ~10 KB a linked JSON object, so a 40 KB grammar overflows an
# 8 MB thread stack (SIGSEGV, the whole server). Its own limits (LLParserLimits: max_grammar_size 500k symbols,
# max_items_in_row 2000, initial_lexer_fuel 1M, step_lexer_fuel 200k, step_max_items 50k, max_lexer_states 250k)
# bound the work per step, not the chain depth, the compile time of a long list (100k choices: 20 s, then a
# Rust panic on its u16 symbol table), nor the regex expansion of a long forced repetition (a{100000} fails at
# the first token with "too many expressions constructed"). So every grammar is checked against these first:
MAX_GRAMMAR_BYTES = 128 << 10   # the grammar's text (a schema as compact JSON); OpenAI's own cap is 120,000 chars
MAX_CHAIN = 256                 # rules (Lark) or nested subschemas through $ref (JSON Schema) in one chain
MAX_CHOICES = 1000              # strings of a choice, values of an enum (OpenAI's enum cap)
MAX_REPEAT = 10000              # repetition counts of a grammar, added up (nested ones multiply): a{10000}
                                # passes llguidance's lexer, a{10000}a{10000}... and a{100000} do not
# and it compiles on threads of its own with this stack, under this time (see _Compiler)
COMPILE_STACK = 256 << 20
COMPILE_SECONDS = 5.0


def check_limits(kind: str, spec) -> None:
    """GrammarError naming the first bound a grammar exceeds (above), before anything is compiled."""
    if kind == "json_object":
        return
    if kind == "choice":
        if len(spec) > MAX_CHOICES:
            raise GrammarError(f"the choice has {len(spec)} strings; the limit is {MAX_CHOICES}: offer fewer "
                               "(or a regex/grammar that describes them)")
        size = sum(len(c.encode("utf-8", "surrogatepass")) for c in spec)
    else:
        text = spec if isinstance(spec, str) else json.dumps(spec, ensure_ascii=False, separators=(",", ":"))
        size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"the {kind} grammar has {size} bytes; the limit is {MAX_GRAMMAR_BYTES}: shorten it")
    if kind == "regex":
        repeat = repeat_total(spec)
    elif kind == "lark":
        chain, repeat, schemas = _lark_stats(spec)
        if chain > MAX_CHAIN:
            raise GrammarError(f"the lark grammar chains {chain} rules (a rule whose body names the next); the "
                               f"limit is {MAX_CHAIN}: inline some of them")
        for schema in schemas:
            check_limits("json_schema", schema)
    elif kind == "json_schema":
        chain, repeat, enum = _schema_stats(spec)
        if chain > MAX_CHAIN:
            raise GrammarError(f"the JSON Schema nests {chain} subschemas deep (counting each $ref); the limit is "
                               f"{MAX_CHAIN}: flatten it")
        if enum > MAX_CHOICES:
            raise GrammarError(f"the JSON Schema has an enum of {enum} values; the limit is {MAX_CHOICES}: "
                               "offer fewer")
    else:
        return
    if repeat > MAX_REPEAT:
        raise GrammarError(f"the {kind} grammar repeats {repeat} times in all (repetition counts such as {{n}} "
                           f"and minItems, nested ones multiplied); the limit is {MAX_REPEAT}: use smaller counts")


_QUANT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def repeat_total(pattern: str) -> int:
    """The repetition counts of a regex added up, a quantified group's count times what is inside it:
    a{3}b{4} -> 7, (a{10}){10} -> 100, (ab){5} -> 5."""
    sums = [0]                    # per open group: the counts inside it so far
    base, added = 1, 0            # the previous atom: what a quantifier multiplies, what it already counted
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            base, added, i = 1, 0, i + 2
        elif c == "[":            # a class: one atom
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            j += pattern[j:j + 1] == "]"
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            base, added, i = 1, 0, j + 1
        elif c == "(":
            sums.append(0)
            i += 1
        elif c == ")":
            inner = sums.pop() if len(sums) > 1 else 0
            sums[-1] += inner
            base, added, i = max(1, inner), inner, i + 1
        elif c == "{" and (m := _QUANT.match(pattern, i)):
            count = max(int(m.group(1)), int(m.group(2) or 0))
            sums[-1] += base * count - added
            base, added, i = base * count, base * count, m.end()
        else:
            base, added, i = 1, 0, i + 1
    while len(sums) > 1:          # an unclosed group (llguidance reports it)
        inner = sums.pop()
        sums[-1] += inner
    return sums[0]


_LARK_TOKEN = re.compile(
    r'(?P<comment>//[^\n]*)|(?P<string>"(?:[^"\\\n]|\\.)*"i?)|(?P<regex>/(?:[^/\\\n]|\\.)+/[imsxlu]*)'
    r'|(?P<json>%json\b)|(?P<ref>@[A-Za-z_]\w*)|(?P<directive>%\w+[^\n]*)'
    r'|(?P<define>^[ \t]*[?!]?(?P<dname>[A-Za-z_]\w*)(?:\{[^}\n]*\})?(?:\.-?\d+)?[ \t]*:)'
    r'|(?P<name>[A-Za-z_]\w*)|(?P<tilde>~\s*(?P<t1>\d+)(?:\s*\.\.\s*(?P<t2>\d+))?)', re.M)


def _lark_stats(text: str) -> tuple[int, int, list]:
    """(the longest chain of rule references, the repetition total, the %json schemas) of a Lark grammar."""
    graph: dict[str, set[str]] = {}
    current: set[str] = set()
    skeleton, repeat, schemas = [], 0, []
    pos, decoder = 0, json.JSONDecoder()
    while (m := _LARK_TOKEN.search(text, pos)) is not None:
        skeleton.append(text[pos:m.start()])
        pos, kind = m.end(), m.lastgroup
        if m.group("define") is not None:
            current = graph.setdefault(m.group("dname"), set())
            skeleton.append("\n")
        elif kind == "name":
            current.add(m.group(0))
            skeleton.append("a")
        elif kind in ("string", "ref"):
            skeleton.append("a")
        elif kind == "regex":
            body = m.group(0)
            repeat += repeat_total(body[1:body.rindex("/")])
            skeleton.append("a")
        elif kind == "tilde":
            skeleton.append("{%d}" % max(int(m.group("t1")), int(m.group("t2") or 0)))
        elif kind == "json":
            start = len(text) - len(text[pos:].lstrip())
            try:
                schema, pos = decoder.raw_decode(text, start)
                schemas.append(schema)
            except (ValueError, RecursionError):
                pass               # llguidance says what is wrong with it
            skeleton.append("a")
    skeleton.append(text[pos:])
    # [ ] in Lark is an optional group, never a character class
    repeat += repeat_total("".join(skeleton).replace("\\", "").replace("[", "(").replace("]", ")"))
    return _longest_chain(graph), repeat, schemas


def _longest_chain(graph: dict) -> int:
    """Nodes on the longest path of a graph (node -> successors; a link back into the path is not followed):
    an iterative depth-first search, so no grammar depends on Python's recursion limit either."""
    depth: dict = {}
    for root in graph:
        if root in depth:
            continue
        stack, on_path = [(root, iter(graph[root]))], {root}
        while stack:
            node, children = stack[-1]
            for child in children:
                if child in graph and child not in depth and child not in on_path:
                    stack.append((child, iter(graph[child])))
                    on_path.add(child)
                    break
            else:
                stack.pop()
                on_path.discard(node)
                depth[node] = 1 + max((depth.get(c, 0) for c in graph[node] if c not in on_path), default=0)
    return max(depth.values(), default=0)


def _schema_stats(schema) -> tuple[int, int, int]:
    """(the longest chain of nested subschemas, each $ref followed; the repetition total of patterns and
    minItems; the longest enum) of a JSON Schema."""
    graph: dict[int, list[int]] = {}
    repeat, enum = 0, 0
    todo = [schema]
    while todo:
        s = todo.pop()
        if not isinstance(s, dict) or id(s) in graph:
            continue
        kids = []
        for key, value in s.items():
            if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
                kids += value.values()
            elif key in _SUBSCHEMA_LISTS + ("items",) and isinstance(value, list):
                kids += value
            elif key in _SUBSCHEMAS:
                kids.append(value)
            elif key == "$ref" and isinstance(value, str):
                kids.append(_resolve(schema, value))
        if isinstance(s.get("pattern"), str):
            repeat += repeat_total(s["pattern"])
        if isinstance(s.get("patternProperties"), dict):
            repeat += sum(repeat_total(k) for k in s["patternProperties"])
        if isinstance(s.get("minItems"), int) and not isinstance(s["minItems"], bool):
            repeat += s["minItems"]
        if isinstance(s.get("enum"), list):
            enum = max(enum, len(s["enum"]))
        kids = [k for k in kids if isinstance(k, dict)]
        graph[id(s)] = [id(k) for k in kids]
        todo += kids
    return _longest_chain(graph), repeat, enum


def _resolve(root, ref: str):
    """The subschema a local $ref ("#", "#/$defs/x", any JSON pointer) names, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


# ----------------------------------------------------------------------------- token table

class TokenTable:
    """llguidance's view of one glmcore tokenizer at one logits width (the padded vocabulary)."""

    def __init__(self, tokenizer, n_logits: int | None = None):
        llg = _llg()
        n_logits = max(n_logits or tokenizer.n_vocab, tokenizer.n_vocab)
        self.tokenizer, self.n_logits = tokenizer, n_logits
        self.sentencepiece = hasattr(tokenizer, "sp")
        tokens: list[bytes] = []
        specials = []
        tags = {i: name for name, i in tokenizer.tag_ids.items()}     # special, or added and always one token
        for i in range(tokenizer.n_vocab):
            if tokenizer.is_special(i) or i in tags:
                name = tags.get(i) or tokenizer.special_names.get(i) or (tokenizer.sp.id_to_piece(i)
                                                                          if self.sentencepiece else "")
                tokens.append(SPECIAL_MARK + (name or f"<[{i}]>").encode())
                specials.append(i)
            else:
                tokens.append(tokenizer.token_bytes(i))
        tokens += [b""] * (n_logits - len(tokens))       # padded rows: llguidance never allows an empty token
        self.special_ids = specials
        self.words = (n_logits + 31) // 32

        tok = tokenizer

        class _Vocab:      # what llguidance.TokenizerWrapper reads
            eos_token_id = tok.eos_id
            bos_token_id = None
            special_token_ids = specials

            def __init__(self):
                self.tokens = tokens

            def __call__(self, text: str) -> list[int]:
                return encode_plain(tok, text)

        self.ll = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab()), n_vocab=n_logits)


def encode_plain(tokenizer, text: str) -> list[int]:
    """Ids of text as a continuation (SentencePiece without its dummy-prefix "▁"): llguidance
    tokenizes forced text with this."""
    if hasattr(tokenizer, "sp"):
        # "\n" is a byte-fallback piece that never merges: encode("\n" + text) = dummy? + [\n] + text's ids
        lead = tokenizer.sp.encode("\n")
        ids = tokenizer.sp.encode("\n" + text)
        return ids[len(lead):]
    return tokenizer.encode(text)


_tables: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_tables_lock = threading.Lock()


def token_table(tokenizer, n_logits: int | None = None) -> TokenTable:
    """The TokenTable of a tokenizer, built once per tokenizer and logits width (it takes ~0.1-1 s)."""
    with _tables_lock:
        per = _tables.setdefault(tokenizer, {})
        key = max(n_logits or 0, tokenizer.n_vocab)
        if key not in per:
            per[key] = TokenTable(tokenizer, key)
        return per[key]


# ----------------------------------------------------------------------------- compiled grammars

class _Compiler:
    """Runs llguidance's compiler on threads of its own, each with a COMPILE_STACK stack (the grammar bounds
    keep a chain far below it; this is the margin for what they cannot see), and gives up on a compile after
    COMPILE_SECONDS: the caller gets a GrammarError, the thread finishes it in the background. The bounds keep
    a compile well under a second, so a thread is not held for long either way."""

    def __init__(self, threads: int = 4):
        self.n, self.jobs, self.threads, self.lock = threads, queue.SimpleQueue(), [], threading.Lock()

    def _start(self) -> None:
        with self.lock:
            while len(self.threads) < self.n:
                t = threading.Thread(target=self._work, name=f"glmcore-grammar-{len(self.threads)}", daemon=True)
                old = threading.stack_size(COMPILE_STACK)
                try:
                    t.start()
                except RuntimeError:      # no room for such a stack (strict overcommit): the bounds still hold
                    threading.stack_size(old)
                    t = threading.Thread(target=self._work, name=t.name, daemon=True)
                    t.start()
                finally:
                    threading.stack_size(old)
                self.threads.append(t)

    def _work(self) -> None:
        while True:
            future, fn, args = self.jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:      # pyo3's PanicException is a BaseException
                    future.set_exception(e)

    def run(self, fn, *args):
        if threading.current_thread() in self.threads:
            return fn(*args)
        if len(self.threads) < self.n:
            self._start()
        future: Future = Future()
        self.jobs.put((future, fn, args))
        try:
            return future.result(timeout=COMPILE_SECONDS)
        except FutureTimeout:
            future.cancel()
            raise GrammarError(f"compiling it took over {COMPILE_SECONDS:g} s; simplify it") from None


_compiler = _Compiler()


def _limits():
    """llguidance's own limits at their defaults, without the parser state in error messages."""
    return _llg().LLParserLimits(verbose_errors=False)


def _compile(table: TokenTable, grammar: str):
    """(the matcher at the start of the grammar, or None; the error, or None). The first mask is computed
    too: a grammar too large for the lexer fails there, when the request is made, not at its first token."""
    llg = _llg()
    try:
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, table.ll, limits=_limits())
        if is_error:
            return None, messages[0]
        first = llg.LLMatcher(table.ll, grammar, log_level=0, limits=_limits())
        if first.is_error():
            return None, first.get_error()
        probe = first.deep_copy()
        words = np.zeros(table.words, dtype=np.int32)
        probe.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if probe.is_error():
            return None, probe.get_error()
        return first, None
    except BaseException as e:           # a Rust panic (pyo3 PanicException) is not an Exception
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return None, f"the compiler failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"


class Constraint:
    """A compiled grammar bound to a token table; `start()` gives a request its own Matcher. Compiling
    checks the grammar, so a bad one is a GrammarError when the request is made, never mid-generation."""

    def __init__(self, table: TokenTable, grammar: str, what: str):
        self.table, self.grammar, self.what = table, grammar, what
        self.field: str | None = None     # the request field it came from (the server names it in errors)
        first, error = _compiler.run(_compile, table, grammar)
        if error is not None:
            raise GrammarError(f"the {what} cannot be compiled: {_clean(error)}")
        self._first = first

    def start(self) -> "Matcher":
        return Matcher(self._first.deep_copy(), self)


def _clean(msg: str) -> str:
    """llguidance's message on one line, without its backtrace or parser state."""
    msg = re.split(r"<backtrace>|<state>|<non-verbose/>", msg)[0]
    return " ".join(msg.split())[:300]


def compile_grammar(tokenizer, grammar: Grammar, n_logits: int | None = None,
                    leading_space: bool | None = None) -> Constraint:
    """A Constraint for a whole reply that must match `grammar`. leading_space (default: the tokenizer is
    SentencePiece) lets the reply open with one space: SentencePiece's first piece of a text carries the
    dummy-prefix "▁", which decoding drops."""
    table = token_table(tokenizer, n_logits)
    space = table.sentencepiece if leading_space is None else leading_space
    top = ('start: " "? @g' if space else "start: @g")
    return Constraint(table, grammar_json(top, {"g": grammar}), f"{grammar.kind} grammar")


def grammar_json(top_lark: str, parts: dict[str, Grammar]) -> str:
    """llguidance's grammar list: the top Lark grammar, then each part under its name."""
    return json.dumps({"grammars": [{"name": "top", "lark_grammar": top_lark}]
                       + [g.part(name) for name, g in parts.items()]}, ensure_ascii=False)


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, ll, constraint: Constraint):
        self.ll, self.constraint = ll, constraint

    @property
    def stopped(self) -> bool:
        """The grammar is complete and nothing may follow: the request ends here."""
        return self.ll.is_stopped()

    @property
    def accepting(self) -> bool:
        """The text so far is a complete match (a stop token may end it)."""
        return self.ll.is_accepting()

    def fill(self, words: np.ndarray) -> None:
        """Write the allowed-ids bitmask (int32 words, bit i%32 of word i//32) into words."""
        self.ll.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

    def allows(self, token: int) -> bool:
        """Whether token may come next (without consuming it): one token's lexer steps, not the vocabulary's."""
        return self.ll.validate_tokens([int(token)]) == 1

    def advance(self, token: int) -> str | None:
        """Consume a sampled token; the reason it was refused, or None."""
        if not self.ll.consume_token(int(token)):
            return _clean(self.ll.get_error()) or f"token {token} does not continue the grammar"
        return None

    @property
    def too_complex(self) -> bool:
        """The matcher failed on one of llguidance's limits (the grammar is too large for it), not on a token."""
        return any(k in self.ll.get_error() for k in _TOO_COMPLEX)


# llguidance's messages for a limit hit while matching (lexer expressions/states/fuel, Earley items)
_TOO_COMPLEX = ("too many expressions", "Too many items", "too many states", "fuel", "too complex", "limit")


# byte of a bitmask -> the 8 logit biases it stands for (0: allowed, -inf: not): a mask is applied with one
# gather of 32-byte rows and one add, with no branch per id (np.where's per-element select costs 5x on a
# fragmented mask) and no Python loop over ids
_BIAS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool),
                 np.float32(0), np.float32(-np.inf)).astype(np.float32)


def _set_bit(row: np.ndarray, i: int, on: bool) -> None:
    if on:
        row[i >> 3] |= np.uint8(1 << (i & 7))
    else:
        row[i >> 3] &= np.uint8(~(1 << (i & 7)) & 0xFF)


def compute_masks(matchers: Sequence[Matcher], executor=None) -> np.ndarray:
    """The matchers' allowed-ids bitmasks ([n, words] int32), in parallel with an LLExecutor for a batch."""
    n, words = len(matchers), matchers[0].constraint.table.words
    bits = np.zeros((n, words), dtype=np.int32)
    if executor is not None and n > 1:
        executor.unsafe_compute_mask_ptr([(m.ll, i) for i, m in enumerate(matchers)], bits.ctypes.data, words * 4, n)
    else:
        for i, m in enumerate(matchers):
            m.fill(bits[i])
    return bits


class PrefetchedMasks:
    """The bitmasks of matchers in their current state, computed on a background thread while the caller goes
    on (llguidance releases the GIL: the model's step runs meanwhile, as vLLM and SGLang overlap the grammar with
    the forward pass). Nothing may advance these matchers until `take` or `wait` has returned."""

    def __init__(self, matchers: Sequence[Matcher], executor=None):
        self.matchers = list(matchers)
        self.future = _background().submit(compute_masks, self.matchers, executor)

    def wait(self) -> None:
        """Until the thread is done with the matchers (its error, if any, comes again from take)."""
        try:
            self.future.result()
        except BaseException:       # noqa: BLE001 -- take() raises it where the masks are used
            pass

    def take(self, matchers: Sequence[Matcher], bits: np.ndarray) -> list[int]:
        """Copy into bits [n, words] the rows of those of `matchers` that were prefetched; the indices of the others
        (a greedy request whose argmax its grammar refused), whose masks the caller computes."""
        done = self.future.result()
        where = {id(m): i for i, m in enumerate(self.matchers)}
        for i, m in enumerate(matchers):
            if id(m) in where:
                bits[i] = done[where[id(m)]]
        return [i for i, m in enumerate(matchers) if id(m) not in where]


_background_pool = None
_background_lock = threading.Lock()


def _background():
    global _background_pool
    with _background_lock:
        if _background_pool is None:
            from concurrent.futures import ThreadPoolExecutor
            _background_pool = ThreadPoolExecutor(1, thread_name_prefix="glmcore-masks")
        return _background_pool


def mask_rows(matchers: Sequence[Matcher], rows: Sequence[np.ndarray], stop_ids: Sequence[Sequence[int]],
              stops_open: Sequence[bool], executor=None,
              prefetched: PrefetchedMasks | None = None) -> tuple[np.ndarray, list[bool]]:
    """Masked copies of the requests' logits rows ([n, width]: disallowed ids -inf), and per row whether any
    id at all is allowed (False: the grammar dead-ended). A request's stop ids (and only they, never the
    tokenizer's eos on its own) are allowed where its grammar is complete or names them, and stops_open
    (min_tokens reached). Bitmasks are computed in llguidance (in parallel with an LLExecutor for a batch;
    or taken from `prefetched`, computed during the step) and applied with numpy (_BIAS)."""
    n = len(matchers)
    table = matchers[0].constraint.table
    width = rows[0].shape[0]
    bits = np.zeros((n, table.words), dtype=np.int32)
    missing = prefetched.take(matchers, bits) if prefetched is not None else range(n)
    if missing:
        bits[list(missing)] = compute_masks([matchers[i] for i in missing], executor)
    if bits.shape[1] * 32 < width:     # logits wider than the table (never for a table made at their width)
        bits = np.pad(bits, ((0, 0), (0, (width + 31) // 32 - bits.shape[1])))
    eos = table.tokenizer.eos_id
    bytes_ = bits.view(np.uint8)
    out, alive = np.empty((n, width), dtype=np.float32), []
    for i, (m, row) in enumerate(zip(matchers, rows)):
        b = bytes_[i]
        stops = [s for s in stop_ids[i] if 0 <= s < width]
        if eos not in stops:
            _set_bit(b, eos, False)
        for s in stops:               # a stop the grammar names itself, or one after a complete match
            _set_bit(b, s, bool((b[s >> 3] >> (s & 7)) & 1 or m.accepting) and stops_open[i])
        alive.append(bool(b.any()))
        np.add(np.take(_BIAS, b, axis=0).reshape(-1)[:width], row, out=out[i])
    return out, alive


def executor(threads: int | None = None):
    """An llguidance executor for computing a batch's masks in parallel (None without llguidance), on the
    CPUs this process may use: llguidance's default counts the host's, which oversubscribes a container."""
    try:
        import llguidance
    except ImportError:
        return None
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return llguidance.LLExecutor(threads or max(1, min(usable, 16)))


# ----------------------------------------------------------------------------- JSON Schema checks

# What llguidance's JSON compiler implements (it refuses the rest with a message; this list gives the
# client one message naming every unsupported keyword at once).
SUPPORTED_KEYWORDS = frozenset("""
$schema $id $defs definitions $ref $comment $anchor title description default examples deprecated readOnly
writeOnly type enum const anyOf oneOf allOf properties required additionalProperties patternProperties
propertyNames minProperties maxProperties items prefixItems minItems maxItems uniqueItems contains
minLength maxLength pattern format minimum maximum exclusiveMinimum exclusiveMaximum multipleOf
x-guidance
""".split())
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("additionalProperties", "items", "propertyNames", "contains")


def unsupported_keywords(schema, path: str = "#") -> list[str]:
    """'path: keyword' for each keyword of a JSON Schema that constrained decoding cannot honour."""
    out: list[str] = []
    if not isinstance(schema, dict):
        return out
    for key, value in schema.items():
        if key not in SUPPORTED_KEYWORDS:
            out.append(f"{path}: {key}")
            continue
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            for k, v in value.items():
                out += unsupported_keywords(v, f"{path}/{key}/{k}")
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            for i, v in enumerate(value):
                out += unsupported_keywords(v, f"{path}/{key}/{i}")
        elif key in _SUBSCHEMAS:
            out += unsupported_keywords(value, f"{path}/{key}")
    return out


def check_schema(schema) -> None:
    """GrammarError naming every unsupported keyword of a JSON Schema (never silently ignored)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON Schema is an object, not {type(schema).__name__}")
    bad = unsupported_keywords(schema)
    if bad:
        raise GrammarError(f"the JSON Schema uses keywords constrained decoding does not support "
                           f"({'; '.join(bad[:8])}{'; ...' if len(bad) > 8 else ''}); remove them")


# ----------------------------------------------------------------------------- chat replies

def strict_schemas(functions: list[dict]) -> dict[str, dict]:
    """name -> parameters schema of the tools marked "strict": true (their arguments are constrained)."""
    out = {}
    for f in functions:
        if f.get("strict"):
            schema = f.get("parameters") or {"type": "object", "properties": {}}
            try:
                check_schema(schema)
                check_limits("json_schema", schema)
            except GrammarError as e:
                raise GrammarError(f"tool {f['name']!r}: {e}") from None
            out[f["name"]] = schema
    return out


@dataclass(frozen=True)
class CallRequest:
    """What a reply's grammar is asked for, handed to the format's tool parser (glmcore.parsers ... grammar())."""
    tok: object                      # the tokenizer
    functions: list                  # the request's function dicts
    strict: dict                     # name -> parameters schema of its "strict" tools
    must_call: Sequence[str]         # the reply must call one of these (tool_choice required / named)
    text: "Grammar | None"           # what a text reply must match (response_format)
    space: str                       # '" "? ' where a SentencePiece reply opens with the dummy-prefix space
    parallel: bool = True            # several calls in one reply (OpenAI's parallel_tool_calls)
    after_thought: bool = False      # the reply opens inside <think>: the answer's rules follow a thought


def reply_constraint(fmt, n_logits: int | None = None, grammar: Grammar | None = None, tools=None,
                     must_call: Sequence[str] = (), calls: bool = True, thinking_budget: int | None = None,
                     parallel: bool = True) -> tuple[list[int], Constraint | None]:
    """(ids forced at the start of the reply, the Constraint of the rest, or None) for a chat reply.

    grammar: what a text reply must match (response_format); tools: the request's tools, whose "strict"
    ones get arguments matching their parameters schema; must_call: the reply must call one of these
    (OpenAI's tool_choice "required" or a named function); calls: whether the reply may call tools at all;
    parallel: whether it may make several calls (where the format writes calls one after another);
    thinking_budget: the most tokens a thinking model's thought may take, after which its own </think> is forced.
    The format's tool parser writes the rules of the answer (calls in its own syntax); a thinking template's
    thought goes in front of them, free text up to </think>."""
    from .parsers.base import CallGrammar
    if grammar is not None and grammar.kind == "json_schema":
        check_schema(grammar.spec)
    functions = fmt.check_tools(tools) if tools else []
    strict = strict_schemas(functions) if calls else {}
    parser = fmt.tool_parser
    if strict and not parser.json_arguments:
        raise GrammarError(f"strict tools need JSON arguments, and {fmt.family} writes tool calls as Python or "
                           "not at all; remove \"strict\"")
    tok = fmt.tok
    table = token_table(tok, n_logits)
    request = CallRequest(tok, functions if calls else [], strict, tuple(must_call), grammar,
                          '" "? ' if table.sentencepiece else "", parallel, fmt.thinking and fmt.opens_thinking)
    body = parser.grammar(request)
    if body is None and grammar is not None:     # a text reply (a SentencePiece one may open with the dummy space)
        body = CallGrammar(f"body: {request.space}@text", {"text": grammar})
    if body is None and thinking_budget is None:
        return [], None
    think = _thought(fmt, tok, thinking_budget)
    if body is None:
        free = " | ".join(["TEXT"] + [tag_lark(tok, t) for t in parser.tags])   # the answer as it likes
        body = CallGrammar(f"body: ({free})*\nTEXT: /(?s:.+)/")
    if think is not None and body.opening:       # a forced opening goes into the prompt: no thought before it
        think = None
    top = "start: body\n" if think is None else think + "start: thought_part body\n"
    what = ("grammar of the tool_choice" if must_call else "grammar of the strict tools" if strict
            else f"{grammar.kind} grammar" if grammar else "grammar of the thinking budget")
    return body.opening, Constraint(table, grammar_json(top + body.rules, body.parts), what)


def is_token(tok, tag: str) -> bool:
    """Whether a grammar can force `tag` as one token: the tokenizer reads it as one wherever it is written
    (special or added) and Lark can name it (<...>)."""
    return tag in tok.tag_ids and re.fullmatch(r"<[^<>\s]+>", tag) is not None


def tag_lark(tok, tag: str) -> str:
    """A tag in Lark: the token where is_token, else its text."""
    return tag if is_token(tok, tag) else lark_string(tag)


def _thought(fmt, tok, budget: int | None) -> str | None:
    """Lark rules `thought_part` of a thinking format's reply: the thought (at most `budget` tokens, then
    </think> is the only way on) before the answer; optional where the template leaves thinking to the model,
    required where the generation prompt opens it."""
    if not fmt.thinking:
        if budget is not None:
            raise GrammarError("a thinking budget applies to models that think; this checkpoint's template writes no "
                               "<think>: drop it")
        return None
    if budget is None and not fmt.opens_thinking:
        return None
    close = tag_lark(tok, "</think>")
    if close.startswith('"'):         # a text tag (GLM-Z1 on GLM-4's tokenizer): the thought stops where it is written
        if budget is not None:        # llguidance ends a max_tokens lexeme without its stop text: nothing to force
            raise GrammarError("a thinking budget forces the template's </think>, which is no token of this "
                               "checkpoint's tokenizer (it is text); drop the budget")
        rules, closing = f"thought[stop={close}]: /(?s:.*)/\n", ""
    else:                             # one token: text can never match it, so the thought is free text
        limit = f"[max_tokens={int(budget)}]" if budget is not None else ""
        rules, closing = f"thought{limit}: /(?s:.*)/\n", f" {close}"
    if fmt.opens_thinking:      # (the answer's own rules take the newline that follows </think>)
        return rules + f'thought_part: thought{closing}\n'
    return rules + f'thought_part: ("\\n"? {tag_lark(tok, "<think>")} thought{closing})?\n'


MAX_GRAMMAR_FILE = 1 << 20      # bytes of a --json-schema / --grammar file


def grammar_from_files(json_schema: str | None = None, lark: str | None = None) -> Grammar | None:
    """The Grammar of `glmcore run --json-schema FILE` / `--grammar FILE` (a Lark grammar, llguidance's
    dialect: `start: ...`, %json {...} and /regex/ terminals), checked before any model is loaded."""
    from .files import decode_text, read_bounded
    if json_schema and lark:
        raise GrammarError("give --json-schema or --grammar, not both")
    if json_schema:
        fix = "give a JSON Schema file"
        text = decode_text(read_bounded(json_schema, MAX_GRAMMAR_FILE, "--json-schema", fix, GrammarError),
                           f"--json-schema {json_schema!r}", fix, GrammarError)
        try:
            schema = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise GrammarError(f"--json-schema {json_schema!r} is not JSON ({str(e)[:80]}); {fix}") from None
        check_schema(schema)
        return Grammar.json_schema(schema)
    if lark:
        fix = "give a Lark grammar file (rule start)"
        return Grammar.lark(decode_text(read_bounded(lark, MAX_GRAMMAR_FILE, "--grammar", fix, GrammarError),
                                        f"--grammar {lark!r}", fix, GrammarError))
    return None
