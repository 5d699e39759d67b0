"""The draft model's device programs (runner/draft_runner.py calls them, ahead-of-time compiled).

The draft keeps a paged KV cache of its own, indexed by the target's block tables and slot mapping (a
token's position is the same in both models), so it needs no blocks of its own: only its bytes per block
count in the KV budget. Each engine step runs, after the target's forward, sampler and verification, one
program of k forwards:

    fill_propose(draft params, the step's staged ModelBatch, draft caches, tokens, num_accepted, rows)
        fill: the draft's forward over the same ragged batch (prefill chunks, decode rows, guesses), so its
        K/V is written at every slot the target wrote this step, joined with one decode entry per sampling
        row of the step's request bucket R (`_joined`): the row's next token (the step's sampled or
        corrected token, still on device) at position base + num_accepted, whose argmax is the first guess;
        then k - 1 greedy decode steps of the draft, one query token per row, step j feeding the draft's own
        argmax of step j - 1 one position further; -> drafts [M, k] (zero past R). The guesses' K/V is
        written into the row's own slots (the scheduler allocated them: positions up to the step's last +
        k) and rewritten by a later step's fill before any step reads it as context, since every position
        a request computes is filled in the step that computes it.

Rows the host marks as having no room (capacity: the slots of the row's allocated blocks; 0 for the
padding rows) write into the null block 0 from the first position past it on: their drafts are garbage and
the scheduler never uses them (it keeps only the drafts of rows it allocated the lookahead for).

Dimension alphabet (models/layers.py): M rows, k draft tokens, T tokens, R requests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxserve.models import registry
from jaxserve.models.layers import ModelBatch


def decode_batch(tokens: jax.Array, positions: jax.Array, capacity: jax.Array, block_tables: jax.Array,
                 block_size: int) -> ModelBatch:
    """One query token per row: tokens, positions, capacity [M], block_tables [M, max_blocks] -> the
    decode-only ModelBatch. A row whose position is at or past its capacity computes position 0 and
    writes into the null block (slot 0)."""
    rows = tokens.shape[0]
    room = positions < capacity
    positions = jnp.where(room, positions, 0)
    block = jnp.take_along_axis(block_tables, (positions // block_size)[:, None], axis=1)[:, 0]
    slots = jnp.where(room, block * block_size + positions % block_size, 0)
    index = jnp.arange(rows + 1, dtype=jnp.int32)
    return ModelBatch(tokens, positions, slots.astype(jnp.int32), index, positions + 1, block_tables, index[:rows])


def first_rows(num_rows: int, *arrays):
    """The first num_rows rows of each [M, ...] array (of `rows` [4, M]: its first columns). A step's sampling
    rows are at most its padded request count R, so the guessing steps run R rows, not the runner's max."""
    *arrays, rows = arrays
    return (*(a[:num_rows] for a in arrays), rows[:, :num_rows])


def stack_drafts(drafts: list[jax.Array], num_rows: int) -> jax.Array:
    """The k guess arrays [R] of a propose program -> drafts [num_rows, k], zero past R: one shape for every
    step, which the next step's staging reads (a device-guessed row's guesses)."""
    stacked = jnp.stack(drafts, axis=1)
    return jnp.pad(stacked, ((0, num_rows - stacked.shape[0]), (0, 0)))


def _joined(batch: ModelBatch, tokens: jax.Array, num_accepted: jax.Array, rows: jax.Array,
            block_size: int) -> ModelBatch:
    """The step's staged batch (T tokens, R requests) followed by one decode entry per sampling row (R of
    them, `first_rows`): its next token (the step's sampled or corrected one) at position base +
    num_accepted, over its request's block table -> a batch of T + R tokens and 2R requests whose logits
    rows are the R entries. The staged tokens past a sampling row's input token and its accepted guesses
    (the rejected guesses) write the null slot 0, so the slot after the accepted ones is the next token's
    alone. The forward writes every token's K/V of a layer before any token attends, so each entry sees
    its request's accepted K/V of this same step."""
    num_tokens, num_requests = batch.token_ids.shape[0], batch.block_tables.shape[0]
    tokens, num_accepted, rows = first_rows(num_requests, tokens, num_accepted, rows)
    batch_row, base, capacity, first = rows[0], rows[1], rows[2], rows[3]
    qsl = batch.query_start_loc
    # each request's first rejected token index (its end where it samples nothing or accepted all)
    cut = qsl[1:].at[jnp.where(capacity > 0, batch_row, num_requests)].set(first + num_accepted + 1, mode="drop")
    index = jnp.arange(num_tokens, dtype=jnp.int32)
    owner = jnp.clip(jnp.searchsorted(qsl, index, side="right") - 1, 0, num_requests - 1)
    rejected = (index >= cut[owner]) & (index < qsl[owner + 1])
    tables = batch.block_tables[batch_row]
    entries = decode_batch(tokens, base + num_accepted, capacity, tables, block_size)
    join = jnp.concatenate
    return ModelBatch(join([batch.token_ids, entries.token_ids]), join([batch.positions, entries.positions]),
                      join([jnp.where(rejected, 0, batch.slot_mapping), entries.slot_mapping]),
                      join([qsl, num_tokens + entries.query_start_loc[1:]]), join([batch.seq_lens, entries.seq_lens]),
                      join([batch.block_tables, tables]), num_tokens + jnp.arange(num_requests, dtype=jnp.int32))


def _fill_propose(params, batch: ModelBatch, kv_caches, tokens: jax.Array, num_accepted: jax.Array,
                  rows: jax.Array, *, cfg, k: int, block_size: int, attention_backend: str, tp):
    """fill and propose as one program of k forwards: the first is the fill's over the step's batch joined
    with the sampling rows' next tokens (`_joined`), which also gives the first guess; then k - 1 decode
    steps as propose's. Arguments and result as propose's, with the staged batch for its block tables."""
    forward = registry.family_of(cfg).forward
    num_rows = tokens.shape[0]
    logits, kv_caches, *_ = forward(params, cfg, _joined(batch, tokens, num_accepted, rows, block_size), kv_caches,
                                    attention_backend=attention_backend, tp=tp)
    tokens, num_accepted, rows = first_rows(batch.block_tables.shape[0], tokens, num_accepted, rows)
    block_tables = batch.block_tables[rows[0]]
    drafts = [jnp.argmax(logits, axis=-1).astype(jnp.int32)]
    positions = rows[1] + num_accepted + 1
    for _ in range(k - 1):
        step = decode_batch(drafts[-1], positions, rows[2], block_tables, block_size)
        logits, kv_caches, *_ = forward(params, cfg, step, kv_caches, attention_backend=attention_backend, tp=tp,
                                        decode_only=True)
        drafts.append(jnp.argmax(logits, axis=-1).astype(jnp.int32))
        positions = positions + 1
    return kv_caches, stack_drafts(drafts, num_rows)


@functools.cache
def fill_propose_with(options: tuple[tuple[str, object], ...] = ()):
    """fill_propose jitted with these XLA compiler options (as sorted items; a GPU step's are
    step_program.gpu_compiler_options), one per option set."""
    return jax.jit(_fill_propose, static_argnames=("cfg", "k", "block_size", "attention_backend", "tp"),
                   donate_argnames=("kv_caches",), compiler_options=dict(options) or None)


fill_propose = fill_propose_with()
