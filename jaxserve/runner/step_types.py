"""The model runner's records of one step: its requests in batch order (StepRows), its host side ready to
dispatch (HostStep), and the dispatched step until its outputs are collected (StepHandle)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np

from jaxserve.core.sched_types import RunnerOutput
from jaxserve.models.layers import ModelBatch
from jaxserve.runner import prompt_logprobs, spec_verify


class StepRows(NamedTuple):
    """One scheduler output's requests in batch order (decode rows first) and their step tokens."""

    rows: np.ndarray  # [R] the requests' runner rows
    starts: np.ndarray  # [R] position of each request's first step token
    counts: np.ndarray  # [R] step tokens of each request
    ends: np.ndarray  # [R] cumsum(counts)
    token_rows: np.ndarray  # [T] the row of each token
    pos: np.ndarray  # [T] the position of each token
    sample_index: np.ndarray  # the requests that sample, as indices into rows
    num_decode: int  # plain decode rows at the front

    @property
    def num_tokens(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0


class HostStep(NamedTuple):
    """The host side of one step, ready to dispatch."""

    batch: ModelBatch
    prev_index: np.ndarray  # [T]: >= 0 where the token is the previous step's sampled token at that index
    rows: np.ndarray  # the sampling rows, in sampling order
    generations: np.ndarray  # row_generation of those rows
    request_ids: list[str]  # of the sampling rows
    sampling: tuple | None  # (SamplingMetadata, all_greedy, use_penalties, num_logprobs); None: nothing sampled
    decode_only: bool = False  # one token per request, token r being request r's
    prompt: prompt_logprobs.PromptRows | None = None  # rows that give prompt logprobs
    index: np.ndarray | None = None  # where each sampling row's token lies in the step's tokens (None: in order)
    guesses: spec_verify.Guesses | None = None  # the logits rows of speculative rows (spec_verify.py)
    layout: StepRows | None = None  # the step's requests (an EAGLE head's inputs follow them)


@dataclasses.dataclass
class StepHandle:
    """A dispatched step: its sampled tokens (on device, copying to the host) until collected."""

    request_ids: list[str]
    rows: np.ndarray  # the sampling rows, in sampling order
    generations: np.ndarray  # row_generation of those rows at dispatch
    tokens: jax.Array  # [max_rows] int32
    logprobs: tuple | None
    ready: jax.Array  # an output of the step that is never donated: ready when the device finished it
    output: RunnerOutput | None = None
    prompt: tuple | None = None  # (PromptRows.segments, prompt_logprobs.compute's arrays) of the step
    index: np.ndarray | None = None  # HostStep.index
    expert_load: jax.Array | None = None  # the expert load accumulated up to this step (ep_runner.py)
    guesses: spec_verify.Guesses | None = None  # HostStep.guesses
    num_accepted: jax.Array | None = None  # [max_rows] guesses accepted per sampling row (with `guesses`)
    drafts: jax.Array | None = None  # [max_rows, k] the draft model's guesses for each sampling row's next step
