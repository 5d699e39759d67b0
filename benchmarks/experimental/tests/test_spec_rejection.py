"""The rejection sampler: greedy semantics, exact equality with the plain sampler without drafts,
reproducibility, and chi-square tests that speculative sampling keeps the target distribution
(and that the same test rejects a deliberately broken acceptance or residual rule).

Each statistical test is one jitted call over NUM_SAMPLES rows: row = one independent sample
(its own seed), all rows sharing the same target logits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxserve.runner import sampler
from jaxserve.runner.sampler import empty_metadata, sample, seed_words
from benchmarks.experimental.spec_decode import rejection
from benchmarks.experimental.spec_decode.rejection import rejection_sample

V = 8
K = 2
NUM_SAMPLES = 20_000
TEMPERATURE = 1.5  # flattens p so every token has a useful expected count
CRITICAL = stats.chi2.ppf(1 - 1e-3, df=V - 1)  # p = 0.001; the support of every tested p is all of V


def make_md(num_rows: int, history_len: int = 6, **columns) -> sampler.SamplingMetadata:
    md = empty_metadata(num_rows, 2, history_len)._asdict()
    for name, value in columns.items():
        md[name] = np.broadcast_to(np.asarray(value, md[name].dtype), md[name].shape).copy()
    return sampler.SamplingMetadata(**md)


def many_seeds(num_rows: int, base: int = 0) -> np.ndarray:
    return np.array([seed_words(base + 7919 * i + (i << 40)) for i in range(num_rows)], np.uint32)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def chi_square(tokens: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=V)
    assert counts[probs == 0].sum() == 0, "sampled a token outside the support"
    support = probs > 0
    expected = probs[support] * len(tokens)
    return float(((counts[support] - expected) ** 2 / expected).sum())


@pytest.fixture(scope="module")
def case():
    """Target logits [K+1, V] shared by every row, a draft distribution q [K, V] far from p, and
    drafts sampled from q (per row) plus uniformly random point-mass drafts."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(K + 1, V)).astype(np.float32) * 1.5
    p = softmax(logits / TEMPERATURE)
    q = softmax(rng.normal(size=(K, V)) * 1.5).astype(np.float32)
    q_drafts = np.stack([rng.choice(V, size=NUM_SAMPLES, p=q[j] / q[j].sum()) for j in range(K)], 1)
    uniform_drafts = rng.integers(0, V, size=(NUM_SAMPLES, K))
    md = make_md(NUM_SAMPLES, temperature=TEMPERATURE, seeds=many_seeds(NUM_SAMPLES), steps=3)
    return dict(logits=np.broadcast_to(logits, (NUM_SAMPLES, K + 1, V)), p=p, q=q,
                q_drafts=q_drafts.astype(np.int32), uniform_drafts=uniform_drafts.astype(np.int32), md=md)


def run(logits, drafts, num_drafts, q, md, *, fn=None, all_greedy=False, use_penalties=False):
    fn = fn or functools.partial(rejection_sample, all_greedy=all_greedy, use_penalties=use_penalties)
    q = None if q is None else jnp.asarray(q, jnp.float32)
    out = fn(jnp.asarray(logits, jnp.float32), jnp.asarray(drafts, jnp.int32),
             jnp.asarray(num_drafts, jnp.int32), q, md)
    return np.asarray(out.token_ids), np.asarray(out.num_accepted)


def sample_case(case, point_mass: bool, fn=None):
    drafts = case["uniform_drafts"] if point_mass else case["q_drafts"]
    q = None if point_mass else np.broadcast_to(case["q"], (NUM_SAMPLES, K, V))
    return run(case["logits"], drafts, np.full(NUM_SAMPLES, K), q, case["md"], fn=fn), drafts


def broken(monkeypatch, name, replacement):
    """The rejection sampler traced afresh with one of its rules replaced."""
    monkeypatch.setattr(rejection, name, replacement)
    return jax.jit(functools.partial(rejection._rejection_sample, all_greedy=False, use_penalties=False))


@pytest.mark.parametrize("point_mass", [True, False], ids=["point_mass", "draft_probs"])
def test_first_and_second_token_follow_the_target_distribution(case, point_mass):
    (tokens, num_accepted), drafts = sample_case(case, point_mass)
    assert chi_square(tokens[:, 0], case["p"][0]) < CRITICAL
    # Given the first draft was accepted, the second token follows p at position 1.
    first_accepted = num_accepted >= 1
    assert first_accepted.sum() > 2000
    assert (tokens[first_accepted, 0] == drafts[first_accepted, 0]).all()
    assert chi_square(tokens[first_accepted, 1], case["p"][1]) < CRITICAL
    # The first draft is accepted with probability sum_x min(p(x), q(x)); a point-mass draft d
    # (here uniform over V) with probability p(d).
    p0 = case["p"][0]
    expected_rate = p0.mean() if point_mass else np.minimum(p0, case["q"][0]).sum()
    rate = first_accepted.mean()
    assert abs(rate - expected_rate) < 5 * np.sqrt(expected_rate * (1 - expected_rate) / NUM_SAMPLES)
    # Output layout: the accepted drafts, one more token, then -1.
    rows = np.arange(NUM_SAMPLES)
    assert (tokens[rows, num_accepted] >= 0).all()
    assert all((tokens[r, num_accepted[r] + 1:] == -1).all() for r in range(0, NUM_SAMPLES, 97))
    # All drafts accepted: the bonus at position K follows p at position K.
    all_accepted = num_accepted == K
    assert all_accepted.sum() > 250
    assert chi_square(tokens[all_accepted, K], case["p"][K]) < CRITICAL


def test_broken_rules_fail_the_same_test(case, monkeypatch):
    # Accepting every draft gives the draft distribution.
    always = broken(monkeypatch, "accept_drafts", lambda p, q, u: jnp.ones_like(u, bool))
    (tokens, _), _ = sample_case(case, point_mass=False, fn=always)
    assert chi_square(tokens[:, 0], case["p"][0]) > 10 * CRITICAL
    monkeypatch.undo()
    # Resampling a rejection from p instead of max(p - q, 0) over-weights where q > p.
    from_p = broken(monkeypatch, "residual_probs", lambda p, q, drafts: p)
    p0, q0 = case["p"][0], case["q"][0]
    wrong = np.minimum(p0, q0) + (1 - np.minimum(p0, q0).sum()) * p0
    assert NUM_SAMPLES * ((wrong - p0) ** 2 / p0).sum() > 5 * CRITICAL  # the case is sensitive enough
    (tokens, _), _ = sample_case(case, point_mass=False, fn=from_p)
    assert chi_square(tokens[:, 0], p0) > 5 * CRITICAL


def test_top_k_applies_to_the_target(case):
    """A point-mass draft outside the top-k is always rejected; outputs follow the filtered p."""
    logits = case["logits"][0, 0]
    kept = np.argsort(-logits)[:3]
    p = np.zeros(V)
    p[kept] = softmax(logits[kept] / TEMPERATURE)
    md = case["md"]._replace(top_k=np.full(NUM_SAMPLES, 3, np.int32))
    tokens, num_accepted = run(case["logits"], case["uniform_drafts"], np.full(NUM_SAMPLES, K), None, md)
    outside = ~np.isin(case["uniform_drafts"][:, 0], kept)
    assert (num_accepted[outside] == 0).all()
    counts = np.bincount(tokens[:, 0], minlength=V)
    assert counts[p == 0].sum() == 0
    expected = p[kept] * NUM_SAMPLES
    assert (((counts[kept] - expected) ** 2) / expected).sum() < stats.chi2.ppf(1 - 1e-3, df=2)


def test_seeds_reproduce_and_rows_are_batch_invariant(case):
    R = 64
    args = (case["logits"][:R], case["q_drafts"][:R], np.arange(R) % (K + 1),
            np.broadcast_to(case["q"], (R, K, V)))
    md = make_md(R, temperature=TEMPERATURE, seeds=many_seeds(R, base=5), steps=np.arange(R) % 7)
    first = run(*args, md)
    assert all(np.array_equal(a, b) for a, b in zip(first, run(*args, md)))
    perm = np.random.default_rng(2).permutation(R)
    md_perm = sampler.SamplingMetadata(*(np.asarray(x)[perm] for x in md))
    permuted = run(*(np.asarray(a)[perm] for a in args), md_perm)
    assert np.array_equal(permuted[0], first[0][perm]) and np.array_equal(permuted[1], first[1][perm])
    other_seeds = run(*args, md._replace(seeds=many_seeds(R, base=6)))
    assert not np.array_equal(other_seeds[0], first[0])


def test_no_drafts_equals_the_plain_sampler():
    """num_drafts = 0 rows give exactly sampler.sample's token, with every transform on."""
    R = 256
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(R, K + 1, V)).astype(np.float32) * 2
    history = rng.integers(-1, V, size=(R, 6)).astype(np.int32)
    md = make_md(R, temperature=np.where(np.arange(R) % 4 == 0, 0.0, 0.8), top_k=np.arange(R) % 6,
                 top_p=np.where(np.arange(R) % 3 == 0, 0.7, 1.0), min_p=0.05, repetition_penalty=1.3,
                 frequency_penalty=0.2, presence_penalty=0.1, seeds=many_seeds(R, base=9),
                 steps=np.arange(R) % 5, token_history=history, prompt_lens=3,
                 banned_token_ids=np.tile([[1, -1]], (R, 1)))
    drafts = rng.integers(0, V, size=(R, K))
    tokens, num_accepted = run(logits, drafts, np.zeros(R), None, md, use_penalties=True)
    plain = sample(jnp.asarray(logits[:, 0]), md, all_greedy=False, use_penalties=True, num_logprobs=0)
    assert np.array_equal(tokens[:, 0], np.asarray(plain.token_ids))
    assert (num_accepted == 0).all() and (tokens[:, 1:] == -1).all()
    assert (tokens[:, 0] != 1).all()  # the banned id


@pytest.mark.parametrize("all_greedy", [True, False])
def test_greedy_accepts_the_matching_prefix(all_greedy):
    argmax = np.array([[1, 2, 3], [1, 5, 6], [0, 4, 4], [7, 2, 3], [6, 6, 6], [2, 2, 2]])  # [R, K+1]
    R = len(argmax)
    logits = np.zeros((R, K + 1, V), np.float32)
    np.put_along_axis(logits, argmax[..., None], 4.0, axis=-1)
    drafts = np.array([[1, 2], [1, 2], [3, 4], [7, 2], [6, 6], [0, 0]])
    num_drafts = np.array([2, 2, 2, 1, 0, 2])
    # The last row samples (temperature 1) when the batch is not all greedy; the others are greedy.
    md = make_md(R, temperature=[0, 0, 0, 0, 0, 0 if all_greedy else 1], seeds=many_seeds(R))
    tokens, num_accepted = run(logits, drafts, num_drafts, None, md, all_greedy=all_greedy)
    assert tokens[:5].tolist() == [[1, 2, 3],     # all accepted + the bonus
                                   [1, 5, -1],    # the first mismatch is replaced by the argmax
                                   [0, -1, -1],   # rejected at once
                                   [7, 2, -1],    # one draft, accepted, then the bonus at position 1
                                   [6, -1, -1]]   # no drafts: the plain argmax
    assert num_accepted[:5].tolist() == [2, 1, 0, 1, 0]


def test_drafts_sampled_from_the_draft_distribution_keep_the_target_distribution(case):
    """A drafter with other logits, both under top_k: q from draft_distribution, drafts sampled
    from q in the drafter's noise stream; the first output token follows the filtered p."""
    rng = np.random.default_rng(4)
    top_k = 5
    draft_logits = np.broadcast_to(rng.normal(size=(K, V)).astype(np.float32) * 2, (NUM_SAMPLES, K, V))
    md = case["md"]._replace(top_k=np.full(NUM_SAMPLES, top_k, np.int32))
    unused = jnp.full((NUM_SAMPLES, K), -1, jnp.int32)  # no penalties: the drafts do not change q
    q = rejection.draft_distribution(jnp.asarray(draft_logits), unused, md, use_penalties=False)
    np.testing.assert_allclose(np.asarray(q).sum(-1), 1.0, rtol=1e-5)
    assert ((np.asarray(q) > 0).sum(-1) == top_k).all()
    steps = (jnp.asarray(md.steps)[:, None] + jnp.arange(K)[None, :]).reshape(-1)
    seeds = jnp.repeat(jnp.asarray(md.seeds), K, axis=0)
    target = case["logits"][0, 0]
    kept = np.argsort(-target)[:top_k]
    p = np.zeros(V)
    p[kept] = softmax(target[kept] / TEMPERATURE)
    critical = stats.chi2.ppf(1 - 1e-3, df=top_k - 1)

    def first_token_chi_square(stream):
        noise = sampler.gumbel_noise(seeds, rejection.salted_steps(steps, stream), V)
        drafts = jnp.argmax(jnp.log(q).reshape(-1, V) + noise, axis=-1).reshape(NUM_SAMPLES, K)
        tokens, num_accepted = run(case["logits"], drafts, np.full(NUM_SAMPLES, K), q, md)
        counts = np.bincount(tokens[:, 0], minlength=V)
        assert counts[p == 0].sum() == 0
        assert 0.1 < (num_accepted >= 1).mean() < 0.95  # both branches are exercised
        expected = p[kept] * NUM_SAMPLES
        return (((counts[kept] - expected) ** 2) / expected).sum()

    assert first_token_chi_square(rejection.DRAFT_STREAM) < critical
    # Drafts drawn with the residual sample's own noise correlate a rejected draft with its
    # replacement: the same test catches it.
    assert first_token_chi_square(rejection.RESIDUAL_STREAM) > 5 * critical


def test_draft_distribution_greedy_rows_are_one_hot():
    logits = np.random.default_rng(5).normal(size=(2, K, V)).astype(np.float32)
    md = make_md(2, temperature=[0.0, 0.7])
    q = np.asarray(rejection.draft_distribution(jnp.asarray(logits), jnp.full((2, K), -1, jnp.int32), md,
                                                use_penalties=False))
    np.testing.assert_array_equal(q[0], np.eye(V)[logits[0].argmax(-1)])
    np.testing.assert_allclose(q[1], softmax(logits[1] / 0.7), rtol=1e-5)


def test_penalties_see_the_earlier_drafts():
    """Position j's penalties count the drafts before j: a repeated draft loses its argmax."""
    logits = np.zeros((1, K + 1, V), np.float32)
    logits[0, :, 3] = 2.0
    logits[0, :, 5] = 1.5
    md = make_md(1, repetition_penalty=2.0)
    tokens, num_accepted = run(logits, [[3, 3]], [2], None, md, all_greedy=True, use_penalties=True)
    assert tokens.tolist() == [[3, 5, -1]] and num_accepted.tolist() == [1]
