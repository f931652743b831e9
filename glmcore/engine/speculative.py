"""Speculative decoding: a drafter proposes the next few tokens of a sequence, one batched step feeds
them after the last sampled token and returns the logits of every position, and the step loop keeps the
drafted tokens the target model would itself have produced (glmcore.engine.step; Sampler.verify). On a
CPU a decode step is memory-bound, so verifying k tokens costs about one step: accepted drafts are
nearly free."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from ..backend import BatchSession, Capabilities
from ..errors import GlmcoreError
from .request import RequestState


class Method(str, enum.Enum):
    OFF = "off"
    NGRAM = "ngram"      # prompt lookup: continue an earlier occurrence of the sequence's last n-gram
    MTP = "mtp"          # the checkpoint's multi-token-prediction (NextN) layer

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Speculation:
    method: Method = Method.OFF
    draft_tokens: int = 4            # at most this many drafted tokens per sequence and step

    def __post_init__(self):
        try:
            object.__setattr__(self, "method", Method(self.method))
        except ValueError:
            raise GlmcoreError(f"unknown speculative method {self.method!r}; choose "
                               f"{', '.join(m.value for m in Method)}") from None
        if self.draft_tokens < 1:
            raise GlmcoreError(f"invalid --draft-tokens {self.draft_tokens}: use a positive integer")

    def checked(self, caps: Capabilities) -> "Speculation":
        """This configuration, refused where the backend cannot verify drafts in one step."""
        if self.method is not Method.OFF and not caps.native_batch:
            raise GlmcoreError(f"--speculative {self.method} needs a backend with native batched steps (one step "
                               "verifies the drafts and rejected ones are cut from its cache); use --speculative off "
                               "or a backend such as cpu_int4 or torch")
        return self

    @property
    def draft_tokens_per_step(self) -> int:
        return 0 if self.method is Method.OFF else self.draft_tokens

    def drafter(self, batch: BatchSession) -> "NgramDrafter | MtpDrafter | None":
        if self.method is Method.NGRAM:
            return NgramDrafter()
        if self.method is Method.MTP:
            if not batch.has_nextn:
                why = getattr(batch, "nextn_refusal", None) or (   # the backend's own reason, where it gives one
                    "it needs a checkpoint with a multi-token-prediction (NextN) layer (glm4_moe: "
                    "num_nextn_predict_layers, the mtp tensors kept) on a backend that runs it (torch, cpu_int4, "
                    "openvino_amx, ascend_npu)")
                raise GlmcoreError(f"--speculative mtp cannot run: {why}; use --speculative ngram")
            batch.start_nextn()
            return MtpDrafter(batch)
        return None


class NgramDrafter:
    """Prompt lookup (transformers' prompt_lookup_num_tokens, llama.cpp's ngram speculation): find the
    latest earlier occurrence of the sequence's last n ids (n from max_n down to min_n) in its prompt and
    output so far, and propose the ids that followed it. Single-id matches are not used by default: on the
    demo model they drafted three times as much for twice the accepted tokens, and a rejected draft costs."""

    def __init__(self, max_n: int = 3, min_n: int = 2):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, state: RequestState, k: int) -> list[int]:
        ids = np.asarray(state.history, dtype=np.int64)
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            tail = ids[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)     # every earlier n-gram
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return ids[start:start + k].tolist()
        return []


class MtpDrafter:
    """The checkpoint's NextN layer, run by the backend (BatchSession.draft_nextn) from the target's hidden
    states: its greedy drafts, verified as any draft."""

    def __init__(self, batch: BatchSession):
        self.batch = batch

    def propose(self, state: RequestState, k: int) -> list[int]:
        return self.batch.draft_nextn(state.slot.index, state.pending, k)
