"""Speculative decoding pieces: the n-gram (prompt lookup) proposer and the lossless rejection sampler."""
