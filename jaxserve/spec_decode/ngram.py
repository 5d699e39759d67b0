"""N-gram prompt lookup: draft tokens copied from earlier in a request's own token sequence (host, numpy).

For a sequence t[0:L] and n in max_n, max_n - 1, ..., min_n (longest first), the suffix t[L-n:L]
is searched for at an earlier start i < L - n (an occurrence that is not the suffix itself; it
may overlap it). The most recent such occurrence (largest i) of the longest matching n wins, and
the proposal is the up to k tokens that followed it, t[i+n : min(i+n+k, L)]. Fewer than k are
proposed when the occurrence ends near the end of the sequence; none when no n in [min_n, max_n]
matches (or L <= min_n).

Dimension alphabet: B requests, L padded sequence length, k draft tokens.

`propose` handles one sequence; `propose_batch` does the same for a padded [B, L] batch with array
ops only (one pass per n, no per-token Python loop), and gives the same drafts row by row.
"""

from __future__ import annotations

import numpy as np


def _check_args(k: int, min_n: int, max_n: int) -> None:
    if k < 1:
        raise ValueError(f"k={k}: the number of draft tokens must be >= 1")
    if not 1 <= min_n <= max_n:
        raise ValueError(f"min_n={min_n}, max_n={max_n}: need 1 <= min_n <= max_n")


def propose(token_ids, k: int, min_n: int, max_n: int) -> list[int]:
    """token_ids [L] -> the draft tokens (at most k) for one sequence; [] when nothing matches."""
    _check_args(k, min_n, max_n)
    tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    drafts, num = propose_batch(tokens[None, :], np.array([tokens.size]), k, min_n, max_n)
    return drafts[0, : num[0]].tolist()


def propose_batch(
    token_ids: np.ndarray, lengths: np.ndarray, k: int, min_n: int, max_n: int
) -> tuple[np.ndarray, np.ndarray]:
    """token_ids [B, L] (entries at or past a row's length are ignored), lengths [B] ->
    (drafts [B, k] int32, -1 padded; num_drafts [B] int32 in 0..k)."""
    _check_args(k, min_n, max_n)
    tokens = np.asarray(token_ids)
    lengths = np.asarray(lengths, dtype=np.int64)
    if tokens.ndim != 2 or lengths.shape != (tokens.shape[0],):
        raise ValueError(f"token_ids {tokens.shape} and lengths {lengths.shape}: need [B, L] and [B]")
    if np.any(lengths < 0) or np.any(lengths > tokens.shape[1]):
        raise ValueError(f"lengths must lie in [0, {tokens.shape[1]}] (the padded length), got {lengths}")
    B, L = tokens.shape
    if L < 2:
        return np.full((B, k), -1, np.int32), np.zeros(B, np.int32)
    rows = np.arange(B)
    # An earlier occurrence of the suffix of length n ends at e <= length - 2 whatever n is, so one pass
    # per suffix offset j counts, for every end e, how many of the row's last tokens match ending there
    # (run[e], at most max_n). The longest usable n is the row's largest run, and its most recent
    # occurrence the largest e with that run.
    run = np.zeros((B, L - 1), np.int64)
    alive = np.arange(L - 1)[None, :] <= (lengths - 2)[:, None]
    for j in range(min(max_n, L - 1)):
        last = tokens[rows, np.maximum(lengths - 1 - j, 0)]
        equal = np.zeros((B, L - 1), bool)
        equal[:, j:] = tokens[:, : L - 1 - j] == last[:, None]
        alive &= equal
        run += alive
    best = run.max(axis=1)
    found = best >= min_n
    match_end = np.where(found, L - 2 - np.argmax((run == best[:, None])[:, ::-1], axis=1), -1)

    follow = match_end[:, None] + 1 + np.arange(k)[None, :]  # [B, k]
    valid = found[:, None] & (follow < lengths[:, None])
    drafts = np.where(valid, tokens[rows[:, None], np.clip(follow, 0, L - 1)], -1).astype(np.int32)
    return drafts, valid.sum(axis=1).astype(np.int32)


def propose_sequences(sequences, k: int, min_n: int, max_n: int) -> list[list[int]]:
    """Token lists of any lengths -> each one's drafts (at most k; [] when nothing matches): the
    scheduler's entry point, one propose_batch over the sequences padded to the longest."""
    lengths = np.fromiter((len(sequence) for sequence in sequences), np.int64, len(sequences))
    if not len(sequences):
        return []
    tokens = np.zeros((len(sequences), int(lengths.max())), np.int64)
    for row, sequence in enumerate(sequences):
        tokens[row, : len(sequence)] = sequence
    drafts, num = propose_batch(tokens, lengths, k, min_n, max_n)
    return [row[:count].tolist() for row, count in zip(drafts, num.tolist())]
