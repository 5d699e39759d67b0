"""Model families are plugins: nothing outside jaxserve/models/ names the Llama module, and an architecture
registered at run time is served end to end (loader, runner, engine) through the registry."""

from __future__ import annotations

import ast
import dataclasses
import json
import shutil

import pytest

from tests.conftest import HF_FIXTURES, ROOT

ALIAS = "TestAliasForCausalLM"


def _imports_llama(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        if any(name == "jaxserve.models.llama" or name.startswith("jaxserve.models.llama.") for name in names):
            lines.append(node.lineno)
    return lines


@pytest.mark.cpu_test
def test_only_models_import_the_llama_module():
    """The engine, runner, loader, checkpoint code, LLM, server and bench reach models through the registry."""
    offenders = {}
    for path in sorted((ROOT / "jaxserve").rglob("*.py")):
        relative = path.relative_to(ROOT)
        if relative.parts[:2] == ("jaxserve", "models") and relative.name not in ("loader.py", "checkpoint.py"):
            continue
        lines = _imports_llama(ast.parse(path.read_text(), str(path)))
        if lines:
            offenders[str(relative)] = lines
    assert not offenders, f"import jaxserve.models.llama through jaxserve.models.registry instead: {offenders}"


@pytest.fixture
def alias_family():
    """A test-only family for ALIAS: the Llama family's functions, its forward counting its traces."""
    from jaxserve.models import registry

    llama_family = registry.family("LlamaForCausalLM")
    traces = []

    def config_from_hf(hf, dtype="auto", source="config.json", architecture=ALIAS):
        cfg = llama_family.config_from_hf(hf, dtype=dtype, source=source, architecture="LlamaForCausalLM")
        return dataclasses.replace(cfg, architecture=ALIAS)

    def forward(*args, **kwargs):
        traces.append(kwargs.get("decode_only"))
        return llama_family.forward(*args, **kwargs)

    family = dataclasses.replace(llama_family, name="test-alias", config_from_hf=config_from_hf, forward=forward)
    registry.register(ALIAS, family)
    try:
        yield traces
    finally:
        registry.unregister(ALIAS)


def test_registered_architecture_serves_like_llama(alias_family, tmp_path):
    from jaxserve import LLM, SamplingParams
    from jaxserve.models import registry

    source = HF_FIXTURES / "llama3_gqa4_tied"
    checkpoint = tmp_path / "alias"
    shutil.copytree(source, checkpoint)
    hf = json.loads((source / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(hf | {"architectures": [ALIAS]}))
    reference = json.loads((source / "reference.json").read_text())

    llm = LLM(model=checkpoint, dtype="float32", skip_tokenizer_init=True, max_model_len=96, block_size=4,
              num_blocks=96, max_num_batched_tokens=16, max_num_seqs=4, token_buckets=[16], request_buckets=[4],
              precompile=False, progress=False)
    assert llm.engine.model.config.architecture == ALIAS
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in reference["prompts"]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference["generated"]  # the Llama path's tokens
    assert alias_family, "the runner's step did not go through the registered family's forward"

    with pytest.raises(ValueError, match="already registered"):
        registry.register(ALIAS, registry.family("LlamaForCausalLM"))


def test_unknown_architecture_names_the_registered_ones(tmp_path):
    from jaxserve.models import loader
    from jaxserve.models.registry import UnsupportedModelError

    hf = json.loads((HF_FIXTURES / "llama3_gqa4_tied" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(hf | {"architectures": ["NopeForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        loader.load_config(tmp_path)
