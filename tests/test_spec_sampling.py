"""Speculative verification with random sampling (runner/spec_verify.py): a guessed position is
sampled with the metadata of the output token it stands for and accepted while the sample equals the
guess, which is Leviathan's rejection rule for point-mass drafts.

Logits level (a Markov-chain 'model' over a small vocabulary, many seeds at once, the product's
sampler + layout + verify): requests without guesses get the plain sampler's token; a guess is
accepted with probability p(d) and a rejection follows p without d; sequences decoded with guesses
are the plain sampler's, seed for seed, and pass a chi-square test against the exact distribution at
a flattened temperature, which the same test fails for deliberately broken rules (accept every
guess; one noise step for every position of a request). Engine level (the embedded model): random
sampling with guesses, penalties and min_tokens gives the tokens and logprobs of decoding without
them, with guesses accepted, and compiles nothing after start-up.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxserve import SamplingParams
from jaxserve.runner import spec_verify
from jaxserve.runner.sampler import SamplingMetadata, empty_metadata, sample, seed_words
from tests.test_engine import assert_no_leaks, make_llm
from tests.test_engine_spec import PROMPTS, SPEC, token_ids

V = 8  # vocabulary of the logits-level model
K = 2  # guesses per request per step
M = 3  # output tokens per sequence
N = 20_000  # sequences (seeds) per statistical run
TEMPERATURE = 2.0  # flattens p so every kept token has a useful expected count
TOP_K = 6  # p has zeros: the filtered distribution is the one that must be kept
CONTEXT = 0  # every sequence starts after this token


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def chain():
    """table [V, V]: the logits of the next token given the last one; p [V, V] its engine
    distribution (temperature, top-k); greedy_next [V]: the argmax continuation."""
    table = np.random.default_rng(0).normal(size=(V, V)).astype(np.float32) * 1.5
    filtered = table / TEMPERATURE
    kth = np.sort(filtered, axis=-1)[:, -TOP_K][:, None]
    p = softmax(np.where(filtered >= kth, filtered, -np.inf))
    return dict(table=table, p=p, greedy_next=table.argmax(-1))


def seeds(n: int, base: int = 0) -> np.ndarray:
    return np.array([seed_words(base + 7919 * i + (i << 40)) for i in range(n)], np.uint32)


def metadata(num_rows: int, history_len: int = 1, **columns) -> SamplingMetadata:
    md = empty_metadata(num_rows, 2, history_len)._asdict()
    for name, value in columns.items():
        md[name] = np.broadcast_to(np.asarray(value, md[name].dtype), md[name].shape).copy()
    return SamplingMetadata(**md)


def random_md(num_rows: int, row_seeds: np.ndarray, steps: np.ndarray) -> SamplingMetadata:
    return metadata(num_rows, temperature=TEMPERATURE, top_k=TOP_K, seeds=row_seeds, steps=steps)


def sample_tokens(logits: np.ndarray, md: SamplingMetadata, use_penalties: bool = False,
                  out_rows: int | None = None) -> jax.Array:
    return sample(jnp.asarray(logits), md, all_greedy=False, use_penalties=use_penalties, num_logprobs=0,
                  out_rows=out_rows).token_ids


def always_accept(tokens, checks, first):
    """A broken verification: every guess is taken, then the token after the last one."""
    return spec_verify.verify(jnp.where(checks >= 0, checks, tokens), checks, first)


def decode(chain, row_seeds: np.ndarray, drafts_of=None, verify=spec_verify.verify, advance_steps=True):
    """M tokens per sequence, one sequence per seed. drafts_of(last tokens [S], step) -> guesses [S, K]
    (deterministic, from the tokens so far), or None: plain decoding, one token per step. -> tokens
    [S, M], guesses accepted. advance_steps=False: every position of a request samples with the step
    of its first one (a broken layout)."""
    S = len(row_seeds)
    out = [[] for _ in range(S)]
    last = np.full(S, CONTEXT)
    accepted = 0
    for step in range(M):
        num_out = np.array([len(tokens) for tokens in out])
        if drafts_of is None:
            tokens = np.asarray(sample_tokens(chain["table"][last], random_md(S, row_seeds, num_out)))
            for tokens_so_far, token in zip(out, tokens.tolist()):
                tokens_so_far.append(token)
            last = tokens
            continue
        drafts = drafts_of(last, step)
        guesses = spec_verify.layout_guesses(np.full(S, K), dict(enumerate(drafts.tolist())),
                                             np.arange(S) * (K + 1) + K, S * (K + 1))
        # Position j of a request scores the token after its last token, then after its guesses < j.
        before = np.concatenate([last[:, None], drafts[:, :K]], axis=1).reshape(-1)  # [S * (K + 1)]
        offsets = guesses.offsets if advance_steps else 0 * guesses.offsets
        md = random_md(len(before), row_seeds[guesses.row_of], num_out[guesses.row_of] + offsets)
        sampled = sample_tokens(chain["table"][before], md)
        token, num_accepted = (np.asarray(x)[:S] for x in verify(sampled, jnp.asarray(guesses.checks),
                                                                 jnp.asarray(guesses.first)))
        for r in range(S):
            out[r].extend(drafts[r, :num_accepted[r]].tolist() + [int(token[r])])
        accepted += int(num_accepted.sum())
        last = np.array([tokens[-1] for tokens in out])
    return np.array([tokens[:M] for tokens in out]), accepted


def proposer(chain):
    """Half the sequences guess the greedy continuation (often right), half fixed pseudo-random tokens."""
    noise = np.random.default_rng(1).integers(0, V, size=(N, M, K))

    def drafts_of(last: np.ndarray, step: int) -> np.ndarray:
        greedy = np.empty((len(last), K), np.int64)
        greedy[:, 0] = chain["greedy_next"][last]
        for j in range(1, K):
            greedy[:, j] = chain["greedy_next"][greedy[:, j - 1]]
        return np.where((np.arange(len(last)) % 2 == 0)[:, None], greedy, noise[: len(last), step])

    return drafts_of


def chi_square(observed: np.ndarray, expected_probs: np.ndarray, total: int) -> tuple[float, int]:
    """(statistic, degrees of freedom) over the cells with expected_probs > 0; inf when a count lies outside."""
    support = expected_probs > 0
    if observed[~support].any():
        return float("inf"), int(support.sum()) - 1
    expected = expected_probs[support] * total
    return float(((observed[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def chain_test(chain, tokens: np.ndarray) -> list[tuple[float, float]]:
    """(statistic, critical value at p = 0.001) of the joint (t0, t1) and of t2, against the chain."""
    p = chain["p"]
    joint = p[CONTEXT][:, None] * p  # P(t0, t1)
    third = joint.sum(0) @ p  # P(t2)
    results = []
    for observed, probs in ((np.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V), joint.reshape(-1)),
                            (np.bincount(tokens[:, 2], minlength=V), third)):
        statistic, dof = chi_square(observed, probs, len(tokens))
        results.append((statistic, stats.chi2.ppf(1 - 1e-3, dof)))
    return results


@pytest.fixture(scope="module")
def runs(chain):
    row_seeds = seeds(N)
    plain, _ = decode(chain, row_seeds)
    guessed, accepted = decode(chain, row_seeds, proposer(chain))
    return dict(seeds=row_seeds, plain=plain, guessed=guessed, accepted=accepted)


def test_guessing_gives_the_plain_tokens_seed_for_seed(runs):
    assert runs["accepted"] > N // 2  # many positions were decided by accepting a guess
    np.testing.assert_array_equal(runs["guessed"], runs["plain"])


def test_chi_square_with_and_without_guesses(chain, runs):
    for tokens in (runs["plain"], runs["guessed"]):
        for statistic, critical in chain_test(chain, tokens):
            assert statistic < critical


@pytest.mark.parametrize("broken", ["always_accept", "one_step_per_request"])
def test_chi_square_catches_a_broken_rule(chain, runs, broken):
    if broken == "always_accept":
        tokens, _ = decode(chain, runs["seeds"], proposer(chain), verify=always_accept)
    else:
        tokens, _ = decode(chain, runs["seeds"], proposer(chain), advance_steps=False)
    assert max(statistic / critical for statistic, critical in chain_test(chain, tokens)) > 3


def test_point_mass_guesses_are_accepted_with_their_probability(chain):
    """Guesses [d, e] for every request, over N seeds: d is accepted with probability p(d), e (after
    an accepted d) with p(e | d); a rejection's token is never the guess and follows p without it,
    renormalised; after both, the bonus token follows p after e."""
    p = chain["p"]
    d = int(np.argsort(-p[CONTEXT])[1])  # the second most likely token: neither rare nor near-certain
    e = int(chain["greedy_next"][d])
    guesses = spec_verify.layout_guesses(np.full(N, K), {i: [d, e] for i in range(N)},
                                         np.arange(N) * (K + 1) + K, N * (K + 1))
    md = random_md(N * (K + 1), seeds(N, base=3)[guesses.row_of], 5 + guesses.offsets)
    sampled = sample_tokens(chain["table"][np.tile([CONTEXT, d, e], N)], md)
    token, num_accepted = (np.asarray(x)[:N] for x in spec_verify.verify(
        sampled, jnp.asarray(guesses.checks), jnp.asarray(guesses.first)))
    for position, (before, guess) in enumerate([(CONTEXT, d), (d, e)]):
        reached = num_accepted >= position
        accepted = num_accepted[reached] > position
        rate = p[before, guess]
        assert abs(accepted.mean() - rate) < 5 * np.sqrt(rate * (1 - rate) / reached.sum())
        residual = np.where(np.arange(V) == guess, 0.0, p[before]) / (1 - rate)
        rejected = token[reached][~accepted]
        statistic, dof = chi_square(np.bincount(rejected, minlength=V), residual, len(rejected))
        assert statistic < stats.chi2.ppf(1 - 1e-3, dof)
    bonus = token[num_accepted == K]
    assert len(bonus) > 500
    statistic, dof = chi_square(np.bincount(bonus, minlength=V), p[e], len(bonus))
    assert statistic < stats.chi2.ppf(1 - 1e-3, dof)


def test_a_request_without_guesses_gets_the_plain_sampler_token():
    """A step mixing requests with and without guesses, every transform on (greedy and random rows,
    top-k / top-p / min-p, penalties over a history, banned ids, seeds): a request without guesses
    gets exactly the token sampler.sample gives it alone."""
    S = 64
    rng = np.random.default_rng(4)
    num_guesses = np.where(np.arange(S) % 3 == 0, 0, 1 + np.arange(S) % 3)
    drafts = {i: rng.integers(0, V, size=n).tolist() for i, n in enumerate(num_guesses) if n}
    last_token = np.cumsum(1 + num_guesses) - 1
    guesses = spec_verify.layout_guesses(num_guesses, drafts, last_token, 256)
    md = metadata(S, history_len=6, temperature=np.where(np.arange(S) % 4 == 0, 0.0, 0.8),
                  top_k=np.arange(S) % 6, top_p=np.where(np.arange(S) % 3 == 1, 0.7, 1.0), min_p=0.05,
                  repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1, seeds=seeds(S, base=9),
                  steps=np.arange(S) % 5, token_history=rng.integers(-1, V, size=(S, 6)), prompt_lens=3,
                  banned_token_ids=np.tile([[1, -1]], (S, 1)))
    L = len(guesses.row_of)
    logits = rng.normal(size=(L, V)).astype(np.float32) * 2
    rows = SamplingMetadata(*(np.asarray(column)[guesses.row_of] for column in md))
    rows = rows._replace(steps=(rows.steps + guesses.offsets).astype(np.int32))
    token, num_accepted = spec_verify.verify(sample_tokens(logits, rows, use_penalties=True, out_rows=256),
                                             jnp.asarray(guesses.checks), jnp.asarray(guesses.first))
    alone = np.flatnonzero(num_guesses == 0)
    # Those requests sampled alone, at the front of a batch of as many rows (the same executable).
    alone_rows = np.concatenate([alone, np.full(L - len(alone), alone[0])])
    plain = sample_tokens(logits[guesses.first[alone_rows]],
                          SamplingMetadata(*(np.asarray(column)[alone_rows] for column in md)),
                          use_penalties=True, out_rows=256)
    np.testing.assert_array_equal(np.asarray(token)[alone], np.asarray(plain)[:len(alone)])
    assert (np.asarray(num_accepted)[alone] == 0).all() and (np.asarray(token)[:S] != 1).all()


def test_greedy_rows_accept_the_matching_prefix():
    argmax = np.array([[1, 2, 3], [1, 5, 6], [0, 4, 4], [7, 2, 3]])  # per request, per position
    drafts = {0: [1, 2], 1: [1, 2], 2: [3, 4], 3: [7]}
    num_guesses = np.array([2, 2, 2, 1])
    guesses = spec_verify.layout_guesses(num_guesses, drafts, np.cumsum(1 + num_guesses) - 1, 16)
    logits = np.zeros((len(guesses.row_of), V), np.float32)
    logits[np.arange(len(guesses.row_of)), argmax[guesses.row_of, guesses.offsets]] = 4.0
    tokens = sample(jnp.asarray(logits), metadata(len(logits)), all_greedy=True, use_penalties=False,
                    num_logprobs=0, out_rows=16).token_ids
    token, num_accepted = spec_verify.verify(tokens, jnp.asarray(guesses.checks), jnp.asarray(guesses.first))
    # every guess + the bonus; the first mismatch's argmax; rejected at once; one guess + the bonus
    assert np.asarray(token)[:4].tolist() == [3, 5, 0, 2]
    assert np.asarray(num_accepted)[:4].tolist() == [2, 1, 0, 1]


# ---- the engine on the embedded model ----

HOT = 6.0  # the tiny adder is near-certain; a hot temperature makes its guesses' acceptance random
RANDOM = [SamplingParams(temperature=HOT, seed=i, max_tokens=16, ignore_eos=True, top_k=8 + i % 3,
                         logprobs=2 if i % 2 else None) for i in range(len(PROMPTS))]


def penalised(i: int) -> SamplingParams:
    """Rows whose guessed positions need their own history (frequency penalty: n-gram guesses repeat
    earlier tokens), their own min_tokens bans, and their own noise step."""
    if i % 3 == 0:
        return SamplingParams(temperature=4.0, seed=i, max_tokens=16, frequency_penalty=2.0, ignore_eos=True)
    if i % 3 == 1:
        return SamplingParams(temperature=0.0, max_tokens=12, min_tokens=8, repetition_penalty=1.2)
    return SamplingParams(temperature=HOT, seed=i, max_tokens=12, min_tokens=6, presence_penalty=0.5,
                          repetition_penalty=1.2, top_p=0.95)


PENALISED = [penalised(i) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def plain_outputs():
    # Both engines are test_engine_spec's (configs/tiny.yaml, the same n-gram proposer): a worker that ran
    # that module has their programs compiled.
    llm = make_llm(precompile=False)
    return [llm.generate(PROMPTS, params, use_tqdm=False) for params in (RANDOM, PENALISED)]


def test_engine_random_sampling_with_guesses_is_plain_decoding(plain_outputs, monkeypatch):
    """Precompiled, warmed up, then under jax.no_tracing(): the same tokens (and logprobs) as without
    guesses for seeded random rows, with penalties and min_tokens, and guesses accepted. Under overlap a
    random row right behind its verify step (still in flight) samples with its noise steps moved on device
    by the count that step keeps, as a device-guessed row (verifying the device n-gram's guesses) or, with
    logprobs, a deferred plain token: dispatching it waits for nothing unless the row has penalties or
    min_tokens."""
    llm = make_llm(speculative_config=SPEC)
    llm.generate(["1+1="], RANDOM[0], use_tqdm=False)
    scheduler, runner = llm.engine.scheduler, llm.engine.runner
    vocab_size = runner.cfg.vocab_size
    behind, waits = collections.Counter(), collections.Counter()  # per params: deferred rows in flight, waits
    dispatch = runner.dispatch

    def counting_dispatch(out):
        last = runner._last
        pending = last is not None and last.output is None
        behind[key] += pending and bool(out.deferred_decode)
        handle = dispatch(out)
        waits[key] += pending and last.output is not None  # collected while dispatching
        return handle

    monkeypatch.setattr(runner, "dispatch", counting_dispatch)
    with jax.no_tracing():
        for key, (params, plain) in enumerate(zip((RANDOM, PENALISED), plain_outputs)):
            before, device_guessed = scheduler.num_accepted_tokens, scheduler.num_device_guessed
            outputs = llm.generate(PROMPTS, params, use_tqdm=False)
            assert scheduler.num_accepted_tokens > before
            # (the random rows without logprobs; penalties and min_tokens keep every PENALISED row out)
            assert (scheduler.num_device_guessed > device_guessed) == (params is RANDOM)
            assert token_ids(outputs) == token_ids(plain)
            assert all(0 <= t < vocab_size for t in sum(token_ids(outputs), []))
            if params is RANDOM:
                random_outputs = outputs
    assert behind[0] > 0 and waits[0] == 0, (behind, waits)
    assert waits[1] > 0  # (penalties and min_tokens read the kept count on the host)
    assert_no_leaks(llm)
    for ours, theirs in zip(random_outputs[1::2], plain_outputs[0][1::2]):  # (those asking logprobs)
        ours, theirs = ours.outputs[0], theirs.outputs[0]
        assert len(ours.logprobs) == len(ours.token_ids)
        for entry, expected in zip(ours.logprobs, theirs.logprobs):
            assert list(entry) == list(expected)  # the token, then the top 2, in order
            assert [e.logprob for e in entry.values()] == pytest.approx([e.logprob for e in expected.values()],
                                                                        abs=1e-4)
