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
    """-> (mesh, {dtype name: (workspace, table)}): one workspace per dtype, as the runner makes one."""
    from pallas_kernels.all_reduce import mosaic_gpu as ar

    devices = jax.devices()[:2]
    mesh = jax.make_mesh((2,), ("model",), devices=devices)
    spaces = {}
    for dtype in ("bfloat16", "float32"):
        workspace = ar.Workspace(devices, dtype)
        spaces[dtype] = (workspace, workspace.table(mesh, "model"))
    return mesh, spaces


def _smap(mesh, fn, num_inputs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("model"),) * num_inputs, out_specs=P("model"),
                                 check_vma=False))


def _sharded(mesh, shape, dtype, seed):
    x = np.random.default_rng(seed).standard_normal((2, *shape)).astype(np.float32)
    return jax.device_put(jnp.asarray(x, dtype), NamedSharding(mesh, P("model")))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", [(1, 4096), (8, 4096), (64, 8192)])
def test_kernel_matches_psum(two_gpus, dtype, shape):
    from pallas_kernels.all_reduce import mosaic_gpu as ar

    mesh, spaces = two_gpus
    workspace, table = spaces[jnp.dtype(dtype).name]
    # one call, then 65 in a row (a decode step's worth: both slot parities reused many times)
    for chain in (1, 65):
        def make(reduce):
            def fn(x, t):
                for _ in range(chain):
                    x = reduce(x, t) * 0.5
                return x
            return _smap(mesh, fn, 2)
        kernel = make(lambda x, t: ar.all_reduce(x, t, workspace.layout))
        psum = make(lambda x, t: jax.lax.psum(x, "model"))
        x = _sharded(mesh, shape, dtype, chain)
        got = np.asarray(kernel(x, table), np.float32)
        np.testing.assert_array_equal(got, np.asarray(psum(x, table), np.float32))
        np.testing.assert_array_equal(got[0], got[1])  # both devices hold the same sum


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", [(1, 4096), (8, 4096), (3, 2048), (2, 8192)])  # 8192 bf16: 1024 threads
def test_fused_rms_norm_matches_unfused(two_gpus, dtype, shape):
    # x = residual + all_reduce(partial); h = rms_norm(x) * w, 33 times in a row with plain all-reduces
    # between (calls of both kernels share the workspace's regions), against psum + jnp: the residual
    # stream bit for bit, the normed output within the rounding of its own (f32 statistics) reduction.
    from jaxserve.models import layers
    from pallas_kernels.all_reduce import mosaic_gpu as ar

    mesh, spaces = two_gpus
    workspace, table = spaces[jnp.dtype(dtype).name]
    if shape[-1] * jnp.dtype(dtype).itemsize > 1024 * 16:
        pytest.skip("one CUDA block per row: rows up to 1024 16-byte vectors")
    eps = 1e-5

    def make(fused, plain):
        def fn(partial, residual, weight, t):
            weight = weight[0]
            hs = []
            for _ in range(33):
                h, residual = fused(partial, residual, weight, t)
                hs.append(h)
                partial = plain(residual * 0.25, t)  # exact scaling; feeds the next call
            return jnp.stack(hs)[None], residual[None]
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("model"),) * 4, out_specs=(P("model"),) * 2,
                                     check_vma=False))

    def unfused(partial, residual, weight, t):
        x = residual + jax.lax.psum(partial, "model")
        return layers.rms_norm(x, weight, eps), x

    kernel = make(lambda p, r, w, t: ar.all_reduce_rms_norm(p, r, w, eps, t, workspace.layout),
                  lambda x, t: ar.all_reduce(x, t, workspace.layout))
    reference = make(unfused, lambda x, t: jax.lax.psum(x, "model"))
    def same_on_both(shape, seed):  # a replicated tensor (the residual stream, a weight), one copy per device
        x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
        return jax.device_put(jnp.asarray(np.stack([x, x]), dtype), NamedSharding(mesh, P("model")))

    partial, residual, weight = _sharded(mesh, shape, dtype, 1), same_on_both(shape, 2), same_on_both(shape[-1:], 3)
    (h, x), (h_ref, x_ref) = kernel(partial, residual, weight, table), reference(partial, residual, weight, table)
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(x_ref, np.float32))
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(h_ref, np.float32), rtol=tol, atol=tol)
    h, x = np.asarray(h, np.float32), np.asarray(x, np.float32)
    np.testing.assert_array_equal(h[0], h[1])  # both devices hold the same results
    np.testing.assert_array_equal(x[0], x[1])


def test_kernel_rejects_what_it_cannot_take(two_gpus):
    from pallas_kernels.all_reduce import mosaic_gpu as ar

    _, spaces = two_gpus
    workspace, _ = spaces["bfloat16"]
    handle = ar.OneShotAllReduce.of(workspace)
    assert handle.fits(jnp.zeros((8, 4096), jnp.bfloat16))
    assert handle.fits_rms_norm(jnp.zeros((8, 4096), jnp.bfloat16))
    assert handle.fits(jnp.zeros((8, 128), jnp.bfloat16)) and not handle.fits_rms_norm(jnp.zeros((8, 128), jnp.bfloat16))
    assert not handle.fits(jnp.zeros((3, 1000), jnp.bfloat16))  # not whole chunks
    assert not handle.fits(jnp.zeros((4096, 4096), jnp.bfloat16))  # larger than the workspace: psum
    assert not handle.fits(jnp.zeros((8, 4096), jnp.float32))  # not the workspace's dtype
    assert not handle.fits(jnp.zeros((8, 4096), jnp.int32))
    with pytest.raises(ValueError, match="multiple of"):
        ar.all_reduce(jnp.zeros((3, 1000), jnp.bfloat16), jnp.zeros((6,), jnp.int32), workspace.layout)


def test_step_with_fused_kernels_matches_one_device():
    # A bf16 model 1024 wide: every all-reduce of a 2-token decode step is a kernel, the layers' fused
    # with the residual add and the next norm. Its logits match the one-device step's and the T=2 step
    # with XLA's all-reduce within bf16 rounding.
    import dataclasses as dc

    from jaxserve.models import llama
    from jaxserve.models.layers import ModelBatch
    from jaxserve.runner.device_setup import setup_all_reduce
    from sharding import TensorParallel, make_mesh

    cfg = llama.LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=2048, num_layers=2, num_heads=8,
                            num_kv_heads=2, head_dim=128, max_position_embeddings=64, dtype="bfloat16")
    params = llama.init_params(cfg, jax.random.key(0), std=0.05)
    batch = ModelBatch(*(np.asarray(a, np.int32) for a in ([3, 7], [0, 0], [0, 16], [0, 1, 2], [1, 1],
                                                           [[0], [1]], [0, 1])))
    one = llama.forward(params, cfg, batch, llama.init_kv_caches(cfg, 2, 16))[0]
    tp = TensorParallel(make_mesh(1, 2))
    place = llama.param_placer(tp)
    sharded = jax.tree_util.tree_map_with_path(
        lambda path, a: place(tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path), np.asarray(a)), params)
    kernel_tp, comm, _workspace = setup_all_reduce(tp, "one_shot", cfg.jnp_dtype)  # kept alive to the end
    assert kernel_tp.all_reduce.fits_rms_norm(jax.ShapeDtypeStruct((2, 1024), jnp.bfloat16))
    got = {}
    for name, t, c in (("kernel", kernel_tp, comm), ("xla", tp, None)):
        got[name] = np.asarray(llama.forward(sharded, cfg, batch, llama.init_kv_caches(cfg, 2, 16, tp=t), tp=t,
                                             comm=c)[0], np.float32)
    one = np.asarray(one, np.float32)
    scale = np.abs(one).max()
    for name in got:
        assert np.abs(got[name] - one).max() <= 0.03 * scale, (name, np.abs(got[name] - one).max(), scale)


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
