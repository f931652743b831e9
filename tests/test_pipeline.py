"""The chat API end to end: KV reuse across turns, whole-turn windows, and a tool round-trip driven
by a scripted model (the demo's random weights never choose tools)."""
import json

import numpy as np
import pytest

from glmcore.backend import Backend, Capabilities, LoadOptions, Probe, Session, hookimpl, registry
from glmcore.chat import Message, ToolCall
from glmcore.events import FinishReason, TextDelta, ToolCallDelta, ToolCallEvent, ToolCallStart
from glmcore.scheduler import WindowPolicy
from glmcore.pipeline import Pipeline
from glmcore.sampling import SamplingParams
from glmcore.tokenizer import load_tokenizer
from glmcore.weights import load_weights

GREEDY = SamplingParams(temperature=0)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "current weather",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


class ScriptedSession(Session):
    """Emits a fixed reply per turn: every logits call returns one-hot for the next scripted token."""

    def __init__(self, vocab, script):
        self.vocab, self.script, self.capacity = vocab, script, 4096
        self.fed: list[int] = []
        self.prefills: list[int] = []

    @property
    def kv_len(self):
        return len(self.fed)

    def _next(self):
        logits = np.zeros(self.vocab, np.float32)
        logits[self.script.pop(0)] = 50.0
        return logits

    def prefill(self, ids, all_logits=False):
        self.fed += list(ids)
        self.prefills.append(len(ids))
        return self._next()

    def decode(self, token):
        self.fed.append(token)
        return self._next()

    def reset(self):
        self.fed = []


class ScriptedBackend(Backend):
    name = "scripted"

    def __init__(self):
        self.script: list[int] = []
        self.session = None

    def probe(self):
        return Probe(True, device="none (test double)")

    def capabilities(self):
        return Capabilities(speed_rank=-100)

    def load(self, config, weights, options):
        self.session = ScriptedSession(config.vocab_size, self.script)
        return self.session


SCRIPTED = ScriptedBackend()


@hookimpl
def glmcore_backends():
    return [SCRIPTED]


@pytest.fixture(scope="module", autouse=True)
def _register():
    import sys
    registry().register(sys.modules[__name__], "scripted-test")


def say(tok, text, stop):
    return tok.encode(text) + [tok.special_ids[stop]]


@pytest.mark.parametrize("family,call_text", [
    ("glm4", 'get_weather\n{"city": "Beijing"}'),
    ("chatglm3", "get_weather\n ```python\ntool_call(city='Beijing')\n```"),
])
def test_tool_round_trip(make_tiny, family, call_text):
    d = make_tiny(family)
    tok = load_tokenizer(d, family)
    pipe = Pipeline(d, backend="scripted")
    # the model "answers" with a tool call, then (after the observation) with text
    SCRIPTED.script[:] = say(tok, call_text, "<|observation|>")
    history = [{"role": "user", "content": "weather in Beijing?"}]
    events = list(pipe.chat(history, tools=TOOLS, stream=True, params=GREEDY))
    call = ToolCall("get_weather", {"city": "Beijing"})
    assert events[1:] == [ToolCallDelta(0, '{"city": "Beijing"}'), ToolCallEvent(call)]
    assert events[0] == ToolCallStart(0, events[-1].call.id, "get_weather")
    reply = pipe.cached[-1]
    assert reply.tool_calls[0].arguments == {"city": "Beijing"}
    first_prompt = len(SCRIPTED.session.fed)

    SCRIPTED.script[:] = say(tok, "It is sunny.", "<|user|>")
    history += [reply, {"role": "tool", "content": json.dumps({"weather": "sunny"})}]
    events = list(pipe.chat(history, tools=TOOLS, stream=True, params=GREEDY))
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "It is sunny."
    # only the observation turn was prefilled: the cache kept the first turn and the tool call
    obs = pipe.model.chat_format.encode_continuation([Message("tool", json.dumps({"weather": "sunny"}))], 1)
    assert SCRIPTED.session.prefills[-1] == len(obs)
    assert SCRIPTED.session.fed[:first_prompt] == pipe.slot.tokens[:first_prompt]
    assert pipe.model.tokenizer.special_ids["<|observation|>"] in obs


def test_multi_turn_prefills_only_the_new_turn(make_tiny):
    pipe = Pipeline(make_tiny("chatglm3"), backend="torch")
    sched, sent = pipe.model.scheduler, []
    submit = sched.submit
    sched.submit = lambda request, *a, **kw: sent.append(list(request.prompt)) or submit(request, *a, **kw)
    history = [{"role": "system", "content": "be brief"}]
    prefilled = []
    for turn in range(5):
        history.append({"role": "user", "content": f"question number {turn}"})
        reply = pipe.chat(history, params=GREEDY, max_new_tokens=6)
        # the scheduler gets the whole conversation, the replies as the ids they were generated as
        assert sent[-1] == pipe.model.chat_format.encode_messages(pipe.cached[:-1])
        unfed = 1 if pipe.finish_reason is FinishReason.LENGTH else 0           # the last id sampled, never fed
        assert reply.ids and sent[-1] + reply.ids[:len(reply.ids) - unfed] == pipe.slot.tokens
        history.append(reply)
        prefilled.append(pipe.timings.prompt_tokens)
    # turn 5 prefills about as much as turn 2, not the whole history
    assert prefilled[0] > prefilled[1] and max(prefilled[1:]) - min(prefilled[1:]) <= 2
    assert len(pipe.slot.tokens) > sum(prefilled[1:])
    # a conversation that does not extend the cached one starts over: only the [gMASK]sop prefix it
    # shares with the cache is reused
    new = [{"role": "user", "content": "new topic"}]
    pipe.chat(new, params=GREEDY, max_new_tokens=3)
    prompt = pipe.model.chat_format.encode_messages(new)
    assert pipe.timings.cached_tokens == 2 and pipe.timings.prompt_tokens == len(prompt) - 2
    assert pipe.slot.tokens[:len(prompt)] == prompt


def test_continuation_cache_equals_fresh_prefill(make_tiny):
    """KV reuse must not change meaning: the logits after a cached continuation equal a fresh
    session prefilled with the same token ids."""
    pipe = Pipeline(make_tiny("glm4"), backend="torch")
    history = [{"role": "user", "content": "hello"}]
    history.append(pipe.chat(history, params=GREEDY, max_new_tokens=5))
    history.append({"role": "user", "content": "and again"})
    pipe.chat(history, params=GREEDY, max_new_tokens=1)
    held = list(pipe.slot.tokens)
    m = pipe.model
    batch = m.scheduler.batch
    fresh = m.backend.load(m.config, load_weights(m.model_dir, m.config), LoadOptions())
    fresh.prefill(held)
    assert batch.kv_len(pipe.slot.index) == fresh.kv_len == len(held)
    np.testing.assert_allclose(batch.step([(pipe.slot.index, [7])])[0], fresh.decode(7), atol=1e-4)   # same cache


@pytest.mark.parametrize("backend", ["torch", "cpu_int4"])     # re-prefilled kept ids; cpu_int4's ring shifted in place
def test_window_keeps_system_turn_and_drops_whole_turns(make_tiny, backend):
    pipe = Pipeline(make_tiny("chatglm3"), backend=backend, options=LoadOptions(capacity=96),
                    window=WindowPolicy("window"))
    history = [{"role": "system", "content": "system prompt here"}]
    fmt = pipe.model.chat_format
    prefix = fmt.encode_messages(history[:1] + [{"role": "user", "content": "x"}])
    pinned = fmt.turn_spans(history[:1] + [{"role": "user", "content": "x"}])[0][1]
    prefilled, cached = [], []
    for turn in range(8):
        history.append({"role": "user", "content": f"turn {turn} with some words in it"})
        history.append(pipe.chat(history, params=GREEDY, max_new_tokens=8))
        prefilled.append(pipe.timings.prompt_tokens)
        cached.append(pipe.timings.cached_tokens)
    slot = pipe.slot
    assert slot.shifts > 0
    # the whole conversation is sent every turn, and the slid slot goes on from what it kept: each later turn
    # prefills its own ids only (the reply's last, unfed token and the new user turn), not the history again
    assert len(fmt.encode_messages(history)) > 96 and max(prefilled[1:]) <= prefilled[1] + 2
    assert cached[-1] > 96          # prompt ids covered by the slot: more than its context holds
    assert pipe.model.scheduler.batch.kv_len(pipe.slot.index) == len(pipe.slot.tokens)
    assert slot.tokens[:pinned] == prefix[:pinned]                 # [gMASK]sop + system survive
    user = pipe.model.tokenizer.special_ids["<|user|>"]
    assert slot.tokens[pinned] == user                              # the kept history starts at a turn
    assert all(slot.tokens[s] == user for s in slot.turn_starts)
