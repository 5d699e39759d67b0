"""The host-side core (scheduler, KV cache manager, requests, outputs) loads without JAX (docs/ARCHITECTURE.md §1)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.cpu_test

HOST_MODULES = ["jaxserve.core.scheduler", "jaxserve.core.sharded_scheduler", "jaxserve.core.spec_schedule", "jaxserve.core.kv_cache_manager",
                "jaxserve.core.buckets", "jaxserve.core.eplb", "jaxserve.core.sched_types", "jaxserve.request", "jaxserve.outputs",
                "jaxserve.sampling_params", "jaxserve.tokenizer", "jaxserve.config", "jaxserve.config_speculative", "jaxserve.input_processor",
                "jaxserve.output_processor", "jaxserve.engine_client", "jaxserve.step_stats", "jaxserve.models.family",
                "jaxserve.core.block_pool", "jaxserve.core.preemption", "jaxserve.core.kv_tiers.tiers", "jaxserve.pd.step_log",
                "jaxserve.framing", "jaxserve.engine_wire", "jaxserve.engine_process", "jaxserve.pd.protocol"]


def test_host_modules_import_no_jax():
    code = (f"import sys; import {', '.join(HOST_MODULES)}; "
            "loaded = sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')); "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
