"""The lm-evaluation-harness model "glmcore": any glmcore backend under EleutherAI's harness.

    import glmcore.evaluate, lm_eval      # importing glmcore.evaluate registers the model
    lm_eval.simple_evaluate(model="glmcore", model_args="model=DIR,backend=cpu_int4,group_size=128",
                            tasks=["piqa"])

model_args: model (checkpoint dir), backend, precision, weights, ctx (KV positions per slot),
threads, slots (sequences at once, default 4), max_gen_toks (default 256); any other key is the
backend's option (as --opt). loglikelihood is scored on the batch session with prefix reuse
(glmcore.evaluate.scoring); generate_until runs the core's scheduler. Every sequence starts with the
model's [gMASK]sop prefix, as the GLM tokenizers put it; a chat-templated prompt (--apply_chat_template)
is the family's chat format, and its text encodes to exactly the ids glmcore's chat format builds.
"""
from __future__ import annotations

import re

from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from ..backend import LoadOptions
from ..chat import as_message
from ..errors import GlmcoreError
from ..model import load_model
from ..sampling import SamplingParams
from ..scheduler import Request
from .scoring import Scorer

LOAD_KEYS = ("model", "backend", "precision", "weights", "ctx", "threads", "slots", "max_gen_toks")
IGNORED = ("batch_size", "max_batch_size", "device")   # the harness passes these; slots set the batch


class ChatText:
    """Chat prompts as text for the harness, and text back to ids: [gMASK]sop and the role tokens are
    written by name; after a role token ChatGLM3 encodes its metadata line and the content apart
    (as glmcore.chat builds them), GLM-4 the two together, ChatGLM2 has no role tokens."""

    def __init__(self, tokenizer, chat_format):
        self.tok, self.fmt = tokenizer, chat_format
        self.family = tokenizer.family
        self.ids = tokenizer.special_ids
        self.prefix = list(chat_format.prefix)
        names = [tokenizer.special_names[i] for i in self.prefix]
        self.prefix_text = "".join(names)
        roles = [n for n in self.ids if n.startswith("<|") and n.endswith("|>")]
        self.split = re.compile("(" + "|".join(map(re.escape, roles)) + ")") if roles else None
        # tokenizer.json checkpoints render with their own template; GLM-Edge's writes no prefix, so a rendered
        # prompt cannot be told from text by its start: the texts rendered here are remembered instead
        self.template = getattr(chat_format, "template", None) is not None
        self._rendered: set[str] = set()

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        msgs = [as_message(m) for m in messages]
        if self.template:
            text = self.fmt.render(msgs, None, add_generation_prompt)
            self._rendered.add(text)
            return text
        if self.family == "chatglm2":
            system, rounds = self.fmt._rounds(msgs, 1)
            if rounds and add_generation_prompt and msgs[-1].role == "user":
                rounds[-1] += "\n\n答："
            return self.prefix_text + "\n\n".join(([system] if system else []) + rounds)
        out = self.prefix_text
        for m in msgs:
            if m.content or self.family == "chatglm3":     # GLM-4 writes no turn for empty content
                out += f"<|{m.role}|>{m.metadata}\n{m.content}"
        return out + ("<|assistant|>" if add_generation_prompt else "")

    def encode(self, text: str, prefix: bool = True) -> list[int]:
        """Ids of `text`: a rendered chat prompt (it starts with the prefix's names) as glmcore.chat
        builds it; other text as the tokenizer encodes it, after the prefix when `prefix`."""
        if self.template and text in self._rendered:
            return self.tok.encode_rendered(text)
        if self.template or not text.startswith(self.prefix_text):
            return (self.prefix if prefix else []) + self.tok.encode(text)
        rest = text[len(self.prefix_text):]
        if self.family == "chatglm2" or self.split is None:
            return self.prefix + (self.tok.encode(rest) if rest else [])
        ids = list(self.prefix)
        parts = self.split.split(rest)
        if parts[0]:
            ids += self.tok.encode(parts[0])
        for role, body in zip(parts[1::2], parts[2::2]):
            ids.append(self.ids[role])
            if self.family == "chatglm3" and "\n" in body:
                meta, content = body.split("\n", 1)
                ids += self.tok.encode(meta + "\n") + (self.tok.encode(content) if content else [])
            elif body:
                ids += self.tok.encode(body)
        return ids


class GlmcoreLM(TemplateLM):
    """lm-evaluation-harness model over a glmcore checkpoint on any backend."""

    def __init__(self, model=None, backend=None, precision=None, weights=None, ctx=None, threads=None,
                 slots=4, max_gen_toks=256, **options):
        super().__init__()
        for key in IGNORED:
            options.pop(key, None)
        opts = LoadOptions(precision, weights, int(ctx) if ctx else None, int(threads) if threads else None,
                           extra=options)
        self.m = load_model(model, backend, opts, slots=int(slots))
        self.scorer = Scorer(self.m.scheduler.batch)
        self.text = ChatText(self.m.tokenizer, self.m.chat_format)
        self.max_gen_toks = int(max_gen_toks)

    # -- what the harness asks of a TemplateLM
    @property
    def eot_token_id(self) -> int:
        return self.m.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self.m.scheduler.batch.capacity

    @property
    def tokenizer_name(self) -> str:
        return f"glmcore-{self.m.config.family}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.text.encode(string, prefix=add_special_tokens is not False)

    def tok_decode(self, tokens, **kwargs) -> str:
        return self.m.tokenizer.decode(tokens)

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        return self.text.render(chat_history, add_generation_prompt)

    # -- scoring
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = []
        for context, continuation in (r.args for r in requests):
            if context == "":        # the model's prefix is the context, as BOS is for other models
                pairs.append((list(self.text.prefix), self.tok_encode(continuation, add_special_tokens=False)))
            else:
                pairs.append(self._encode_pair(context, continuation))
        out = self._loglikelihood_tokens([(r.args, c, x) for r, (c, x) in zip(requests, pairs)], disable_tqdm)
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        bar = tqdm(total=len(requests), desc="glmcore loglikelihood", disable=disable_tqdm)

        def progress(done, total):
            bar.update(done - bar.n)

        results = self.scorer.loglikelihood([(c, x) for _, c, x in requests], progress)
        bar.close()
        for (key, _, _), res in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text scored whole: windows of the context that predict every token once (the harness's
        rolling windows), the model's prefix first."""
        placeholder = -1
        width = self.max_length - len(self.text.prefix) + 1
        out = []
        for (text,) in tqdm([r.args for r in requests], desc="glmcore rolling", disable=disable_tqdm):
            tokens = self.tok_encode(text, add_special_tokens=False)
            pairs = []
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(tokens, placeholder, width, 1)):
                ctx = (list(self.text.prefix) + ctx[1:]) if ctx[:1] == [placeholder] else ctx
                pairs.append((None, ctx, cont))
            total = sum(lp for lp, _ in self._loglikelihood_tokens(pairs, disable_tqdm=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    # -- generation, through the core's scheduler
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        self.scorer.release()
        sched = self.m.scheduler
        for s in sched.slots:        # the scorer used the slots directly: the scheduler starts from empty ones
            sched.table.drop(s)
        out: list[str] = []
        todo = [r.args for r in requests]
        bar = tqdm(total=len(todo), desc="glmcore generate_until", disable=disable_tqdm)
        for k in range(0, len(todo), sched.max_queue):
            handles = [self._submit(context, dict(kwargs or {})) for context, kwargs in todo[k:k + sched.max_queue]]
            sched.run()
            for (context, kwargs), (h, until) in zip(todo[k:k + sched.max_queue], handles):
                if h.error is not None:
                    raise h.error
                text = self._cut(self.m.tokenizer.decode(h.tokens), until)
                self.cache_hook.add_partial("generate_until", (context, kwargs), text)
                out.append(text)
                bar.update(1)
        bar.close()
        return out

    def _submit(self, context: str, kwargs: dict):
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
        greedy = not kwargs.pop("do_sample", False) or float(kwargs.get("temperature", 0.0)) == 0.0
        params = SamplingParams(0.0 if greedy else float(kwargs.get("temperature", 1.0)),
                                float(kwargs.get("top_p", 1.0)), int(kwargs.get("top_k", 0)), 1.0,
                                kwargs.get("seed"))
        ids = self.tok_encode(context)
        room = self.max_length - max_new
        if room < 1:
            raise GlmcoreError(f"max_gen_toks {max_new} leaves no room for a prompt in the context of "
                               f"{self.max_length}; raise ctx or lower max_gen_toks")
        ids = ids[-room:]
        decoded: list[int] = []

        def on_token(handle, token):
            # stop strings end the request as soon as they appear (the scheduler knows only stop ids)
            if token is not None and until:
                decoded.append(token)
                if any(u in self.m.tokenizer.decode(decoded) for u in until):
                    handle.cancel()

        req = Request(ids, params, max_new, stop_ids=self.m.chat_format.stop_ids)
        return self.m.scheduler.submit(req, on_token=on_token), until

    @staticmethod
    def _cut(text: str, until: list[str]) -> str:
        for u in until:
            if u:
                text = text.split(u, 1)[0]
        return text

    def close(self) -> None:
        self.m.close()
