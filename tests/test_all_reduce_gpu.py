"""GPU tier (two or more GPUs): the peer-memory one-shot all-reduce (pallas_kernels/all_reduce) sums
exactly as XLA's psum, alone and as the tensor-parallel engine's all-reduce. Mosaic's interpreter does
not model peer memory, so there is no CPU tier for the kernel itself; tests/test_sharding.py checks
on the CPU which all-reduces of a step the kernel takes (HLO cross-lowered for CUDA)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxserve import LLM, SamplingParams
from jaxserve.config import ParallelConfig, load_config
from tests.conftest import HF_FIXTURES, ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu" or jax.device_count() < 2,
                                                  reason="needs two GPUs")]


@pytest.fixture(scope="module")
def two_gpus():
    from pallas_kernels.all_reduce import mosaic_gpu as ar

    devices = jax.devices()[:2]
    mesh = jax.make_mesh((2,), ("model",), devices=devices)
    workspace = ar.Workspace(devices)
    return mesh, workspace, workspace.table(mesh, "model")


def _reduce_fns(mesh, workspace, chain: int):
    from pallas_kernels.all_reduce import mosaic_gpu as ar

    def make(reduce):
        def fn(x, table):
            for _ in range(chain):
                x = reduce(x, table) * 0.5
            return x
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("model"), P("model")), out_specs=P("model"),
                                     check_vma=False))
    return (make(lambda x, t: ar.all_reduce(x, t, workspace.layout)),
            make(lambda x, t: jax.lax.psum(x, "model")))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", [(1, 4096), (8, 4096), (64, 8192)])
def test_kernel_matches_psum(two_gpus, dtype, shape):
    mesh, workspace, table = two_gpus
    # one call, then 65 in a row (a decode step's worth: both slot parities reused many times)
    for chain in (1, 65):
        kernel, psum = _reduce_fns(mesh, workspace, chain)
        x = np.random.default_rng(chain).standard_normal((2, *shape)).astype(np.float32)
        x = jax.device_put(jnp.asarray(x, dtype), NamedSharding(mesh, P("model")))
        got = np.asarray(kernel(x, table), np.float32)
        np.testing.assert_array_equal(got, np.asarray(psum(x, table), np.float32))
        np.testing.assert_array_equal(got[0], got[1])  # both devices hold the same sum


def test_kernel_rejects_what_it_cannot_take(two_gpus):
    from pallas_kernels.all_reduce import mosaic_gpu as ar

    _, workspace, _ = two_gpus
    handle = ar.OneShotAllReduce(workspace.layout)
    assert handle.fits(jnp.zeros((8, 4096), jnp.bfloat16))
    assert not handle.fits(jnp.zeros((3, 1000), jnp.bfloat16))  # not whole chunks
    assert not handle.fits(jnp.zeros((4096, 4096), jnp.bfloat16))  # larger than the workspace: psum
    assert not handle.fits(jnp.zeros((8, 4096), jnp.int32))
    with pytest.raises(ValueError, match="multiple of"):
        ar.all_reduce(jnp.zeros((3, 1000), jnp.bfloat16), jnp.zeros((6,), jnp.int32), workspace.layout)


def _generate(config, prompts, params):
    llm = LLM(config=config, progress=False)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm.engine.runner


def test_engine_one_shot_matches_xla_on_hf_fixture():
    # float32 fixture with hidden 64: decode steps padded to 64 tokens are whole 4096-element chunks.
    name = "llama3_gqa4_tied"
    ref = json.loads((HF_FIXTURES / name / "reference.json").read_text())
    prompts = [{"prompt_token_ids": p} for p in ref["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = load_config(None, model=str(HF_FIXTURES / name), dtype="float32", skip_tokenizer_init=True,
                       max_model_len=128, block_size=16, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=4,
                       token_buckets=[64], request_buckets=[4], precompile=False)
    tokens = {}
    for mode in ("xla", "one_shot"):
        config = dataclasses.replace(base, parallel=ParallelConfig(model=2, all_reduce=mode))
        tokens[mode], runner = _generate(config, prompts, params)
        assert (runner.comm is not None) == (mode == "one_shot")
    assert tokens["one_shot"] == tokens["xla"]


def test_engine_one_shot_matches_one_gpu_on_embedded_model():
    prompts = [f"{a}+{b}=" for a in range(0, 1000, 37) for b in (0, 5, 99, 512)]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    base = load_config(ROOT / "configs" / "tiny.yaml", token_buckets=[32, 64, 256], precompile=False)
    texts = {}
    for model, mode in ((1, "auto"), (2, "auto")):
        llm = LLM(config=dataclasses.replace(base, parallel=ParallelConfig(model=model, all_reduce=mode)),
                  progress=False)
        assert (llm.engine.runner.comm is not None) == (model == 2)  # auto picks the kernel on two GPUs
        texts[model] = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    assert texts[2] == texts[1]
