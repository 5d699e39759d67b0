"""Prompt log-probabilities (SamplingParams.prompt_logprobs) for the model runner.

    prepare: the step's prefill chunks of rows that ask for them -> PromptRows: for each position p of
      a chunk with p + 1 < the prompt's length, the flat token index whose logits score prompt token
      p + 1, and that token (padded to `num_rows(T, cap)` with index 0 / token 0)
    forward: the step's variant that also returns every token's final-normed hidden state [T, D]
      -> compute(): the L = num_rows rows -> lm head -> log_softmax -> the scored token's logprob and
      rank, and the top-K (K = the runner's max_logprobs; each request keeps its own N)
    collect: the four arrays read back once -> one sched_types.PromptLogprobs per request chunk

The variant is compiled per token bucket T, with the largest request bucket that T pairs with in the
precompile plan (every step of T tokens fits it), so plain steps keep their own executables and never
compute logits for more than their sampling rows. The scheduler lets a step score at most `cap`
(sched_types.MAX_PROMPT_LOGPROB_ROWS) prompt positions, so L = min(T, cap) whatever the bucket: the
outputs are [L, K] and the temporaries [L, V] float32 (`device_bytes` counts both for the KV-cache
sizing).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.sched_types import PromptLogprobs, ScheduledRequest
from jaxserve.models import registry
from jaxserve.runner import sampler

class PromptRows(NamedTuple):
    """The rows of one step whose logits give prompt logprobs."""

    indices: np.ndarray  # [num_rows(T)] int32, flat token index in the step's batch
    targets: np.ndarray  # [num_rows(T)] int32, the prompt token those logits score
    # (request id, row, row generation at dispatch, offset into indices, first prompt position scored, count)
    segments: list[tuple[str, int, int, int, int, int]]


def num_rows(t_pad: int, cap: int) -> int:
    """Rows of the prompt-logprob arrays of a T-token step that scores at most `cap` prompt positions."""
    return min(t_pad, cap)


def device_bytes(t_pad: int, cap: int, vocab_size: int, num_logprobs: int) -> int:
    """Device memory of a T-token variant step beyond the plain step's: its outputs (logprob and rank,
    top ids and logprobs [L, K]; twice, as the overlap keeps one step's until the next has run) and its
    temporaries, counted as four [L, V] float32 arrays (logits, log-softmax, and top_k's sort keys and
    indices)."""
    rows = num_rows(t_pad, cap)
    return 2 * rows * (8 + 8 * num_logprobs) + 4 * rows * vocab_size * 4


def gather(items: list[ScheduledRequest], first_token: np.ndarray, wants: np.ndarray, token_buf: np.ndarray,
           num_prompt: np.ndarray, generation: np.ndarray, rows: int) -> PromptRows | None:
    """The PromptRows of a step's `items` (prefill chunks; `first_token[i]`: the flat index of item i's
    first token), padded to `rows`, or None when no chunk holds a position that scores a prompt token."""
    indices, targets, segments, offset = [], [], [], 0
    for item, first in zip(items, first_token):
        row = item.row
        if not wants[row]:
            continue
        start = item.num_computed_tokens
        stop = min(start + item.num_new_tokens, int(num_prompt[row]) - 1)  # the last prompt token scores none
        if stop <= start:
            continue
        count = stop - start
        indices.append(np.arange(first, first + count))
        targets.append(token_buf[row, start + 1: stop + 1])
        segments.append((item.request_id, row, int(generation[row]), offset, start + 1, count))
        offset += count
    if not segments:
        return None
    if offset > rows:
        raise RuntimeError(f"the step scores {offset} prompt positions, more than its {rows} prompt-logprob rows "
                           f"(the scheduler bounds them)")
    padded_indices = np.zeros(rows, np.int32)
    padded_targets = np.zeros(rows, np.int32)
    padded_indices[:offset] = np.concatenate(indices)
    padded_targets[:offset] = np.concatenate(targets)
    return PromptRows(padded_indices, padded_targets, segments)


def compute(params, cfg, hidden: jax.Array, indices: jax.Array, targets: jax.Array, num_logprobs: int):
    """On device, in the step: (logprob [L], rank [L], top ids [L, K], top logprobs [L, K]) of each row's
    target under the raw distribution at `hidden[indices]`; rank 1 = the most likely token."""
    logits = registry.family_of(cfg).head_logits(params, cfg, hidden[indices])  # [L, V] float32
    if num_logprobs > 0:
        return sampler.compute_logprobs(logits, targets, num_logprobs)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    scored = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)
    rank = 1 + jnp.sum(logprobs > scored, axis=-1, dtype=jnp.int32)
    rows = indices.shape[0]
    return scored[:, 0], rank, jnp.zeros((rows, 0), jnp.int32), jnp.zeros((rows, 0), jnp.float32)


def chunks(segments, arrays, generation: np.ndarray, row_data, vocab_size: int) -> list[PromptLogprobs]:
    """The host-side result of a collected step: one PromptLogprobs per segment whose row was not reset
    since the dispatch (a request preempted since recomputes its prompt, so nothing is lost)."""
    logprobs, ranks, top_ids, top_logprobs = jax.device_get(arrays)
    out = []
    for request_id, row, dispatched_generation, offset, start, count in segments:
        if generation[row] != dispatched_generation:
            continue
        wanted = row_data[row].sampling_params.prompt_logprobs
        num_top = vocab_size if wanted == -1 else wanted
        span = slice(offset, offset + count)
        out.append(PromptLogprobs(
            request_id, start, row_data[row].all_token_ids[start: start + count], logprobs[span].tolist(),
            ranks[span].tolist(), top_ids[span, :num_top].tolist(), top_logprobs[span, :num_top].tolist()))
    return out
