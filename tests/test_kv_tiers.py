"""KV-cache tiers: the hash seed, the config of the host and disk tiers."""

from __future__ import annotations

import importlib.util

import pytest

from jaxserve.config import CacheConfig, EngineConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from tests.conftest import ROOT
from tests.test_kv_cache_manager import FakeRequest, start

pytestmark = pytest.mark.cpu_test


def _keys(manager: KVCacheManager, tokens: list[int], salt: str | None = None) -> list:
    request = FakeRequest("a", tokens, cache_salt=salt)
    start(manager, request)
    keys = list(manager._requests["a"].block_hashes)
    manager.free(request)
    return keys


def test_prefix_hash_seed_gives_every_manager_the_same_keys():
    tokens = list(range(9))
    same = [_keys(KVCacheManager(8, 2, hash_seed=7), tokens) for _ in range(2)]
    assert same[0] == same[1] and len(same[0]) == 4
    assert _keys(KVCacheManager(8, 2, hash_seed=8), tokens)[0] != same[0][0]
    assert _keys(KVCacheManager(8, 2), tokens)[0] != same[0][0]  # no seed: a random root
    assert _keys(KVCacheManager(8, 2), tokens)[0] != _keys(KVCacheManager(8, 2), tokens)[0]
    assert _keys(KVCacheManager(8, 2, hash_seed=7), tokens, salt="s")[0] != same[0][0]


def test_tier_options_are_checked():
    config = EngineConfig().with_overrides(prefix_hash_seed=3, kv_offloading_size=0.5, disk_kv_path="/x",
                                           disk_kv_gib=2)
    assert config.cache.host_kv_gib == 0.5 and config.cache.prefix_hash_seed == 3
    for kwargs, match in [(dict(prefix_hash="builtin", prefix_hash_seed=1), "need cache.prefix_hash: sha256"),
                          (dict(host_kv_gib=-1.0), "must be >= 0"),
                          (dict(disk_kv_path="/x"), "go together"),
                          (dict(disk_kv_gib=1.0), "go together"),
                          (dict(disk_kv_path="/x", disk_kv_gib=1.0), "needs a host tier"),
                          (dict(host_kv_gib=1.0, enable_prefix_caching=False), "enable_prefix_caching")]:
        with pytest.raises(ValueError, match=match):
            CacheConfig(**kwargs)


def test_the_benchmark_script_loads_and_sizes_a_block():
    """benchmarks/kv_tiers.py (run on the H200; `--smoke` runs it on the CPU in about a minute)."""
    spec = importlib.util.spec_from_file_location("kv_tiers_benchmark", ROOT / "benchmarks" / "kv_tiers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from jaxserve.config import load_config

    # the embedded model: 4 layers x K,V x 4 tokens x 2 kv heads x 32 x float32
    assert module.kv_block_bytes(load_config(ROOT / "configs" / "tiny.yaml")) == 8192
    llama = load_config(ROOT / "configs" / "llama3-8b-dummy.yaml")
    assert module.kv_block_bytes(llama) == 32 * 2 * 16 * 8 * 128 * 2  # 2 MiB
