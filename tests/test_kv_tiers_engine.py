"""KV cache tiers in the engine, on the embedded model: a device pool too small for the working set,
blocks written back to the host tier and to disk and loaded again, outputs identical to an engine with an
unconstrained pool; two engines sharing a disk directory reuse each other's blocks."""

from __future__ import annotations

import jax
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import load_config
from tests.conftest import ROOT

pytestmark = pytest.mark.cpu_test

TINY_CONFIG = ROOT / "configs" / "tiny.yaml"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
BLOCK_GIB = 8192 / (1 << 30)  # one block of the embedded model: 4 layers x K,V x 4 slots x 2 heads x 32 x f32
# Prompts of two or three full blocks, several sharing openings; each round evicts the last one's blocks.
PROMPTS = [f"{a}+{b}=" for a, b in [(12345, 678), (12345, 999), (4321, 87654), (99, 12), (5555, 4444),
                                    (12345, 678), (31415, 9265), (271, 82818), (4321, 87654)]]
# The tiered engines: a device pool of one max-length request, and one step shape (the rounds send one
# prompt at a time), so that precompiling them is quick and they all share its programs.
TIERED = dict(num_blocks=9, max_num_seqs=4, max_num_batched_tokens=16, token_buckets=[16], request_buckets=[4])


def make_llm(**overrides) -> LLM:
    return LLM(config=load_config(TINY_CONFIG), progress=False, **overrides)


def texts(outputs) -> list[str]:
    return [out.outputs[0].text for out in outputs]


@pytest.fixture(scope="module")
def reference() -> list[str]:
    llm = make_llm(precompile=False)  # (its own pool's shapes: only the few it runs compile)
    return texts(llm.generate(PROMPTS * 2, GREEDY, use_tqdm=False))


def run_rounds(llm: LLM) -> list[str]:
    """Each prompt alone, twice over: later requests find earlier prefixes evicted from the device."""
    return [text for prompt in PROMPTS * 2 for text in texts(llm.generate([prompt], GREEDY, use_tqdm=False))]


def test_host_tier_outputs_match_an_unconstrained_engine(reference):
    llm = make_llm(**TIERED, host_kv_gib=64 * BLOCK_GIB, prefix_hash_seed=1)
    assert texts(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)) == reference[:1]  # (compiles the sampler)
    with jax.no_tracing():  # the block moves were compiled at start-up with the steps
        assert run_rounds(llm) == reference
    stats = llm.engine.kv_cache.stats
    assert stats.host_hits > 0 and stats.host_bytes_in > 0 and stats.host_bytes_out > 0
    assert stats.hits >= stats.host_hits and stats.disk_hits == 0
    engine = llm.engine
    assert engine.kv_cache.num_free_blocks == engine.runner.num_blocks - 1
    engine.kv_transfer.tiers.host.check()


def test_a_load_budget_of_one_block_a_step_keeps_the_outputs(reference, monkeypatch):
    """With the host -> device loads held to one block a step, a returning prompt's host prefix loads over
    several steps while its request waits: the outputs are those of an unconstrained engine, no step
    carries more than one load, and some requests did wait for theirs."""
    from jaxserve.runner import kv_transfer

    monkeypatch.setattr(kv_transfer, "LOAD_BYTES_PER_STEP", int(BLOCK_GIB * (1 << 30)))
    llm = make_llm(**TIERED, host_kv_gib=64 * BLOCK_GIB, prefix_hash_seed=1)
    link = llm.engine.tier_link
    assert link.load_budget == 1
    loads, waits, take, loading = [], [], link.take, link.loading

    def counted_take():
        moves = take()
        loads.append(len(moves.load_block_ids))
        return moves

    def counted_loading(keys):
        waits.append(loading(keys))
        return waits[-1]

    monkeypatch.setattr(link, "take", counted_take)
    monkeypatch.setattr(link, "loading", counted_loading)
    assert run_rounds(llm) == reference
    assert loads and max(loads) == 1 and sum(waits) > 0
    assert llm.engine.kv_cache.stats.host_hits > 0
    llm.engine.kv_transfer.tiers.host.check()


def test_disk_tier_is_shared_between_engines_with_one_seed(reference, tmp_path):
    disk = dict(host_kv_gib=2 * BLOCK_GIB, disk_kv_path=str(tmp_path / "kv"), disk_kv_gib=0.01, prefix_hash_seed=7)
    first = make_llm(**TIERED, **disk)
    assert run_rounds(first) == reference
    tiers = first.engine.kv_transfer.tiers
    tiers.poll(wait=True)
    assert tiers.counters.disk_bytes_in > 0 and first.engine.kv_cache.stats.disk_hits > 0
    files = list((tmp_path / "kv").rglob("*.kv"))
    assert files and all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    # another engine (as another process would: its own host tier, the same seed) reads them
    second = make_llm(**TIERED, **disk)
    assert texts(second.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference[:len(PROMPTS)]
    assert second.engine.kv_cache.stats.disk_hits > 0


def test_pinned_host_tier_round_trips_blocks_through_host_and_disk(reference, tmp_path, monkeypatch):
    """The host tier's GPU path (each block its own pinned host array, copied inside the save and load
    programs) forced on the CPU: outputs as without tiers, hits from host and from disk, every host block
    (disk promotions too) in pinned memory, the block moves compiled at start-up."""
    from jaxserve.runner import kv_transfer

    monkeypatch.setattr(kv_transfer, "uses_pinned_host", lambda device: True)
    llm = make_llm(**TIERED, host_kv_gib=4 * BLOCK_GIB, disk_kv_path=str(tmp_path / "kv"), disk_kv_gib=0.01,
                   prefix_hash_seed=3)
    transfer = llm.engine.kv_transfer
    assert transfer.pinned is not None and transfer.pinned.memory_kind == "pinned_host"
    assert texts(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)) == reference[:1]
    with jax.no_tracing():
        assert run_rounds(llm) == reference
    stats = llm.engine.kv_cache.stats
    assert stats.host_hits > 0 and stats.disk_hits > 0 and stats.host_bytes_out > 0
    host = transfer.tiers.host
    blocks = host.blocks([host.lookup(key) for key in host.keys()])
    assert blocks and all(isinstance(b, jax.Array) and b.sharding.memory_kind == "pinned_host" for b in blocks)
    host.check()


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_gpu_pinned_host_tier_round_trips_blocks(reference, tmp_path, monkeypatch):
    """The same on a GPU, whose pinned host memory the moves' programs copy to and from (`-m gpu`)."""
    test_pinned_host_tier_round_trips_blocks_through_host_and_disk(reference, tmp_path, monkeypatch)


def test_a_host_tier_over_the_pinned_pool_keeps_numpy_blocks(monkeypatch, caplog):
    """XLA's pinned host pool has a cap (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB): a host tier that would not fit
    in it keeps pageable numpy blocks, and says so."""
    from jaxserve.runner import kv_transfer

    monkeypatch.setattr(kv_transfer, "uses_pinned_host", lambda device: True)
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "0")
    llm = make_llm(**TIERED, host_kv_gib=4 * BLOCK_GIB, precompile=False)
    assert llm.engine.kv_transfer.pinned is None and llm.engine.kv_transfer.tiers.host.place is None
    assert "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB" in caplog.text


def test_tiers_are_refused_where_they_cannot_work_yet():
    import dataclasses

    from jaxserve.runner.kv_transfer import refuse_unsupported

    config = load_config(TINY_CONFIG, host_kv_gib=0.01)
    parallel = dataclasses.replace(config.parallel, num_processes=2, coordinator_address="127.0.0.1:1")
    with pytest.raises(ValueError, match="KV cache tiers.*not supported yet with parallel.num_processes > 1"):
        refuse_unsupported(dataclasses.replace(config, parallel=parallel))


@pytest.mark.parametrize("layout", ["reference", "layout"])
def test_block_moves_round_trip_in_each_backend_layout(layout):
    """A gather of blocks to host then a scatter into other blocks copies them exactly, whichever axis of
    the backend's layout holds the blocks."""
    import numpy as np

    import importlib

    from jaxserve.runner.kv_transfer import _gather, _scatter

    # the reference's layout, and the Pallas kernels' (GPU and TPU), which put the blocks on another axis
    shape = importlib.import_module(f"pallas_kernels.paged_attention.{layout}").kv_cache_shape(6, 4, 2, 8)
    axis = shape.index(6)
    rng = np.random.default_rng(0)
    caches = [jax.numpy.asarray(rng.standard_normal(shape).astype(np.float32)) for _ in range(3)]
    blocks = np.asarray(_gather(caches, np.array([4, 1, 0]), axis=axis))
    assert blocks.shape == (3, 3, *[n for i, n in enumerate(shape) if i != axis])
    moved, _ = _scatter(caches, np.array([2, 5]), blocks[:2], axis=axis)
    for before, after in zip(caches, moved):
        before, after = np.moveaxis(np.asarray(before), axis, 0), np.moveaxis(np.asarray(after), axis, 0)
        assert np.array_equal(after[2], before[4]) and np.array_equal(after[5], before[1])
        assert np.array_equal(after[[0, 1, 3, 4]], before[[0, 1, 3, 4]])


def test_a_dropped_engine_is_collected_with_its_caches():
    """The tiers' and the step recorder's watcher threads hold their queues, not the engine: an engine
    dropped without close() frees its runner (caches, weights), and its threads end."""
    import gc
    import threading
    import weakref

    llm = make_llm(**TIERED, host_kv_gib=64 * BLOCK_GIB, prefix_hash_seed=1)
    llm.generate(["1+2="], use_tqdm=False)
    runner = weakref.ref(llm.engine.runner)
    watchers = {t for t in threading.enumerate() if t.name == "jaxserve-kv-loads"}
    del llm
    gc.collect()
    assert runner() is None
    for thread in watchers:
        thread.join(timeout=5)
    assert not any(t.name == "jaxserve-kv-loads" and t in watchers for t in threading.enumerate())
