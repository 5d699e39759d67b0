"""Mesh construction, logical-axis rules and shard_map helpers (arrive with the parallelism issue)."""
