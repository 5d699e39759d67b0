"""The server knows an engine client, not an engine: its modules load (and parse their arguments) without
JAX, never reach into engine internals, and an installed wheel serves with no --config (the default config
and the embedded model are package data)."""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import ROOT

SERVER_MODULES = ["jaxserve.server.app", "jaxserve.server.bridge", "jaxserve.server.serving",
                  "jaxserve.server.metrics", "jaxserve.server.cli", "jaxserve.engine_client"]
# Engine internals the server must not touch (it sees engine_client.EngineClient only).
INTERNALS = {"scheduler", "kv_cache", "runner", "model", "replicas", "engines", "output_processor"}


@pytest.mark.cpu_test
def test_server_loads_and_parses_arguments_without_jax():
    code = (f"import sys; import {', '.join(SERVER_MODULES)}; "
            "from jaxserve.server.cli import _config_from_args; "
            "config, _ = _config_from_args(['--port', '0', '--max-num-seqs', '8']); "
            "assert config.scheduler.max_num_seqs == 8; "
            "loaded = sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')); "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.cpu_test
def test_server_reads_no_engine_internals():
    offenders = []
    for path in sorted((ROOT / "jaxserve" / "server").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            # engine.<internal> (or self.engine.<internal>)
            owner = node.value if isinstance(node, ast.Attribute) else None
            if (owner is not None and node.attr in INTERNALS
                    and getattr(owner, "attr", getattr(owner, "id", None)) == "engine"):
                offenders.append(f"{path.name}:{node.lineno} engine.{node.attr}")
            if isinstance(node, ast.ImportFrom) and node.module in ("jaxserve.engine", "jaxserve.data_parallel") \
                    and path.name != "cli.py":  # (cli builds the engine, importing it when it does)
                offenders.append(f"{path.name}:{node.lineno} imports {node.module}")
    assert not offenders, offenders


def test_wheel_ships_the_default_config_and_the_embedded_model(tmp_path):
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in ("jaxserve", "sharding", "pallas_kernels"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    # Without setuptools in this environment, pip builds in isolation with the index's setuptools.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", str(source),
                            "-w", str(tmp_path / "wheel")], cwd=tmp_path, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = (tmp_path / "wheel").glob("jaxserve-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(tmp_path / "site")
    assert "jaxserve/configs/tiny.yaml" in names
    for asset in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert f"jaxserve/assets/tiny-adder/{asset}" in names
    # From the installed layout alone (not the repository): the default config and the model it names.
    code = ("import pathlib; from jaxserve.server.cli import _config_from_args; "
            "from jaxserve.config import DEFAULT_CONFIG; "
            "config, _ = _config_from_args([]); "
            "assert DEFAULT_CONFIG.is_file() and str(DEFAULT_CONFIG).startswith(%r), DEFAULT_CONFIG; "
            "assert (pathlib.Path(config.model.path) / 'model.safetensors').is_file(), config.model.path; "
            "assert config.model.max_model_len == 32")
    subprocess.run([sys.executable, "-c", code % str(tmp_path / "site")], check=True, cwd=tmp_path,
                   env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"})
