"""Shared fixtures: the HF reference checkpoints and the embedded model, loaded once per session."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

# The sharding tests run on 8 fake CPU devices. XLA reads this once, when JAX's CPU backend starts,
# so it is set here, before any test module imports JAX (a GPU or TPU backend ignores it).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# Compiling is most of the suite's time, and the programs it compiles are tiny: XLA:CPU generates their
# code at LLVM's lowest optimization level, which compiles in about half the time and runs them about as
# fast (the server processes the tests start inherit it).
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import jax
import numpy as np
import pytest

from tests import compile_groups

# The suite's own process compiles without JAX's persistent compilation cache: XLA:CPU's executable
# (de)serialization crashes the process now and then (a segfault while reading back a step program), and
# such a crash ends every test. The server processes the tests start keep theirs (runner.compilation_cache_dir).
jax.config.update("jax_enable_compilation_cache", False)


def _memory_mappings() -> int:
    """The process's memory mappings (lines of /proc/self/maps); 0 where there is no /proc."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


def _mapping_budget() -> int:
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        limit = 65530  # the kernel's default
    return int(limit * 0.6)


MAPPING_BUDGET = _mapping_budget()


def _forget_jit_dispatches() -> None:
    """Empties jit's dispatch caches (the C++ fast path from a call's argument types to its executable) and
    keeps the traced, lowered and compiled programs behind them: a later call of a jitted function dispatches
    through Python again, finding its program compiled, and under jax.no_tracing() that Python dispatch
    raises. (A JAX without this private cache: everything is released.)"""
    try:
        from jax._src.lib import _jax

        _jax.PjitFunctionCache.clear_all()
    except (ImportError, AttributeError):
        jax.clear_caches()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Each XLA:CPU executable keeps memory mappings of its code while JAX caches it. The whole suite in one
    process compiles enough programs to pass the kernel's limit on mappings (vm.max_map_count, 65530), and
    the compile that hits it segfaults. Programs stay cached across modules (later modules build engines of
    the same shapes and reuse them) until a module ends with the process past MAPPING_BUDGET mappings (60% of
    the limit: the headroom covers the next module's compiles); then every cached program is released.

    Each module starts with no jit dispatches cached, as in a process of its own: a test asserting that an
    engine compiles nothing after start-up (jax.no_tracing) sees the programs its engine prepared and those
    its module ran, never a dispatch another module's engine left behind."""
    _forget_jit_dispatches()
    yield
    if _memory_mappings() > MAPPING_BUDGET:
        jax.clear_caches()
        gc.collect()


@pytest.fixture
def no_jit_dispatches():
    """The test starts with no jit dispatches cached, not even its module's earlier tests' (a check that an
    engine compiles nothing after start-up, as strict as in a fresh process)."""
    _forget_jit_dispatches()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """After pytest's own reordering (which groups tests by session-scoped fixture parameters across files)."""
    compile_groups.order_items(items)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (make test) with the files grouped and ordered by tests/compile_groups.py."""
    if config.getvalue("dist") == "loadfile":
        return compile_groups.GroupScheduling(config, log)
    return None


ROOT = Path(__file__).resolve().parent.parent
HF_FIXTURES = ROOT / "tests" / "fixtures" / "hf"
HF_NAMES = sorted(p.name for p in HF_FIXTURES.iterdir() if (p / "config.json").exists())
# The mixture-of-experts fixtures: the parity tests run fewer variants of them (their attention, cache
# and scheduling paths are the dense fixtures').
HF_MOE_NAMES = [name for name in HF_NAMES
                if "num_experts_per_tok" in json.loads((HF_FIXTURES / name / "config.json").read_text())]
TINY_MODEL = ROOT / "jaxserve" / "assets" / "tiny-adder"


class HFFixture:
    def __init__(self, name: str):
        from jaxserve.models import loader

        self.name = name
        self.path = HF_FIXTURES / name
        self.model = loader.load_model(self.path, dtype="float32")
        ref = json.loads((self.path / "reference.json").read_text())
        self.prompts: list[list[int]] = ref["prompts"]
        self.generated: list[list[int]] = ref["generated"]
        with np.load(self.path / "logits.npz") as data:
            self.logits = [data[f"logits_{i}"] for i in range(len(self.prompts))]


_cache: dict[str, HFFixture] = {}


def _fixture(name: str) -> HFFixture:
    if name not in _cache:
        _cache[name] = HFFixture(name)
    return _cache[name]


@pytest.fixture(scope="session", params=HF_NAMES)
def hf_fixture(request) -> HFFixture:
    return _fixture(request.param)


@pytest.fixture(scope="session")
def hf_fixture_by_name():
    """name -> HFFixture (loaded once per session), for tests that pick fixtures per parameter row."""
    return _fixture


@pytest.fixture(scope="module")
def fast_cpu_compiles():
    """For a module of interpret-mode kernel tests (`pytest.mark.usefixtures`): those kernels are big XLA
    programs run once on tiny data, so on a CPU the module's compiles skip XLA's optimisations."""
    if jax.default_backend() != "cpu":
        yield
        return
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", previous)


@pytest.fixture(scope="session")
def tiny_model():
    from jaxserve.models import loader

    return loader.load_model(TINY_MODEL)
