"""Ragged paged attention over block tables. `reference` is the pure-jnp ground truth."""
