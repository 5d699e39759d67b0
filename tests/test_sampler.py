"""The sampler against hand-computed logits and sampling statistics, on a small vocabulary (CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner import sampler
from jaxserve.runner.sampler import empty_metadata, sample, seed_words

V = 32
NUM_SAMPLES = 8192  # rows of the statistical tests: one row per independent sample, one compile


def make_md(num_rows: int, num_banned: int = 4, history_len: int = 8, **columns) -> sampler.SamplingMetadata:
    """Padding metadata with some columns replaced (a scalar broadcasts to every row)."""
    md = empty_metadata(num_rows, num_banned, history_len)._asdict()
    for name, value in columns.items():
        md[name] = np.broadcast_to(np.asarray(value, md[name].dtype), md[name].shape).copy()
    return sampler.SamplingMetadata(**md)


def many_seeds(num_rows: int, base: int = 0) -> np.ndarray:
    return np.array([seed_words(base + 7919 * i + (i << 40)) for i in range(num_rows)], np.uint32)


def run(logits, md, *, use_penalties=False, num_logprobs=0, all_greedy=False):
    return sample(jnp.asarray(logits, jnp.float32), md, all_greedy=all_greedy,
                  use_penalties=use_penalties, num_logprobs=num_logprobs)


def chi_square(tokens: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """(statistic, critical value at p = 0.001) over the support of `probs`."""
    counts = np.bincount(tokens, minlength=len(probs))
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token outside the support"
    expected = probs[support] * len(tokens)
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    df = support.sum() - 1
    z = 3.09  # Wilson-Hilferty approximation of the chi-square quantile
    return stat, df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).normal(size=(8, V)).astype(np.float32)
    md = make_md(8)
    for all_greedy in (True, False):
        out = run(logits, md, all_greedy=all_greedy)
        np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))
        assert out.logprobs is None


def test_banned_ids_never_chosen():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(4, V)).astype(np.float32)
    ranked = np.argsort(-logits, axis=-1)
    banned = ranked[:, :3].astype(np.int32)  # the three most likely tokens
    even = np.arange(4) % 2 == 0
    banned[even, -1] = -1  # even rows ban only two; the -1 padding bans nothing
    out = run(logits, make_md(4, num_banned=3, banned_token_ids=banned))
    np.testing.assert_array_equal(out.token_ids, np.where(even, ranked[:, 2], ranked[:, 3]))

    R = NUM_SAMPLES
    row = np.zeros(V, np.float32)
    row[:4] = 3.0  # banned tokens are by far the likeliest
    md = make_md(R, num_banned=4, temperature=1.0, seeds=many_seeds(R), banned_token_ids=[0, 1, 2, -1])
    tokens = np.asarray(run(np.tile(row, (R, 1)), md).token_ids)
    assert not np.isin(tokens, [0, 1, 2]).any()
    assert (tokens == 3).any() and len(np.unique(tokens)) > 20


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies_match_softmax(temperature):
    R = NUM_SAMPLES
    row = np.random.default_rng(2).normal(scale=1.5, size=V).astype(np.float32)
    md = make_md(R, temperature=temperature, seeds=many_seeds(R, base=3), steps=np.arange(R) % 97)
    tokens = np.asarray(run(np.tile(row, (R, 1)), md).token_ids)
    stat, critical = chi_square(tokens, softmax(row.astype(np.float64) / temperature))
    assert stat < critical
    # The test has power: the same samples reject the distribution at the wrong temperature.
    wrong, _ = chi_square(tokens, softmax(row.astype(np.float64) / (temperature * 1.5)))
    assert wrong > 3 * critical


def test_top_k_restricts_support_to_k_largest():
    R = NUM_SAMPLES
    row = np.random.default_rng(4).normal(size=V).astype(np.float32)
    md = make_md(R, temperature=1.0, top_k=3, seeds=many_seeds(R, base=5))
    tokens = np.asarray(run(np.tile(row, (R, 1)), md).token_ids)
    top3 = np.argsort(-row)[:3]
    probs = np.zeros(V)
    probs[top3] = softmax(row[top3].astype(np.float64))
    stat, critical = chi_square(tokens, probs)
    assert stat < critical
    assert set(np.unique(tokens)) == set(top3)


def test_top_p_restricts_support_to_nucleus():
    probs = np.full(V, 0.0)
    probs[[5, 9, 2, 30]] = [0.5, 0.25, 0.15, 0.1]  # the rest get no mass
    logits = np.log(np.where(probs > 0, probs, 1e-30)).astype(np.float32)
    R = NUM_SAMPLES
    # top_p 0.7 keeps {5, 9}: 0.5 < 0.7 <= 0.75. top_p 0.85 keeps {5, 9, 2}. top_p 0.3 keeps {5}.
    # The nucleus is taken after temperature: at T = 0.5 token 5 alone has 0.72 >= 0.7.
    for temperature, top_p, nucleus in ((1.0, 0.7, [5, 9]), (1.0, 0.85, [5, 9, 2]), (1.0, 0.3, [5]), (0.5, 0.7, [5])):
        md = make_md(R, temperature=temperature, top_p=top_p, seeds=many_seeds(R, base=6))
        tokens = np.asarray(run(np.tile(logits, (R, 1)), md).token_ids)
        expected = np.zeros(V)
        expected[nucleus] = softmax(np.log(probs[nucleus]) / temperature)
        assert set(np.unique(tokens)) == set(nucleus)
        if len(nucleus) > 1:
            stat, critical = chi_square(tokens, expected)
            assert stat < critical


def test_filter_logits_masks():
    """min_p, then top_k, then top_p over the renormalised remainder, checked on exact masks."""
    logits = np.log(np.array([[0.4, 0.3, 0.2, 0.06, 0.04]] * 6, np.float32))
    md = make_md(6, temperature=1.0, min_p=[0.0, 0.2, 0.0, 0.6, 0.0, 0.0], top_k=[0, 0, 2, 0, 2, -1],
                 top_p=[0.65, 1.0, 1.0, 0.5, 0.55, 1.0])
    kept = np.isfinite(np.asarray(sampler.filter_logits(jnp.asarray(logits), md)))
    np.testing.assert_array_equal(kept, [
        [1, 1, 0, 0, 0],  # top_p 0.65: 0.4 < 0.65 <= 0.7
        [1, 1, 1, 0, 0],  # min_p 0.2: drop prob < 0.08
        [1, 1, 0, 0, 0],  # top_k 2
        [1, 0, 0, 0, 0],  # min_p 0.6 leaves {.4, .3} = {.57, .43}: top_p 0.5 keeps one (two without min_p)
        [1, 0, 0, 0, 0],  # top_k 2 leaves {.57, .43}: top_p 0.55 keeps one (two without top_k)
        [1, 1, 1, 1, 1],  # everything off
    ])


def test_the_sort_is_left_out_only_where_no_random_row_needs_it():
    """needs_sort (decided on the host): a random row with top_k in [1, V) or top_p < 1 needs the sort; greedy
    rows and top_k <= 0 or >= V do not. Without the sort, rows that need none sample the same tokens."""
    assert not sampler.needs_sort(make_md(3, temperature=[0.0, 0.7, 1.0], top_k=[2, 0, V], top_p=[0.5, 1, 1]), V)
    assert sampler.needs_sort(make_md(2, temperature=[0.0, 0.7], top_k=[0, 5]), V)
    assert sampler.needs_sort(make_md(2, temperature=[0.0, 0.7], top_p=[1.0, 0.9]), V)
    rng = np.random.default_rng(11)
    logits = rng.normal(size=(64, V)).astype(np.float32) * 3
    md = make_md(64, temperature=np.where(np.arange(64) % 3 == 0, 0.0, 0.9), min_p=0.02, top_k=V,
                 seeds=many_seeds(64), steps=np.arange(64))
    assert not sampler.needs_sort(md, V)
    logits = jnp.asarray(logits)
    sorted_, unsorted = (sample(logits, md, all_greedy=False, use_penalties=False, num_logprobs=0, sort=sort)
                         for sort in (True, False))
    np.testing.assert_array_equal(np.asarray(sorted_.token_ids), np.asarray(unsorted.token_ids))


def test_min_p_sampling_support():
    R = NUM_SAMPLES
    probs = np.array([0.4, 0.3, 0.2, 0.06, 0.04] + [0.0] * (V - 5))
    logits = np.log(np.where(probs > 0, probs, 1e-30)).astype(np.float32)
    md = make_md(R, temperature=1.0, min_p=0.2, seeds=many_seeds(R, base=8))
    tokens = np.asarray(run(np.tile(logits, (R, 1)), md).token_ids)
    assert set(np.unique(tokens)) == {0, 1, 2}


def test_penalties_against_hand_computed_logits():
    logits = np.array([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0, 1.0, -2.0]] * 3, np.float32)
    history = np.array([
        [0, 1, 1, 2, 2, 2, -1, -1],  # prompt 0 1 | output 1 2 2 2
        [3, 4, 4, -1, -1, -1, -1, -1],  # prompt 3 | output 4 4
        [0, 1, 2, -1, -1, -1, -1, -1],  # neutral penalties
    ], np.int32)
    md = make_md(3, history_len=8, token_history=history, prompt_lens=[2, 1, 3],
                 repetition_penalty=[2.0, 1.5, 1.0], frequency_penalty=[0.1, 0.5, 0.0],
                 presence_penalty=[0.3, 0.0, 0.0], banned_token_ids=[[7, -1, -1, -1], [-1] * 4, [0, -1, -1, -1]])
    got = np.asarray(sampler.process_logits(jnp.asarray(logits), md, use_penalties=True))
    expected = logits.copy()
    # row 0: token 0 prompt only; 1 prompt + once in output; 2 three times in output; 7 banned.
    expected[0, 0] = 2.0 / 2
    expected[0, 1] = -1.0 * 2 - 0.1 * 1 - 0.3
    expected[0, 2] = 0.5 / 2 - 0.1 * 3 - 0.3
    expected[0, 7] = -np.inf
    # row 1: token 3 prompt only; 4 twice in output, no presence penalty.
    expected[1, 3] = -0.5 * 1.5
    expected[1, 4] = 3.0 / 1.5 - 0.5 * 2
    expected[2, 0] = -np.inf  # the neutral row is otherwise unchanged
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    without = np.asarray(sampler.process_logits(jnp.asarray(logits), md, use_penalties=False))
    np.testing.assert_array_equal(np.isinf(without), np.isinf(expected))
    assert run(logits, md, use_penalties=True).token_ids[1] == 0  # penalised 4 (3.0 -> 1.0) loses to 0 (2.0)
    assert run(logits, md, use_penalties=False).token_ids[1] == 4


def test_sampled_token_invariant_to_batch_position_and_size():
    rng = np.random.default_rng(9)
    row = rng.normal(scale=0.1, size=V).astype(np.float32)  # near-uniform: the token is mostly noise
    seed, step = seed_words(0xDEADBEEF_12345678), 17
    columns = dict(temperature=1.3, top_k=20, top_p=0.9, min_p=0.01)
    tokens = set()
    for num_rows, position in ((1, 0), (4, 3), (16, 5), (16, 11)):
        logits = rng.normal(size=(num_rows, V)).astype(np.float32)
        md = make_md(num_rows, temperature=rng.uniform(0.0, 2.0, num_rows), top_k=rng.integers(0, 8, num_rows),
                     seeds=many_seeds(num_rows, base=int(rng.integers(1000))), steps=rng.integers(0, 50, num_rows))
        logits[position] = row
        for name, value in columns.items():
            getattr(md, name)[position] = value
        md.seeds[position], md.steps[position] = seed, step
        tokens.add(int(run(logits, md).token_ids[position]))
    assert len(tokens) == 1


def test_noise_depends_on_seed_words_and_step():
    seeds = np.array([seed_words(1), seed_words(1), seed_words(1 + (1 << 32)), seed_words(2)], np.uint32)
    steps = np.array([0, 1, 0, 0], np.int32)
    noise = np.asarray(sampler.gumbel_noise(jnp.asarray(seeds), jnp.asarray(steps), V))
    for i in range(4):
        for j in range(i + 1, 4):
            assert not np.allclose(noise[i], noise[j])
    again = np.asarray(sampler.gumbel_noise(jnp.asarray(seeds[::-1]), jnp.asarray(steps[::-1]), V))
    np.testing.assert_array_equal(again, noise[::-1])
    # The same request over successive steps samples different tokens from a flat distribution.
    R = 64
    md = make_md(R, temperature=1.0, seeds=np.tile(np.array(seed_words(42), np.uint32), (R, 1)), steps=np.arange(R))
    assert len(np.unique(np.asarray(run(np.zeros((R, V)), md).token_ids))) > 20


def test_logprobs_come_from_raw_logits():
    rng = np.random.default_rng(10)
    logits = rng.normal(size=(6, V)).astype(np.float32)
    md = make_md(6, temperature=[0.0, 0.7, 1.0, 0.0, 2.0, 0.0], top_k=[0, 3, 0, 0, 5, 0],
                 repetition_penalty=1.8, token_history=np.tile(np.arange(8, dtype=np.int32), (6, 1)),
                 prompt_lens=4, seeds=many_seeds(6, base=11),
                 banned_token_ids=[int(logits[0].argmax()), -1, -1, -1])
    out = run(logits, md, use_penalties=True, num_logprobs=5)
    sampled_lp, rank, top_ids, top_lp = (np.asarray(x) for x in out.logprobs)
    reference = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    tokens = np.asarray(out.token_ids)
    np.testing.assert_allclose(sampled_lp, reference[np.arange(6), tokens], rtol=1e-6)
    np.testing.assert_array_equal(rank, 1 + (reference > reference[np.arange(6), tokens][:, None]).sum(-1))
    np.testing.assert_array_equal(top_ids, np.argsort(-reference, axis=-1)[:, :5])
    np.testing.assert_allclose(top_lp, np.sort(reference, axis=-1)[:, ::-1][:, :5], rtol=1e-6)
    assert rank[0] > 1  # row 0's raw argmax is banned, so the sample is not rank 1


def test_padding_rows_produce_no_nan():
    R = 8
    md = make_md(R, num_banned=4, history_len=6)
    md.temperature[0], md.top_p[0], md.top_k[0] = 1.0, 0.5, 4  # one real row among padding
    for all_greedy, use_penalties in ((True, True), (False, True), (False, False)):
        out = run(np.zeros((R, V)), md, all_greedy=all_greedy, use_penalties=use_penalties, num_logprobs=3)
        tokens = np.asarray(out.token_ids)
        assert ((tokens >= 0) & (tokens < V)).all()
        assert all(np.isfinite(np.asarray(x)).all() for x in out.logprobs)
        np.testing.assert_array_equal(tokens[1:], 0)


def test_steady_state_calls_do_not_retrace():
    md = make_md(4, history_len=8)
    run(np.zeros((4, V)), md, use_penalties=True, num_logprobs=2)
    with jax.no_tracing():
        md = make_md(4, history_len=8, temperature=[0.0, 1.0, 0.5, 2.0], top_p=0.9, seeds=many_seeds(4, base=1))
        jax.block_until_ready(run(np.ones((4, V)), md, use_penalties=True, num_logprobs=2))
