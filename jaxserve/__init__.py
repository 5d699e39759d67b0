"""jaxserve: an LLM inference engine in JAX. Public API (vLLM-compatible names).

Imported lazily, so host-only modules (jaxserve.core, jaxserve.request, ...) load without JAX.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "jaxserve.llm",
    "SamplingParams": "jaxserve.sampling_params",
    "RequestOutput": "jaxserve.outputs",
    "CompletionOutput": "jaxserve.outputs",
    "EngineConfig": "jaxserve.config",
    "load_config": "jaxserve.config",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
