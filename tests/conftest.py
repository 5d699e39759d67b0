"""Shared fixtures: the HF reference checkpoints and the embedded model, loaded once per session."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
HF_FIXTURES = ROOT / "tests" / "fixtures" / "hf"
HF_NAMES = sorted(p.name for p in HF_FIXTURES.iterdir() if (p / "config.json").exists())
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


@pytest.fixture(scope="session", params=HF_NAMES)
def hf_fixture(request) -> HFFixture:
    if request.param not in _cache:
        _cache[request.param] = HFFixture(request.param)
    return _cache[request.param]


@pytest.fixture(scope="session")
def tiny_model():
    from jaxserve.models import loader

    return loader.load_model(TINY_MODEL)
