"""Packaging: the accelerator extras pin the core's jax, and the product packages import only the product."""

from __future__ import annotations

import ast
import re
import tomllib

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.cpu_test

PRODUCT_PACKAGES = ("jaxserve", "pallas_kernels", "sharding")


def _pin(requirement: str, name: str) -> str | None:
    """The exact version `requirement` pins for `name` (`jax==0.11.2` or `jax[cuda13]==0.11.2`), else None."""
    match = re.fullmatch(rf"{name}(\[[a-z0-9,-]+\])?==([0-9.]+)", requirement.replace(" ", ""))
    return match.group(2) if match else None


@pytest.fixture(scope="module")
def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_accelerator_extras_pin_the_core_jax(project):
    core = {_pin(r, "jax") for r in project["dependencies"]} - {None}
    assert len(core) == 1, project["dependencies"]
    (version,) = core
    assert f"jaxlib=={version}" in project["dependencies"]
    extras = project["optional-dependencies"]
    for extra, jax_extra in (("cuda", "cuda13"), ("cuda12", "cuda12"), ("tpu", "tpu")):
        (requirement,) = [r for r in extras[extra] if r.startswith("jax[")]
        assert requirement == f"jax[{jax_extra}]=={version}", (extra, requirement)
        assert _pin(requirement, "jax") == version


def test_training_is_an_extra(project):
    assert not any(r.startswith("optax") for r in project["dependencies"])
    assert any(r.startswith("optax") for r in project["optional-dependencies"]["train"])
    assert set(project["optional-dependencies"]) >= {"cuda", "tpu", "train", "test"}


def test_product_packages_import_only_the_product():
    """The engine's packages never reach into benchmarks/, tools/ or tests/, nor need the train extra."""
    outside = {"benchmarks", "tools", "tests", "optax", "scripts"}
    files = [path for package in PRODUCT_PACKAGES for path in (ROOT / package).rglob("*.py")]
    assert len(files) > 20
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            bad = [name for name in names if name.split(".")[0] in outside]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
