"""Token sampling for one step: raw logits [R, V] + per-request metadata -> token ids [R].

Data flow (vLLM V1 semantics; every op is row-wise, so a row never sees another row):

    logits [R, V] f32 (raw)
      ├─ logprobs (num_logprobs > 0): log_softmax of the RAW logits -> sampled logprob / rank, top-N
      └─ process_logits: repetition / frequency / presence penalties (use_penalties) -> banned ids = -inf
           ├─ greedy rows (temperature < 1e-5): argmax
           └─ other rows: / temperature -> filter_logits (min_p -> top_k -> top_p) -> + Gumbel noise
                          -> argmax (the Gumbel-max trick: an exact sample of softmax(filtered))

The noise of a row is a counter-based hash of (seed, step, token id) over the full vocabulary in
token-id order, so a row's token depends only on its own logits, seed and step: not on its
position in the batch, the other rows, or the padded R (batch invariance). A
request is therefore reproducible under any scheduling.

`SamplingMetadata` is built on the host as numpy, one row per request; the runner fills rows of an
`empty_metadata` whose defaults (greedy, every option off) are also the padding rows.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

GREEDY_EPS = 1e-5  # temperature below this means greedy (vLLM's _SAMPLING_EPS)


class SamplingMetadata(NamedTuple):
    """Per-request sampling state, one row per request; R is the padded request bucket."""

    temperature: jax.Array  # [R] f32, < GREEDY_EPS = greedy
    top_k: jax.Array  # [R] i32, <= 0 = disabled, else k >= 1
    top_p: jax.Array  # [R] f32, 1.0 = disabled
    min_p: jax.Array  # [R] f32, 0.0 = disabled
    repetition_penalty: jax.Array  # [R] f32, 1.0 = off
    presence_penalty: jax.Array  # [R] f32, 0.0 = off
    frequency_penalty: jax.Array  # [R] f32, 0.0 = off
    seeds: jax.Array  # [R, 2] u32, a 64-bit seed as (low, high) words
    steps: jax.Array  # [R] i32, index of the output token being sampled (= tokens generated so far)
    # [R] i32, -1 = steps as given; else steps counts none of the guesses the previous step's sampling row
    # step_from verified (that step still in flight), and its kept count (sample's prev_accepted) is added
    step_from: jax.Array
    banned_token_ids: jax.Array  # [R, B] i32, forced to -inf (min_tokens: eos + stop ids); -1 = pad
    token_history: jax.Array  # [R, Hmax] i32, prompt + output ids, -1 = pad (read only with penalties)
    prompt_lens: jax.Array  # [R] i32, how many leading history entries are prompt tokens


class SamplerOutput(NamedTuple):
    token_ids: jax.Array  # [R] i32
    # (sampled_logprob [R] f32, sampled_rank [R] i32, top_ids [R, N] i32, top_logprobs [R, N] f32),
    # or None when num_logprobs == 0.
    logprobs: tuple[jax.Array, jax.Array, jax.Array, jax.Array] | None


def empty_metadata(num_rows: int, num_banned: int, history_len: int) -> SamplingMetadata:
    """Host-side metadata of `num_rows` padding rows (greedy, everything off), to be filled per row."""
    R = num_rows
    return SamplingMetadata(
        temperature=np.zeros(R, np.float32),
        top_k=np.zeros(R, np.int32),
        top_p=np.ones(R, np.float32),
        min_p=np.zeros(R, np.float32),
        repetition_penalty=np.ones(R, np.float32),
        presence_penalty=np.zeros(R, np.float32),
        frequency_penalty=np.zeros(R, np.float32),
        seeds=np.zeros((R, 2), np.uint32),
        steps=np.zeros(R, np.int32),
        step_from=np.full(R, -1, np.int32),
        banned_token_ids=np.full((R, num_banned), -1, np.int32),
        token_history=np.full((R, history_len), -1, np.int32),
        prompt_lens=np.zeros(R, np.int32),
    )


def seed_words(seed: int) -> tuple[int, int]:
    """A 64-bit seed as the (low, high) uint32 words stored in `SamplingMetadata.seeds`."""
    seed &= (1 << 64) - 1
    return seed & 0xFFFFFFFF, seed >> 32


def _scatter_rows(values: jax.Array, ids: jax.Array, updates: jax.Array, op: str) -> jax.Array:
    """values [R, V]; ids [R, X] (-1 = pad, dropped); updates [R, X] or scalar."""
    V = values.shape[-1]
    rows = jnp.arange(values.shape[0])[:, None]
    # NOTE: -1 must not reach the scatter: negative indices wrap to V - 1 in JAX.
    cols = jnp.where((ids >= 0) & (ids < V), ids, V)
    return getattr(values.at[rows, cols], op)(updates, mode="drop")


def apply_penalties(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """logits [R, V] -> [R, V] with repetition, frequency and presence penalties (vLLM V1).

    Neutral values (1, 0, 0) leave a row bit-identical, so no per-row gating is needed.
    """
    R, V = logits.shape
    history = md.token_history
    position = jnp.arange(history.shape[1])[None, :]
    is_prompt = position < md.prompt_lens[:, None]
    output_counts = _scatter_rows(jnp.zeros((R, V), jnp.int32), history, (~is_prompt).astype(jnp.int32), "add")
    in_prompt = _scatter_rows(jnp.zeros((R, V), jnp.int32), history, is_prompt.astype(jnp.int32), "add") > 0
    seen = in_prompt | (output_counts > 0)

    rp = md.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - md.frequency_penalty[:, None] * output_counts.astype(jnp.float32)
    return logits - md.presence_penalty[:, None] * (output_counts > 0).astype(jnp.float32)


def process_logits(logits: jax.Array, md: SamplingMetadata, use_penalties: bool) -> jax.Array:
    """Raw logits [R, V] -> the logits greedy rows take the argmax of: penalties, then banned ids."""
    logits = logits.astype(jnp.float32)
    if use_penalties:
        logits = apply_penalties(logits, md)
    return _scatter_rows(logits, md.banned_token_ids, -jnp.inf, "set")


def _top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Masks [R, V] logits to the top-k, then to the top-p nucleus of the renormalised rest.

    Both are applied as value thresholds in token-id order from one descending sort per row, so
    tokens tied with the last kept value are all kept (vLLM keeps top-k ties too).
    """
    V = logits.shape[-1]
    ordered = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)  # [R, V] descending
    k = jnp.where((top_k <= 0) | (top_k > V), V, top_k)
    kth_value = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)  # [R, 1]
    ordered = jnp.where(ordered >= kth_value, ordered, -jnp.inf)

    cumulative = jnp.cumsum(jax.nn.softmax(ordered, axis=-1), axis=-1)
    mass_before = jnp.pad(cumulative[:, :-1], ((0, 0), (1, 0)))  # exclusive, monotone
    # Keep the smallest prefix whose mass reaches top_p: token i stays while the mass before it is
    # < top_p. The first token always stays; top_p >= 1 keeps everything despite cumsum rounding.
    keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    num_kept = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    p_value = jnp.take_along_axis(ordered, (num_kept - 1)[:, None], axis=-1)
    threshold = jnp.maximum(kth_value, p_value)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def needs_sort(md: SamplingMetadata, vocab_size: int) -> bool:
    """Whether any random row of host metadata uses top-k or top-p (the sampler's sort over [R, V], its most
    expensive op; greedy rows take the argmax and ignore the filtered logits)."""
    uses = ((md.top_k > 0) & (md.top_k < vocab_size)) | (md.top_p < 1.0)
    return bool((uses & (md.temperature >= GREEDY_EPS)).any())


def filter_logits(logits: jax.Array, md: SamplingMetadata, sort: bool = True) -> jax.Array:
    """Temperature-scaled logits [R, V] -> [R, V] with min_p, then (`sort`) top_k and top_p applied (-inf =
    dropped). Without `sort` no row may use top-k or top-p (`needs_sort` False): the choice is made on the
    host, so the program holds no branch on device values (which XLA:GPU would decide from the host)."""
    probs = jax.nn.softmax(logits, axis=-1)
    max_prob = jnp.max(probs, axis=-1, keepdims=True)
    logits = jnp.where(probs < md.min_p[:, None] * max_prob, -jnp.inf, logits)
    return _top_k_top_p(logits, md.top_k, md.top_p) if sort else logits


def _mix32(x: jax.Array) -> jax.Array:
    """A 32-bit integer finaliser ("lowbias32", bias ~0.17 in avalanche tests): uint32 -> uint32."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(seeds: jax.Array, steps: jax.Array, vocab_size: int) -> jax.Array:
    """seeds [R, 2] u32, steps [R] i32 -> Gumbel(0, 1) noise [R, V], each row from its own key only.

    NOTE: a counter-based hash of (seed, step, token id) rather than jax.random's threefry: the
    same per-row independence and batch invariance, and it compiles in a fraction of threefry's time,
    which every sampler variant would pay (benchmarks/RESULTS.md).
    """
    key = _row_key(seeds, steps)
    token = jnp.arange(vocab_size, dtype=jnp.uint32)
    return -jnp.log(-jnp.log(_uniform(key[:, None], token[None, :])))


def _row_key(seeds: jax.Array, steps: jax.Array) -> jax.Array:
    return _mix32(seeds[:, 0] ^ _mix32(seeds[:, 1] ^ _mix32(steps.astype(jnp.uint32) + jnp.uint32(0x9E3779B9))))


def _uniform(key: jax.Array, counter: jax.Array) -> jax.Array:
    """Uniform(0, 1) floats, never 0 or 1, hashed from a row key and a counter (a token id)."""
    bits = _mix32(_mix32(key ^ (counter * jnp.uint32(0x9E3779B1))) + key)
    return ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))


def row_uniform(seeds: jax.Array, steps: jax.Array, stream: int) -> jax.Array:
    """seeds [R, 2] u32, steps [R] i32 -> one Uniform(0, 1) [R] per row from the sampling noise's key, at
    counter `stream` (pick one far above any vocabulary: a token id's noise would be correlated with it)."""
    return _uniform(_row_key(seeds, steps), jnp.uint32(stream))


def compute_logprobs(
    raw_logits: jax.Array, token_ids: jax.Array, num_logprobs: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Log-probabilities of the raw distribution: (sampled [R], rank [R], top ids [R, N], top [R, N]).

    rank = 1 + the number of tokens with a strictly greater logprob (1 = most likely).
    """
    logprobs = jax.nn.log_softmax(raw_logits.astype(jnp.float32), axis=-1)
    sampled = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)  # [R, 1]
    rank = 1 + jnp.sum(logprobs > sampled, axis=-1, dtype=jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, num_logprobs)
    return sampled[:, 0], rank, top_ids.astype(jnp.int32), top_logprobs


@functools.partial(jax.jit, static_argnames=("all_greedy", "use_penalties", "num_logprobs", "sort", "out_rows",
                                             "tokens_sharding"))
def sample(
    logits: jax.Array,
    md: SamplingMetadata,
    prev_accepted: jax.Array | None = None,
    *,
    all_greedy: bool,
    use_penalties: bool,
    num_logprobs: int,
    sort: bool = True,
    out_rows: int | None = None,
    tokens_sharding: jax.sharding.Sharding | None = None,
) -> SamplerOutput:
    """logits [R, V] -> SamplerOutput. all_greedy compiles only the argmax path (the caller must
    only set it when every row's temperature is < GREEDY_EPS); use_penalties compiles the penalty
    scatters; num_logprobs (0 = none) is the N of the top-N logprobs; `sort` False leaves out top-k /
    top-p (the caller must only clear it when `needs_sort` says no row uses them). out_rows pads the token ids
    to a fixed length, so the next step can read them from the device with one compiled shape, and
    `tokens_sharding` fixes their sharding (rows split over expert shards would otherwise leave them split).
    `prev_accepted` [M] (a speculating engine's: the previous step's kept guesses per sampling row, still on
    device; None: md.step_from is all -1) moves the noise step of the rows md.step_from names."""
    processed = process_logits(logits, md, use_penalties)
    token_ids = jnp.argmax(processed, axis=-1).astype(jnp.int32)
    if not all_greedy:
        greedy = md.temperature < GREEDY_EPS
        temperature = jnp.where(greedy, 1.0, md.temperature).astype(jnp.float32)
        filtered = filter_logits(processed / temperature[:, None], md, sort)
        steps = md.steps
        if prev_accepted is not None:
            steps = steps + jnp.where(md.step_from >= 0, prev_accepted[jnp.maximum(md.step_from, 0)], 0)
        noise = gumbel_noise(md.seeds, steps, logits.shape[-1])
        sampled = jnp.argmax(filtered + noise, axis=-1).astype(jnp.int32)
        token_ids = jnp.where(greedy, token_ids, sampled)
    logprobs = compute_logprobs(logits, token_ids, num_logprobs) if num_logprobs > 0 else None
    if out_rows is not None:
        token_ids = jnp.pad(token_ids, (0, out_rows - token_ids.shape[0]))
    if tokens_sharding is not None:
        token_ids = jax.lax.with_sharding_constraint(token_ids, tokens_sharding)
    return SamplerOutput(token_ids, logprobs)
