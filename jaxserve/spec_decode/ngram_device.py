"""N-gram prompt lookup on the device: ngram.propose_batch's rule in jnp, and each request's tokens kept
in a device history so that a step's proposals are made right after it, from tokens the host has not
seen yet (the runner's part: runner/ngram_runner.py).

    propose(tokens [B, L], lengths [B], k, min_n, max_n) -> drafts [B, k] int32, -1 padded: the same drafts
    as ngram.propose_batch row by row (the most recent occurrence of the longest matching suffix, n in
    [min_n, max_n], followed by up to k tokens before the row's end). The engine's step searches each
    row's last WINDOW tokens: the host's lookup over a longer context may find an older match.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


WINDOW = 8192  # a row's most recent tokens searched for its suffix (the host's lookup searches them all)


def propose(tokens: jax.Array, lengths: jax.Array, *, k: int, min_n: int, max_n: int) -> jax.Array:
    """ngram.propose_batch on the device (its docstring; the same runs of matching suffix tokens per
    possible occurrence end, one pass per suffix offset)."""
    batch, length = tokens.shape
    if length < 2:
        return jnp.full((batch, k), -1, jnp.int32)
    rows = jnp.arange(batch)
    ends = jnp.arange(length - 1)[None, :]
    alive = ends <= (lengths - 2)[:, None]
    run = jnp.zeros((batch, length - 1), jnp.int32)
    for j in range(min(max_n, length - 1)):
        last = tokens[rows, jnp.maximum(lengths - 1 - j, 0)]
        shifted = jnp.pad(tokens[:, : length - 1 - j], ((0, 0), (j, 0)), constant_values=-1)
        equal = (shifted == last[:, None]) & (ends >= j)
        alive = alive & equal
        run = run + alive
    best = run.max(axis=1)
    found = best >= min_n
    latest = length - 2 - jnp.argmax((run == best[:, None])[:, ::-1], axis=1)
    match_end = jnp.where(found, latest, -1)
    follow = match_end[:, None] + 1 + jnp.arange(k)[None, :]
    valid = found[:, None] & (follow < lengths[:, None])
    return jnp.where(valid, tokens[rows[:, None], jnp.clip(follow, 0, length - 1)], -1).astype(jnp.int32)


def _set_row(history: jax.Array, row: jax.Array, tokens: jax.Array) -> jax.Array:
    """history [N, L] with row `row` replaced by tokens [L] (a request's known tokens, zero padded)."""
    return jax.lax.dynamic_update_slice(history, tokens[None, :], (row, 0))


set_row = jax.jit(_set_row, donate_argnums=0)


def _step(history, token_ids, positions, query_start_loc, rows, prev_accepted, out_tokens, num_accepted, *,
          k: int, min_n: int, max_n: int, fill: int):
    """One step's part -> (history, drafts [M, k]). `rows`: the step's host inputs in one int32 array, request_rows
    [R] (R = the batch's requests, len(query_start_loc) - 1), then sample_rows, base and moved_by [M] each (M =
    len(prev_accepted)). The step's input tokens (token_ids, positions [T]; the staged batch's, moved on device)
    go into their requests' rows (request_rows: each batch request's history row); then each sampling row's output token (out_tokens [M]) at the position after its kept
    guesses (base [M]: its position with none kept, moved by prev_accepted for rows moved_by an earlier
    step, plus num_accepted [M]); then each sampling row (sample_rows [M], -1 padding) proposes from its
    history up to that token. `fill` >= 0 replaces -1 (no guess) in the drafts (the bench's synthetic
    acceptance needs a guess at every position)."""
    num_rows, length = history.shape
    r, m = query_start_loc.shape[0] - 1, prev_accepted.shape[0]
    request_rows, sample_rows, base, moved_by = (rows[:r], rows[r:r + m], rows[r + m:r + 2 * m],
                                                 rows[r + 2 * m:r + 3 * m])
    token = jnp.arange(token_ids.shape[-1])
    real = token < query_start_loc[-1]
    request = jnp.clip(jnp.searchsorted(query_start_loc, token, side="right") - 1, 0, request_rows.shape[0] - 1)
    target = jnp.where(real, request_rows[request], num_rows)  # (out of range: dropped)
    history = history.at[target, jnp.clip(positions, 0, length - 1)].set(token_ids, mode="drop")
    position = base + jnp.where(moved_by >= 0, prev_accepted[jnp.maximum(moved_by, 0)], 0) + num_accepted
    sampling = sample_rows >= 0
    history = history.at[jnp.where(sampling, sample_rows, num_rows), jnp.clip(position, 0, length - 1)].set(
        out_tokens, mode="drop")
    lengths = jnp.where(sampling, jnp.minimum(position + 1, length), 0)
    # each row's last WINDOW tokens (all of them in a shorter context) are searched
    window = min(WINDOW, length)
    start = jnp.maximum(lengths - window, 0)
    columns = jnp.minimum(start[:, None] + jnp.arange(window)[None, :], length - 1)
    recent = history[jnp.maximum(sample_rows, 0)[:, None], columns]
    drafts = propose(recent, lengths - start, k=k, min_n=min_n, max_n=max_n)
    if fill >= 0:
        drafts = jnp.where(drafts < 0, fill, drafts)
    return history, drafts


step = jax.jit(_step, static_argnames=("k", "min_n", "max_n", "fill"), donate_argnums=0)
