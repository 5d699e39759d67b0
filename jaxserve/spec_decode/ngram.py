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
from numpy.lib.stride_tricks import sliding_window_view


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
    if L == 0:
        return np.full((B, k), -1, np.int32), np.zeros(B, np.int32)
    rows = np.arange(B)
    match_start = np.full(B, -1, np.int64)  # start i of the chosen occurrence, -1 = none yet
    match_n = np.zeros(B, np.int64)
    for n in range(max_n, min_n - 1, -1):
        if L < n + 1:
            continue
        pending = (match_start < 0) & (lengths >= n + 1)
        if not pending.any():
            continue
        # suffix [B, n]: the last n tokens of each row (clamped gather for rows too short to use).
        suffix_pos = np.clip(lengths[:, None] - n + np.arange(n)[None, :], 0, L - 1)
        suffix = tokens[rows[:, None], suffix_pos]
        windows = sliding_window_view(tokens, n, axis=1)  # [B, L - n + 1, n], a view (no copy)
        starts = np.arange(windows.shape[1])[None, :]
        hit = np.all(windows == suffix[:, None, :], axis=-1) & (starts < (lengths - n)[:, None])
        # the most recent hit: the last True along the start axis.
        last = windows.shape[1] - 1 - np.argmax(hit[:, ::-1], axis=1)
        found = pending & hit.any(axis=1)
        match_start = np.where(found, last, match_start)
        match_n = np.where(found, n, match_n)

    follow = match_start[:, None] + match_n[:, None] + np.arange(k)[None, :]  # [B, k]
    valid = (match_start[:, None] >= 0) & (follow < lengths[:, None])
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
