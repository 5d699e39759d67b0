"""The lossless rejection sampler for speculative decoding (random sampling), tested, not yet called by the engine."""
