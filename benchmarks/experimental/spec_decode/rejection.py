"""Lossless verification of draft tokens: the target's logits at every draft position -> accepted tokens.

Dimension alphabet: R requests (padded rows), K drafts per request (static), V vocabulary.

Inputs per request r: the target's raw logits at its K + 1 scored positions [R, K+1, V] (position j
scores the token after the context + drafts d_0..d_{j-1}; position num_drafts[r] is the bonus
position), the drafts d [R, K] (entries at j >= num_drafts[r] are padding), num_drafts [R] in 0..K,
and the draft distributions q [R, K, V] the drafts were sampled from, or None for deterministic
drafts (n-gram lookup), which count as a point mass q_j = onehot(d_j).

The target distribution p_j is exactly the engine sampler's at that position (runner/sampler.py):
penalties over the history plus the drafts before j, banned ids, then (random rows) / temperature,
min_p, top_k, top_p, softmax. Greedy rows (temperature < GREEDY_EPS) use the argmax of the
penalised logits.

Greedy rows: accept d_j while d_j == argmax_j; the token after the accepted prefix is the target's
argmax at that position: the first mismatch's correction, or the bonus when all drafts matched.
The output equals non-speculative greedy decoding.

Random rows (Leviathan et al., speculative sampling): accept d_j when u_j * q_j(d_j) <= p_j(d_j),
i.e. with probability min(1, p_j(d_j) / q_j(d_j)) (never when p_j(d_j) = 0 or q_j(d_j) = 0). At
the first rejection j the output is a sample of the residual max(p_j - q_j, 0) / its sum (with a
point mass: p_j with d_j removed, renormalised) and verification stops. When all num_drafts are
accepted, the bonus is sampled from p at position num_drafts. Every output token is then
distributed exactly as non-speculative sampling from p (given the accepted prefix).

Randomness is the sampler's counter-based hash of (seed, step, token id): row-wise, so a request's
tokens depend only on its own logits, seed and steps (batch invariance). Position j uses step
`steps + j`, in three independent streams (the step's top bits are salted):
  stream 0: the sampler's own noise (the plain sampler's token and the bonus use it, so a
            request with num_drafts = 0 gets exactly `sampler.sample`'s token);
  stream 1: the acceptance uniform u_j in (0, 1) (24 random bits);
  stream 2: the Gumbel noise of the residual sample.
Salting needs steps < 2**28 (far above any context length).
A draft model that samples its drafts must use yet another stream (DRAFT_STREAM), since noise
shared with the residual sample would correlate the rejected draft with its replacement.

Output: token ids [R, K+1] (i32): the accepted drafts, then one more token (correction or bonus),
then -1; and num_accepted [R] (the request emits num_accepted + 1 tokens).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.runner.sampler import (
    GREEDY_EPS,
    SamplingMetadata,
    _mix32,
    filter_logits,
    gumbel_noise,
    process_logits,
)

ACCEPT_STREAM = 1
RESIDUAL_STREAM = 2
DRAFT_STREAM = 3
_STREAM_SHIFT = 28  # steps stay below 2**28, so a salted step never equals a plain one


class RejectionOutput(NamedTuple):
    token_ids: jax.Array  # [R, K+1] i32: accepted drafts, the correction or bonus token, then -1
    num_accepted: jax.Array  # [R] i32 in 0..num_drafts


def salted_steps(steps: jax.Array, stream: int) -> jax.Array:
    """steps [N] -> [N] u32 naming noise stream `stream` of those steps (0 = the sampler's own)."""
    return steps.astype(jnp.uint32) ^ jnp.uint32(stream << _STREAM_SHIFT)


def uniform_noise(seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """seeds [N, 2] u32, steps [N] -> one uniform in (0, 1) per row (never 0 or 1), from the row's key."""
    key = _mix32(seeds[:, 0] ^ _mix32(seeds[:, 1] ^ _mix32(steps.astype(jnp.uint32) + jnp.uint32(0x7F4A7C15))))
    bits = _mix32(key ^ jnp.uint32(0x85EBCA6B))
    return ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))


def expand_metadata(md: SamplingMetadata, draft_token_ids: jax.Array, num_positions: int | None = None
                    ) -> SamplingMetadata:
    """Per-request metadata [R] -> per-position metadata [R * P], row r * P + j for position j
    (P = num_positions, default K + 1: the K draft positions and the bonus).

    Position j samples output token `steps + j`, and its penalty history is the request's history
    followed by the drafts before j (draft_token_ids [R, K], -1 = padding, ignored by penalties).
    Banned ids are the request's at every position.

    NOTE: min_tokens bans (eos + stop ids) therefore hold for all K + 1 positions even when
    min_tokens is reached part-way; the caller must not draft past that point (or pass bans that
    already reflect it), or such a request's outputs differ from non-speculative decoding.
    """
    R, K = draft_token_ids.shape
    P = K + 1 if num_positions is None else num_positions

    def per_position(x):
        return jnp.repeat(x, P, axis=0)

    before = jnp.arange(K)[None, :] < jnp.arange(P)[:, None]  # [P, K]: draft i precedes position j
    drafts_before = jnp.where(before[None], draft_token_ids[:, None, :], -1)  # [R, P, K]
    history = jnp.concatenate(
        [jnp.broadcast_to(md.token_history[:, None, :], (R, P, md.token_history.shape[1])),
         drafts_before.astype(md.token_history.dtype)], axis=-1)
    return SamplingMetadata(
        temperature=per_position(md.temperature),
        top_k=per_position(md.top_k),
        top_p=per_position(md.top_p),
        min_p=per_position(md.min_p),
        repetition_penalty=per_position(md.repetition_penalty),
        presence_penalty=per_position(md.presence_penalty),
        frequency_penalty=per_position(md.frequency_penalty),
        seeds=per_position(md.seeds),
        steps=(md.steps[:, None] + jnp.arange(P, dtype=md.steps.dtype)[None, :]).reshape(R * P),
        banned_token_ids=per_position(md.banned_token_ids),
        token_history=history.reshape(R * P, -1),
        prompt_lens=per_position(md.prompt_lens),
    )


def _transformed(flat_logits: jax.Array, flat_md: SamplingMetadata, use_penalties: bool, all_greedy: bool
                 ) -> tuple[jax.Array, jax.Array | None]:
    """Raw logits [N, V] -> (penalised logits [N, V], the sampler's filtered logits [N, V] or None
    when all_greedy): the same chain as `sampler.sample`, greedy rows filtered at temperature 1."""
    processed = process_logits(flat_logits, flat_md, use_penalties)
    if all_greedy:
        return processed, None
    greedy = flat_md.temperature < GREEDY_EPS
    temperature = jnp.where(greedy, 1.0, flat_md.temperature).astype(jnp.float32)
    return processed, filter_logits(processed / temperature[:, None], flat_md)


@functools.partial(jax.jit, static_argnames=("use_penalties",))
def draft_distribution(draft_logits: jax.Array, draft_token_ids: jax.Array, md: SamplingMetadata, *,
                       use_penalties: bool) -> jax.Array:
    """A drafter's raw logits [R, K, V] (position j conditioned on drafts < j) -> q [R, K, V], the
    distribution the drafts must be sampled from: the engine sampler's transforms, one-hot argmax
    for greedy rows. draft_token_ids [R, K] feed the penalties of later positions (-1 = padding).

    A drafter samples d_j = argmax(log q_j + gumbel_noise(seeds, salted_steps(steps + j,
    DRAFT_STREAM), V)), a noise stream the verification does not use.
    """
    R, K, V = draft_logits.shape
    flat_md = expand_metadata(md, draft_token_ids, num_positions=K)
    processed, filtered = _transformed(draft_logits.reshape(R * K, V), flat_md, use_penalties, False)
    one_hot = jax.nn.one_hot(jnp.argmax(processed, axis=-1), V, dtype=jnp.float32)
    q = jnp.where((flat_md.temperature < GREEDY_EPS)[:, None], one_hot, jax.nn.softmax(filtered, axis=-1))
    return q.reshape(R, K, V)


def residual_probs(p: jax.Array, q: jax.Array | None, drafts: jax.Array) -> jax.Array:
    """p [R, K, V], q [R, K, V] or None (point mass on drafts [R, K]) -> the unnormalised
    max(p - q, 0) [R, K, V]; p itself where that is all zero (a rejection then has probability 0,
    reachable only through rounding)."""
    if q is None:
        residual = jnp.where(jnp.arange(p.shape[-1]) == drafts[..., None], 0.0, p)
    else:
        residual = jnp.maximum(p - q, 0.0)
    return jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p)


def accept_drafts(p_draft: jax.Array, q_draft: jax.Array, u: jax.Array) -> jax.Array:
    """[R, K] each -> [R, K] bool: accept with probability min(1, p/q); u in (0, 1)."""
    return (q_draft > 0) & (u * q_draft <= p_draft)


@functools.partial(jax.jit, static_argnames=("all_greedy", "use_penalties"))
def rejection_sample(
    target_logits: jax.Array,
    draft_token_ids: jax.Array,
    num_drafts: jax.Array,
    draft_probs: jax.Array | None,
    md: SamplingMetadata,
    *,
    all_greedy: bool,
    use_penalties: bool,
) -> RejectionOutput:
    """target_logits [R, K+1, V] raw, draft_token_ids [R, K] i32, num_drafts [R] i32, draft_probs
    [R, K, V] or None (point mass), md: the sampler's per-request metadata ([R] rows; steps = the
    index of the first output token scored) -> RejectionOutput. all_greedy and use_penalties mean
    what they mean for `sampler.sample`."""
    return _rejection_sample(target_logits, draft_token_ids, num_drafts, draft_probs, md,
                             all_greedy=all_greedy, use_penalties=use_penalties)


def _rejection_sample(target_logits, draft_token_ids, num_drafts, draft_probs, md, *, all_greedy,
                      use_penalties) -> RejectionOutput:
    R, P, V = target_logits.shape
    K = P - 1
    if K < 1:
        raise ValueError(f"target_logits {target_logits.shape}: need K + 1 >= 2 positions per request "
                         "(K >= 1 drafts); sample requests without drafts with sampler.sample")
    if draft_token_ids.shape != (R, K):
        raise ValueError(f"draft_token_ids {draft_token_ids.shape}: expected {(R, K)} for target_logits "
                         f"{target_logits.shape}")
    rows = jnp.arange(R)
    num_drafts = jnp.clip(num_drafts, 0, K).astype(jnp.int32)
    position = jnp.arange(K)[None, :]
    has_draft = position < num_drafts[:, None]  # [R, K]
    drafts = jnp.where(has_draft, draft_token_ids, -1).astype(jnp.int32)
    safe_drafts = jnp.clip(drafts, 0, V - 1)

    flat_md = expand_metadata(md, drafts)
    processed, filtered = _transformed(target_logits.reshape(R * P, V), flat_md, use_penalties, all_greedy)
    target_argmax = jnp.argmax(processed, axis=-1).astype(jnp.int32).reshape(R, P)
    greedy_accept = drafts == target_argmax[:, :K]

    if all_greedy:
        accept = greedy_accept
    else:
        greedy = md.temperature < GREEDY_EPS  # [R]
        noise = gumbel_noise(flat_md.seeds, flat_md.steps, V)
        plain = jnp.argmax(filtered + noise, axis=-1).astype(jnp.int32).reshape(R, P)
        p = jax.nn.softmax(filtered, axis=-1).reshape(R, P, V)[:, :K]  # [R, K, V]

        p_draft = jnp.take_along_axis(p, safe_drafts[..., None], axis=-1)[..., 0]
        if draft_probs is None:
            q = None
            q_draft = jnp.ones_like(p_draft)
        else:
            q = draft_probs.astype(jnp.float32)
            q_draft = jnp.take_along_axis(q, safe_drafts[..., None], axis=-1)[..., 0]
        draft_md = flat_md._replace(seeds=flat_md.seeds.reshape(R, P, 2)[:, :K].reshape(R * K, 2),
                                    steps=flat_md.steps.reshape(R, P)[:, :K].reshape(R * K))
        u = uniform_noise(draft_md.seeds, salted_steps(draft_md.steps, ACCEPT_STREAM)).reshape(R, K)
        random_accept = accept_drafts(p_draft, q_draft, u)

        residual = residual_probs(p, q, drafts).reshape(R * K, V)
        residual_noise = gumbel_noise(draft_md.seeds, salted_steps(draft_md.steps, RESIDUAL_STREAM), V)
        recovered = jnp.argmax(jnp.log(residual) + residual_noise, axis=-1).astype(jnp.int32).reshape(R, K)
        accept = jnp.where(greedy[:, None], greedy_accept, random_accept)

    accept = accept & has_draft
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    last = target_argmax[rows, num_accepted]  # greedy: the correction or the bonus
    if not all_greedy:
        rejected = num_accepted < num_drafts
        sampled_last = jnp.where(rejected, recovered[rows, jnp.minimum(num_accepted, K - 1)],
                                 plain[rows, num_accepted])
        last = jnp.where(greedy, last, sampled_last)

    out_position = jnp.arange(P)[None, :]
    padded_drafts = jnp.pad(drafts, ((0, 0), (0, 1)), constant_values=-1)
    token_ids = jnp.where(out_position < num_accepted[:, None], padded_drafts, -1)
    token_ids = jnp.where(out_position == num_accepted[:, None], last[:, None], token_ids)
    return RejectionOutput(token_ids.astype(jnp.int32), num_accepted)
