"""How `make test` (pytest-xdist, `--dist loadfile`) spreads the suite over its workers.

Most of the suite's time is compiling: engines of the same model, configuration and shapes compile the same
programs, and a worker keeps the programs it compiled (conftest._release_compiled_programs), so files
whose engines share shapes should run on one worker, one after the other. The workers also finish
together only if the heavy work is handed out first and the light files come last.

So the work units are GROUPS, in the order listed (heaviest first), each run whole on one worker in its
listed file order; then every file not listed, alone, in collection order (they take a few seconds
each). A worker takes the next unit when it is about to run out of work.

Adding a test module: one that builds engines goes into the group whose configuration it shares (the
embedded model on configs/tiny.yaml, the MoE fixtures over expert parallelism), a heavy one with nothing
to share gets a group of its own at its place in the order, anything else needs no entry.
"""

from __future__ import annotations

from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

# name -> test files (relative to tests/), heaviest group first.
GROUPS: dict[str, list[str]] = {
    # Engines on the embedded model with configs/tiny.yaml's shapes (tests/test_engine.py: make_llm), with
    # and without a speculative proposer (n-gram, its draft model, its EAGLE heads).
    "embedded-engines": [
        "test_engine.py", "test_engine_spec.py", "test_spec_sampling.py", "test_prompt_logprobs.py",
        "test_spec_bench.py", "test_kv_tiers_swap.py", "test_bench.py", "test_server_conformance.py",
        "test_server.py", "test_engine_process.py", "test_cli.py", "test_kv_tiers_metrics.py", "test_bench_serve.py",
        "test_spec_draft.py", "test_spec_eagle3.py", "test_kv_tiers_spec.py", "test_kv_tiers_engine.py",
    ],
    # The HF fixtures through the forward and the engine.
    "hf-parity": ["test_model_parity.py", "test_fp8_kv.py", "test_engine_parity.py", "test_flash_prefill.py"],
    "composition": ["test_composition.py"],
    # The MoE fixtures over expert-parallel meshes.
    "experts": ["test_expert_parallel_engine.py", "test_eplb_engine.py", "test_kv_tiers_ep.py",
                "test_expert_parallel.py", "test_moe.py"],
    "pd-router": ["test_pd_router.py"],
    "tensor-parallel": ["test_sharding.py", "test_data_parallel.py", "test_kv_tiers_dp.py", "test_server_dp.py"],
    "fp8-weights": ["test_fp8_weights.py", "test_fp8_gemm.py"],
    "attention-kernels": ["test_paged_attention_gpu.py", "test_paged_attention_tpu.py", "test_flash_attention.py"],
    "server-load": ["test_server_load.py"],
    "multihost": ["test_multihost.py"],
}

TESTS = Path(__file__).resolve().parent
_RANK = {name: (rank, place) for rank, names in enumerate(GROUPS.values()) for place, name in enumerate(names)}
_GROUP = {name: group for group, names in GROUPS.items() for name in names}


def _file(nodeid: str) -> str:
    """'tests/test_engine.py::test_x[a]' -> 'test_engine.py' (a file outside tests/: its path from the root)."""
    return nodeid.split("::", 1)[0].removeprefix("tests/")


def order_items(items: list) -> None:
    """Sorts collected items in place: the groups' files in GROUPS' order (groups, then files within each),
    then the rest in collection order; a file's tests keep their order and stay together (its module
    fixtures are built once)."""
    first = {}
    for index, item in enumerate(items):
        first.setdefault(_file(item.nodeid), index)
    unlisted = (len(GROUPS), 0)
    items.sort(key=lambda item: (*_RANK.get(_file(item.nodeid), unlisted), first[_file(item.nodeid)]))


class GroupScheduling(LoadScopeScheduling):
    """LoadScopeScheduling whose scope is a file's group (a file not in GROUPS: the file). Units are handed
    out in collection order, which order_items made GROUPS' order (not xdist's default order of most tests
    first, --loadscope-reorder, which this turns off)."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        config.option.loadscopereorder = False

    def _split_scope(self, nodeid: str) -> str:
        name = _file(nodeid)
        return f"group:{_GROUP[name]}" if name in _GROUP else name


def check_groups() -> list[str]:
    """GROUPS' files that are missing from tests/ or listed twice (tests/test_suite_setup.py)."""
    problems = [f"{name}: no such test file" for name in _RANK if not (TESTS / name).is_file()]
    listed = [name for names in GROUPS.values() for name in names]
    problems += [f"{name}: listed twice" for name in sorted({n for n in listed if listed.count(n) > 1})]
    return problems
