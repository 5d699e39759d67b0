"""The n-gram proposer: hand cases, edge cases, and the batched version against a plain loop."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.spec_decode.ngram import propose, propose_batch


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """A direct loop over the definition: longest n first, the most recent earlier start."""
    L = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if L < n + 1:
            continue
        suffix = tokens[L - n:]
        for i in range(L - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


def test_longest_match_wins_over_a_more_recent_shorter_one():
    # suffix [7, 8, 9]: the 3-gram occurs at 0 (followed by 1, 2); the 1-gram [9] recurs at 5.
    tokens = [7, 8, 9, 1, 2, 9, 3, 7, 8, 9]
    assert propose(tokens, 2, 1, 3) == [1, 2]
    assert propose(tokens, 2, 1, 1) == [3, 7]  # only 1-grams: the most recent earlier 9 is at 5


def test_most_recent_occurrence_is_used():
    tokens = [5, 1, 2, 5, 3, 4, 5]
    assert propose(tokens, 2, 1, 2) == [3, 4]


def test_no_match_and_too_short():
    assert propose([1, 2, 3, 4], 3, 1, 3) == []
    assert propose([4], 3, 1, 3) == []
    assert propose([], 3, 1, 3) == []
    assert propose([1, 2, 1, 2], 3, 3, 3) == []  # a 2-gram matches but min_n = 3


def test_k_past_the_end_is_truncated():
    # suffix [1, 2] occurs at 2, followed by the suffix itself: only 2 tokens remain after it.
    assert propose([1, 2, 1, 2], 5, 2, 2) == [1, 2]
    # the match ends right before the suffix: a single follower.
    assert propose([3, 3], 4, 1, 1) == [3]


def test_match_at_the_end_and_overlapping_the_suffix():
    tokens = [9, 1, 1, 1, 1]
    assert propose(tokens, 3, 1, 3) == [1]  # 3-gram [1,1,1] at 1, followed by one token
    assert propose(tokens, 3, 2, 2) == [1]  # [1,1] most recently at 2 -> the last token only


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="k=0"):
        propose([1, 2], 0, 1, 2)
    with pytest.raises(ValueError, match="min_n=3, max_n=2"):
        propose([1, 2], 2, 3, 2)
    with pytest.raises(ValueError, match="lengths"):
        propose_batch(np.zeros((2, 4), np.int32), np.array([5, 1]), 2, 1, 2)


def test_batch_matches_the_loop_on_random_sequences():
    rng = np.random.default_rng(0)
    B, L, k, min_n, max_n = 300, 40, 4, 1, 4
    lengths = rng.integers(0, L + 1, size=B)
    tokens = rng.integers(0, 5, size=(B, L)).astype(np.int32)  # a small alphabet: many matches
    tokens[np.arange(L)[None, :] >= lengths[:, None]] = 77  # padding must be ignored
    drafts, num = propose_batch(tokens, lengths, k, min_n, max_n)
    assert drafts.shape == (B, k) and drafts.dtype == np.int32 and num.dtype == np.int32
    some = 0
    for b in range(B):
        expected = reference(tokens[b, :lengths[b]].tolist(), k, min_n, max_n)
        assert drafts[b, :num[b]].tolist() == expected, b
        assert (drafts[b, num[b]:] == -1).all()
        some += bool(expected)
    assert 0 < some < B  # both matched and unmatched rows were exercised


@pytest.mark.parametrize("k,min_n,max_n", [(4, 1, 4), (3, 2, 5), (1, 1, 1)])
def test_device_lookup_matches_the_host_one(k, min_n, max_n):
    """The device proposer (spec_decode/ngram_device.py) gives propose_batch's drafts row by row, padding
    past each row's length ignored, rows of length 0 and 1 included."""
    import jax.numpy as jnp

    from jaxserve.spec_decode import ngram_device
    rng = np.random.default_rng(k + min_n)
    B, L = 120, 33
    lengths = rng.integers(0, L + 1, size=B)
    tokens = rng.integers(0, 4, size=(B, L)).astype(np.int32)
    tokens[np.arange(L)[None, :] >= lengths[:, None]] = 77
    expected, num = propose_batch(tokens, lengths, k, min_n, max_n)
    got = ngram_device.propose(jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32), k=k, min_n=min_n, max_n=max_n)
    np.testing.assert_array_equal(np.asarray(got), expected)
    assert 0 < (num > 0).sum() < B


def test_propose_sequences_takes_ragged_lists():
    from jaxserve.spec_decode.ngram import propose_sequences

    sequences = [[1, 2, 3, 1, 2], [5], [], [7, 8, 7, 8, 7]]
    assert propose_sequences(sequences, 2, 1, 2) == [reference(s, 2, 1, 2) for s in sequences]
    assert propose_sequences([], 2, 1, 2) == []
