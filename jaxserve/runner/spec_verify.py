"""Verification of speculative guesses inside an ordinary step (no shapes of its own but one), for
greedy and random sampling alike.

A request scheduled with guesses (ScheduledRequest.draft_token_ids d_0..d_{n-1}) is a ragged row of
1 + n tokens: its input token, then the guesses. Each of its positions gets a logits row, so the
step's logits rows are, per sampling request in sampling order, 1 (a plain row) or 1 + n (the last
n + 1 positions of a row with guesses); R is padded to hold them all (the scheduler keeps their
number within max_num_seqs). The sampler runs on those rows as on any, position j of a request
with the metadata of its output token s + j (s = the request's output tokens so far): noise step
s + j, penalty history = its tokens then d_0..d_{j-1}, min_tokens bans while s + j < min_tokens
(`offsets`; model_runner._sampling_metadata). `verify` then reads, per request, how many guesses
equal the sampler's token at their row before the first mismatch, and takes the token at that row:
the correction, or the bonus token after every guess.

    logits row:   a0 | b0 b1 b2 b3 | c0          (request b: 3 guesses)
    offsets:      0  | 0  1  2  3  | 0           (the output token each row samples: s + offset)
    checks:       -1 | d0 d1 d2 -1 | -1          (the guess each row's sampled token must equal)
    first:        0, 1, 5                        (each request's first logits row)
    -> tokens [max_rows] (one per sampling request, the next step's input), num_accepted [max_rows]

Every array has the fixed length max_rows, so verification is one executable for every step.

Why this is lossless for random rows (temperature > 0, with top-k / top-p / min-p, penalties, seeds):
guesses are deterministic functions of the tokens before the step, i.e. a point-mass draft q_j =
onehot(d_j), for which Leviathan et al.'s rejection sampling accepts d_j with probability
min(1, p_j(d_j) / q_j(d_j)) = p_j(d_j) and on rejection samples p_j with d_j removed, renormalised.
The sampler's token at row j is x_j = argmax(filtered_j + G(seed, s + j)) (Gumbel-max: x_j ~ p_j,
the engine's own distribution at that position), so "accept while x_j == d_j, emit the first x_j
that differs" accepts d_j with probability p_j(d_j), and given x_j != d_j, x_j follows p_j without
d_j, renormalised: the same rule, its acceptance draw and residual sample coupled through one Gumbel
draw. Every emitted token is thus drawn from p given its actual prefix, with the noise of its own
output index, which no earlier emitted token depended on (rows past the first mismatch decide
nothing, so the next step may sample those output indices with the same noise). The outputs are not
only distributed as without speculation: they are the same tokens, seed for seed (up to float
differences between the verify step's logits and a one-token step's), since x_j is the token plain
decoding samples for output s + j. A request without guesses gets exactly the sampler's token.
Greedy rows are the same rule with x_j = argmax_j.

NOTE: this needs deterministic guesses (n-gram lookup, a drafter proposing its argmax). Guesses
sampled from a draft distribution q need Leviathan's general rule instead (accept with probability
min(1, p/q), resample a rejection from max(p - q, 0)), with the drafter's noise independent of p's.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.sched_types import Logprobs
from jaxserve.runner import sampler


class Guesses(NamedTuple):
    """The logits rows of a step with guesses (host arrays)."""

    logits_rows: np.ndarray  # [L] the token index of each scored position, L = the step's logits rows
    row_of: np.ndarray  # [L] each logits row's sampling request (an index into the sampling rows)
    offsets: np.ndarray  # [L] each logits row's position in its request: it samples output token s + offset
    checks: np.ndarray  # [max_rows] i32: the guess each logits row checks; -1 for none
    first: np.ndarray  # [max_rows] i32: each sampling request's first logits row
    drafts: dict[int, list[int]]  # sampling index -> the request's guesses (a device-guessed row's: at collect)
    # Device-guessed rows (ScheduledRequest.device_guesses), whose guesses are the previous step's drafts on
    # device and whose positions move by the count that step kept: sampling index -> its number of guesses;
    # per logits row, the index into the previous step's drafts [M, k] of the guess it checks (else -1) and
    # the previous step's sampling row whose kept count moves it (else -1); per sampling request, the same.
    device: dict[int, int] | None = None
    check_src: np.ndarray | None = None  # [max_rows] i32
    moved_by: np.ndarray | None = None  # [max_rows] i32, per logits row
    row_moved_by: np.ndarray | None = None  # [max_rows] i32, per sampling request


def layout_guesses(num_guesses: np.ndarray, drafts: dict[int, list[int]], last_token: np.ndarray, max_rows: int) -> Guesses:
    """num_guesses [S] per sampling request, drafts: sampling index -> its guesses, last_token [S]: the
    index of each request's last step token -> Guesses."""
    counts = 1 + num_guesses
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    row_of = np.repeat(np.arange(len(counts)), counts)
    offset = np.arange(int(counts.sum())) - first[row_of]  # position of the logits row within its request
    logits_rows = last_token[row_of] - num_guesses[row_of] + offset
    checks = np.full(max_rows, -1, np.int32)
    for index, guesses in drafts.items():
        checks[first[index]: first[index] + len(guesses)] = guesses
    padded_first = np.zeros(max_rows, np.int32)
    padded_first[: len(first)] = first
    return Guesses(logits_rows, row_of, offset, checks, padded_first, drafts)


def step_guesses(out, layout, max_rows: int, row_prev_index: np.ndarray | None = None,
                 k: int = 0) -> Guesses | None:
    """A SchedulerOutput and its step_types.StepRows -> the step's Guesses; None when no row has any.
    `row_prev_index` (each row's sampling index in the previous step) and `k` (the drafts' width) place
    device-guessed rows' guesses."""
    items, num_decode = out.scheduled, layout.num_decode
    if not any(item.draft_token_ids or item.device_guesses for item in items):
        return None
    num_guesses = np.zeros(len(layout.rows), np.int64)
    num_guesses[num_decode:] = [len(item.draft_token_ids or ()) or item.device_guesses for item in items]
    position = np.empty(len(layout.rows), np.int64)  # each row's index in the sampling order
    position[layout.sample_index] = np.arange(len(layout.sample_index))
    drafts = {int(position[num_decode + k]): item.draft_token_ids for k, item in enumerate(items)
              if item.draft_token_ids}
    guesses = layout_guesses(num_guesses[layout.sample_index], drafts, layout.ends[layout.sample_index] - 1,
                             max_rows)
    device = {int(position[num_decode + j]): item for j, item in enumerate(items) if item.device_guesses}
    if not device:
        return guesses
    check_src, moved_by, row_moved_by = (np.full(max_rows, -1, np.int32) for _ in range(3))
    for index, item in device.items():
        source, first, count = int(row_prev_index[item.row]), int(guesses.first[index]), item.device_guesses
        check_src[first: first + count] = source * k + np.arange(count)
        moved_by[first: first + 1 + count] = source
        row_moved_by[index] = source
    return guesses._replace(device={index: item.device_guesses for index, item in device.items()},
                            check_src=check_src, moved_by=moved_by, row_moved_by=row_moved_by)


def input_tokens(batch, guesses: Guesses | None, num_rows: int) -> np.ndarray:
    """The index in the step's tokens of each of its first `num_rows` sampling rows' input token (with
    guesses: a request's first logits row, its input position)."""
    if guesses is None:
        return batch.logits_indices[:num_rows]
    return guesses.logits_rows[guesses.first[:num_rows]]


def cut_guesses(drafts: list[int], count: int) -> list[int]:
    """A device-guessed row's guesses: its first `count` drafts, cut at the first -1 (a proposer's "no
    guess", never accepted)."""
    guesses = drafts[:count]
    return guesses[:guesses.index(-1)] if -1 in guesses else guesses


def append_accepted(handle, token_buf: np.ndarray, row_num_tokens: np.ndarray,
                    row_generation: np.ndarray) -> list[int]:
    """A collected step's accepted guesses appended to the runner's rows (those not reset since the
    dispatch), before its sampled tokens; -> num_accepted per sampling request."""
    rows = handle.rows
    num_accepted = np.asarray(handle.num_accepted)[: len(rows)].tolist()
    for i, guesses in handle.guesses.drafts.items():
        row, accepted = rows[i], num_accepted[i]
        if row_generation[row] == handle.generations[i] and accepted:
            start = row_num_tokens[row]
            token_buf[row, start: start + accepted] = guesses[:accepted]
            row_num_tokens[row] += accepted
    return num_accepted


def read_logprobs(handle, index: np.ndarray, num_accepted: list[int] | None, row_data: list,
                  vocab_size: int) -> tuple[list[Logprobs | None], dict[int, list[Logprobs]] | None]:
    """A collected step's logprobs: (per sampling request, for its token or None when it asked none;
    sampling index -> those of its accepted guesses). Without guesses the token of request i was sampled
    at logits row index[i]; with guesses a request's logits rows start at guesses.first, one per guess
    checked, and its token's is the first row after its accepted guesses."""
    lp, rank, top_ids, top_lps = jax.device_get(handle.logprobs)

    def entry(j: int, wanted: int) -> Logprobs:
        return Logprobs(float(lp[j]), int(rank[j]), top_ids[j, :wanted].tolist(), top_lps[j, :wanted].tolist())

    first = handle.guesses.first if handle.guesses is not None else None
    logprobs, guess_logprobs = [], {}
    for i, row in enumerate(handle.rows):
        wanted = row_data[row].sampling_params.logprobs
        wanted = vocab_size if wanted == -1 else wanted
        j = index[i] if first is None else first[i] + num_accepted[i]
        logprobs.append(None if wanted is None else entry(j, wanted))
        if wanted is not None and first is not None and num_accepted[i]:
            guess_logprobs[i] = [entry(first[i] + g, wanted) for g in range(num_accepted[i])]
    return logprobs, guess_logprobs or None


def verify(tokens: jax.Array, checks: jax.Array, first: jax.Array) -> tuple[jax.Array, jax.Array]:
    """tokens [N] (the sampler's token of every logits row), checks [N], first [N] -> (the token after each
    request's accepted guesses [N], num_accepted [N]). A row without a guess always 'mismatches', so the
    first mismatch at or after a request's first row lies within the request."""
    n = tokens.shape[0]
    index = jnp.arange(n, dtype=jnp.int32)
    mismatch = jnp.where(tokens != checks, index, n)
    first_mismatch = jax.lax.cummin(mismatch, axis=0, reverse=True)  # at or after each row
    stop = jnp.minimum(first_mismatch[first], n - 1)
    return tokens[stop], (stop - first).astype(jnp.int32)


# The counter of the acceptance draw in the sampling noise's hash (sampler.row_uniform): above any vocabulary.
SYNTHETIC_STREAM = 0xFFFFFFFF


def verify_synthetic(tokens: jax.Array, checks: jax.Array, first: jax.Array, seeds: jax.Array, steps: jax.Array,
                     acceptance: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The bench's synthetic acceptance (SpeculativeConfig.synthetic_acceptance): verify with "the row's
    token equals its guess" replaced by a draw u < acceptance, u uniform from the row's sampling key (seed,
    output index; seeds [N, 2], steps [N]). A request thus accepts guess j with probability `acceptance`
    while it accepted those before, and emits the sampler's token at its first rejected row. Each output
    index's draw decides at most once (rows past the first rejection decide nothing, and the next step
    scores those indices again), so the accepted lengths are independent truncated geometric draws."""
    n = tokens.shape[0]
    index = jnp.arange(n, dtype=jnp.int32)
    accept = (checks >= 0) & (sampler.row_uniform(seeds, steps, SYNTHETIC_STREAM) < acceptance)
    first_mismatch = jax.lax.cummin(jnp.where(accept, n, index), axis=0, reverse=True)
    stop = jnp.minimum(first_mismatch[first], n - 1)
    return tokens[stop], (stop - first).astype(jnp.int32)



def synthetic_inputs(md, acceptance: float, max_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The host sampling metadata's seeds and steps padded to max_rows, and the acceptance as a 0-d array
    (a traced input: every acceptance runs the same executable)."""
    rows = min(len(md.steps), max_rows)
    seeds, steps = np.zeros((max_rows, 2), np.uint32), np.zeros(max_rows, np.int32)
    seeds[:rows], steps[:rows] = md.seeds[:rows], md.steps[:rows]
    return seeds, steps, np.asarray(acceptance, np.float32)


def _resolve(checks, steps, check_src, moved_by, prev_drafts, prev_accepted):
    """Device-guessed rows' checks (the previous step's drafts at check_src) and output indices (moved by the
    count the previous step kept) filled in on device; the other rows' as given."""
    checks = jnp.where(check_src >= 0, prev_drafts.reshape(-1)[jnp.maximum(check_src, 0)], checks)
    steps = steps + jnp.where(moved_by >= 0, prev_accepted[jnp.maximum(moved_by, 0)], 0)
    return checks, steps


# The rows of verify_step's one host input [PACKED_FIELDS, max_rows] int32: checks, first (every step);
# check_src, moved_by (device-guessed rows); the synthetic acceptance's seeds (two uint32 rows, bit for bit),
# steps, and the acceptance (a float32, bit for bit, in the last row's first entry).
PACKED_FIELDS = 8


def _verify_step(sampled, packed, *prev, device: bool, synthetic: bool):
    """A step's verification in one program: _resolve (`device`: the step has device-guessed rows; `prev`:
    the previous step's drafts and accepted counts, none without `device`), then verify or, `synthetic`,
    verify_synthetic, reading every host input from `packed`."""
    checks, first, check_src, moved_by = packed[0], packed[1], packed[2], packed[3]
    steps = packed[6]
    if device:
        checks, steps = _resolve(checks, steps, check_src, moved_by, *prev)
    if not synthetic:
        return verify(sampled, checks, first)
    seeds = jax.lax.bitcast_convert_type(packed[4:6].T, jnp.uint32)
    acceptance = jax.lax.bitcast_convert_type(packed[7, 0], jnp.float32)
    return verify_synthetic(sampled, checks, first, seeds, steps, acceptance)


verify_step = jax.jit(_verify_step, static_argnames=("device", "synthetic"))


def compile_jobs(max_rows: int, on_device, synthetic: bool, k: int = 0) -> dict[tuple, tuple]:
    """The runner's precompile jobs (key -> (function, args)) of verify_step: without device-guessed rows,
    with them when the proposer drafts on device (`k`: the drafts' width; 0: none), and of each the
    synthetic variant when the bench asked for it."""
    rows = jax.ShapeDtypeStruct((max_rows,), jnp.int32, sharding=on_device)
    packed = jax.ShapeDtypeStruct((PACKED_FIELDS, max_rows), jnp.int32, sharding=on_device)
    drafts = jax.ShapeDtypeStruct((max_rows, max(k, 1)), jnp.int32, sharding=on_device)
    jobs = {}
    for device in (False, True) if k else (False,):
        for synth in (False, True) if synthetic else (False,):
            jobs[("verify", device, synth)] = (
                lambda device=device, synth=synth: verify_step.lower(
                    rows, packed, *((drafts, rows) if device else ()), device=device, synthetic=synth).compile(), ())
    return jobs


def pack(guesses: Guesses, max_rows: int, synthetic: tuple[np.ndarray, np.ndarray, np.ndarray] | None) -> np.ndarray:
    """verify_step's host input (PACKED_FIELDS)."""
    packed = np.zeros((PACKED_FIELDS, max_rows), np.int32)
    packed[0], packed[1] = guesses.checks, guesses.first
    if guesses.device:
        packed[2], packed[3] = guesses.check_src, guesses.moved_by
    if synthetic is not None:
        seeds, steps, acceptance = synthetic
        packed[4:6] = seeds.T.view(np.int32)
        packed[6] = steps
        packed[7, 0] = np.asarray(acceptance, np.float32).view(np.int32)
    return packed


def run(compiled: dict, sampled: jax.Array, guesses: Guesses,
        synthetic: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
        prev: tuple[jax.Array, jax.Array] | None = None) -> tuple[jax.Array, jax.Array]:
    """The step's verification (`compiled`: the runner's precompiled executables, by key) on the sampler's
    tokens -> (tokens, num_accepted), both copying to the host: one program, its host inputs in one array
    that the call copies in (a call takes a host array for less host time than a device_put of it).
    `synthetic`: synthetic_inputs(...), for the bench's synthetic acceptance. `prev`: the previous step's
    (drafts, num_accepted) on device, read by device-guessed rows (guesses.device)."""
    device, synth = bool(guesses.device), synthetic is not None
    packed = pack(guesses, len(guesses.checks), synthetic)
    args = (sampled, packed, *(prev if device else ()))
    program = compiled.get(("verify", device, synth))
    tokens, num_accepted = (program(*args) if program is not None
                            else verify_step(*args, device=device, synthetic=synth))
    num_accepted.copy_to_host_async()
    return tokens, num_accepted
