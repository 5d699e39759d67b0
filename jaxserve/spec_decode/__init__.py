"""Speculative decoding pieces: the n-gram (prompt lookup) proposer the scheduler calls."""
