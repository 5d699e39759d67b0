"""Tensor parallelism on 8 fake CPU devices: sharded == unsharded.

- sharding/: mesh, rules table, uneven axes (vocab / MLP padded, kv heads replicated), placement.
- the model step: T-sharded logits equal the single-device ones, also with a padded vocabulary and
  MLP; the compiled step has one all-reduce per block (+ the embedding's), gathers only logits,
  and donates the caches.
- the engine: greedy tokens at T = 2, 4, 8 equal T = 1's (the HF reference tokens, which the T = 1
  engine gives in test_engine_parity) on the HF fixtures, kv heads replicated where K < T, and on
  the embedded model; steady state compiles nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import ParallelConfig, load_config
from jaxserve.models import llama, loader
from jaxserve.models.layers import ModelBatch
from sharding import TENSOR_PARALLEL, AxisRules, TensorParallel, make_mesh, replica_meshes
from tests.conftest import HF_FIXTURES, ROOT

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def eight_devices():
    if jax.default_backend() != "cpu":
        pytest.skip("the sharding tests run on fake CPU devices")
    if jax.device_count() < 8:
        pytest.fail(f"{jax.device_count()} CPU devices: JAX started before XLA_FLAGS asked for 8; run this module "
                    "first or set XLA_FLAGS=--xla_force_host_platform_device_count=8")


def tp(model: int) -> TensorParallel:
    return TensorParallel(make_mesh(1, model))


# ---- sharding/ ----
def test_mesh_from_config_sizes():
    mesh = make_mesh(2, 4)
    assert mesh.axis_names == ("data", "model") and mesh.devices.shape == (2, 4)
    replicas = replica_meshes(mesh)
    assert [r.devices.shape for r in replicas] == [(1, 4), (1, 4)]
    assert not set(replicas[0].devices.flat) & set(replicas[1].devices.flat)
    with pytest.raises(ValueError, match="needs 16 devices but only 8"):
        make_mesh(4, 4)


def test_rules_table_maps_logical_axes():
    assert TENSOR_PARALLEL.spec(("embed", "heads", "head_dim")) == jax.sharding.PartitionSpec(None, "model", None)
    with pytest.raises(ValueError, match="only one axis"):
        TENSOR_PARALLEL.spec(("heads", "mlp"))
    with pytest.raises(KeyError, match="no sharding rule"):
        TENSOR_PARALLEL.spec(("no_such_axis",))
    with pytest.raises(ValueError, match="policy"):
        AxisRules(mapping=(("vocab", "model"),), uneven=(("vocab", "drop"),))


def test_uneven_axes_pad_replicate_or_refuse():
    t4 = tp(4)
    assert t4.global_size("vocab", 250) == 252 and t4.local_size("mlp", 100) == 25
    assert t4.global_size("kv_heads", 2) == 4 and t4.local_size("kv_heads", 2) == 1  # each kv head on 2 devices
    assert t4.local_size("kv_heads", 8) == 2 and t4.local_size("embed", 6) == 6
    with pytest.raises(ValueError, match=r"'heads' axis has 6 entries.*parallel.model must divide 6"):
        t4.global_size("heads", 6, "wq")
    with pytest.raises(ValueError, match="must divide or be a multiple of 3"):
        tp(2).global_size("kv_heads", 3)


def test_placement_gives_each_device_its_slice():
    t4 = tp(4)
    wk = np.arange(3 * 2 * 5, dtype=np.float32).reshape(3, 2, 5)  # [D, K=2, H]
    placed = t4.place(wk, ("embed", "kv_heads", "head_dim"))
    assert placed.shape == (3, 4, 5)
    devices = list(t4.mesh.devices.flat)
    for shard in placed.addressable_shards:  # device t holds kv head t // 2, and nothing else
        assert shard.data.shape == (3, 1, 5)
        np.testing.assert_array_equal(np.asarray(shard.data)[:, 0], wk[:, devices.index(shard.device) // 2])
    embed = t4.place(np.ones((10, 3), np.float32), ("vocab", "embed"))  # 10 rows -> 12, zero padded
    assert embed.shape == (12, 3) and float(jnp.sum(embed)) == 30.0
    assert t4.place(jnp.ones((3,)), ("embed",)).sharding.is_fully_replicated


# ---- the model step ----
STEP = jax.jit(llama.forward, static_argnames=("cfg", "attention_backend", "tp"), donate_argnames=("kv_caches",))


def small_batch(num_tokens=8):
    # two requests: a 5-token prompt (pages 1, 2) and a 3-token one (pages 3, 4), logits of their last rows
    ids = np.arange(3, 3 + num_tokens, dtype=np.int32) * 7 % 200
    return ModelBatch(ids, np.r_[0:5, 0:3].astype(np.int32), np.r_[4:9, 12:15].astype(np.int32),
                      np.array([0, 5, 8], np.int32), np.array([5, 3], np.int32),
                      np.array([[1, 2, 0, 0], [3, 4, 0, 0]], np.int32), np.array([4, 7], np.int32))


def place_params(params, cfg, t: TensorParallel):
    place = llama.param_placer(t)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    return jax.tree.unflatten(treedef, [place(tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path),
                                              np.asarray(leaf)) for path, leaf in flat])


@pytest.mark.parametrize("model", [2, 8])
def test_sharded_step_matches_unsharded_with_padded_vocab_and_mlp(model):
    # V=250 and F=100 divide by neither 8 nor (F) 8: both padded; 2 kv heads replicated at T=8.
    cfg = llama.LlamaConfig(vocab_size=250, hidden_size=32, intermediate_size=100, num_layers=2, num_heads=8,
                            num_kv_heads=2, head_dim=8, max_position_embeddings=64, dtype="float32", qkv_bias=True,
                            o_bias=True, mlp_bias=True)
    params = llama.init_params(cfg, jax.random.key(0), std=0.2)
    params = jax.tree.map(lambda x: x + 0.05 if x.ndim == 1 else x, params)  # nonzero biases
    batch = small_batch()
    expected, _ = STEP(params, cfg, batch, llama.init_kv_caches(cfg, 9, 4))
    t = tp(model)
    got, caches = STEP(place_params(params, cfg, t), cfg, batch, llama.init_kv_caches(cfg, 9, 4, tp=t), tp=t)
    assert got.shape == (2, 250)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5, rtol=2e-5)
    assert caches[0].sharding.spec[3] == "model"


@functools.cache
def sharded_hlo(name: str, model: int) -> tuple[str, llama.LlamaConfig, int]:
    t = tp(model)
    m = loader.load_model(HF_FIXTURES / name, dtype="float32", place=llama.param_placer(t))
    caches = llama.init_kv_caches(m.config, 9, 4, tp=t)
    hlo = STEP.lower(m.params, m.config, small_batch(), caches, tp=t).compile().as_text()
    return hlo, m.config, len(jax.tree.leaves(m.params))


@pytest.mark.parametrize("name,model", [("mistral_gqa4_untied", 4), ("qwen2_gqa4_tied", 8)])
def test_compiled_step_reduces_once_per_block_and_gathers_only_logits(name, model):
    hlo, cfg, num_params = sharded_hlo(name, model)
    collectives = re.findall(r"= (\w+)\[([\d,]*)\][^ ]* (all-reduce|all-gather|all-to-all|collective-permute|"
                             r"reduce-scatter)(?:-start)?\(", hlo)
    kinds = [kind for _, _, kind in collectives]
    assert kinds.count("all-reduce") == 2 * cfg.num_layers + 1, collectives  # o, down per layer; the embedding
    gathered = [tuple(int(d) for d in dims.split(",")) for _, dims, kind in collectives if kind == "all-gather"]
    assert gathered == [(2, cfg.vocab_size)], "only the logits may be gathered: no weight is all-gathered"
    assert set(kinds) <= {"all-reduce", "all-gather"}, "parameters must arrive in their shardings, never resharded"
    aliased = {int(p) for p in re.findall(r"\((\d+), \{\}, (?:may|must)-alias\)", hlo.splitlines()[0])}
    first_cache = num_params + len(ModelBatch._fields)
    assert aliased == set(range(first_cache, first_cache + cfg.num_layers)), "the caches must be donated"


@pytest.mark.parametrize("hidden", [64, 512])
def test_decode_sized_all_reduces_take_the_one_shot_kernel(hidden):
    # The GPU step of tp.all_reduce (the peer-memory kernels; they run in tests/test_all_reduce_gpu.py):
    # lowered for CUDA, a step whose [T, D] all-reduces are whole kernel chunks has no XLA all-reduce
    # left. The embedding's is the plain kernel; each layer's two are fused with the residual add and
    # the next norm when a row is whole chunks (float32: 512 elements), else plain. A larger step keeps
    # XLA's. The logits' all-gather is a kernel sum into zeros while it fits. Lowering needs no GPU;
    # the kernels' state is made on CPU devices.
    from pallas_kernels.all_reduce.mosaic_gpu import OneShotAllReduce, Workspace

    base = tp(2)
    workspace = Workspace(list(base.mesh.devices.flat), "float32", max_elems=8 * 512)
    t = dataclasses.replace(base, all_reduce=OneShotAllReduce.of(workspace))
    m = loader.load_model(HF_FIXTURES / "llama3_gqa4_tied", dtype="float32", place=llama.param_placer(t))
    cfg, params = m.config, m.params
    if hidden != cfg.hidden_size:  # the fixture, wider: random weights of the new shapes
        cfg = dataclasses.replace(cfg, hidden_size=hidden)
        place = llama.param_placer(t)
        params = jax.tree_util.tree_map_with_path(
            lambda path, a: place(tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path), np.asarray(a)),
            llama.init_params(cfg, jax.random.key(0)))
    caches = llama.init_kv_caches(cfg, 9, 4, tp=t)
    comm = workspace.table(t.mesh, "model")
    counts = {}
    for tokens in (512 // hidden, 16 * 512 // hidden):  # fits; too large
        batch = ModelBatch(*(np.zeros(n, np.int32) for n in (tokens, tokens, tokens, 3, 2)),
                           np.zeros((2, 4), np.int32), np.zeros(2, np.int32))
        text = STEP.trace(params, cfg, batch, caches, tp=t, comm=comm).lower(lowering_platforms=("cuda",)).as_text()
        # each kernel is one private function holding the custom call; count the calls to each
        calls = {}
        for name, body in re.findall(r"func\.func private @(\w+)\([^\n]*\n([^\n]*custom_call @mosaic_gpu_v2[^\n]*)",
                                     text):
            kind = "fused" if "rms_norm" in body else "plain"
            calls[kind] = calls.get(kind, 0) + len(re.findall(rf"call @{name}\(", text))
        counts[tokens] = (text.count('"stablehlo.all_reduce"'), calls)
        assert '"stablehlo.all_gather"' not in text
    small, large = sorted(counts)
    blocks = 2 * cfg.num_layers  # o and down per layer
    # the logits' gather (2 rows) is a kernel sum into zeros in both: no all-gather is left
    assert counts[small] == (0, {"plain": 2, "fused": blocks} if hidden == 512 else {"plain": blocks + 2}), counts
    assert counts[large] == (blocks + 1, {"plain": 1}), counts  # the all-reduces XLA's


# ---- the engine ----
def hf_engine_tokens(name: str, model: int, **overrides) -> list[list[int]]:
    base = load_config(None, model=HF_FIXTURES / name, dtype="float32", skip_tokenizer_init=True, max_model_len=96,
                       block_size=4, num_blocks=96, max_num_batched_tokens=16, max_num_seqs=4, token_buckets=[16],
                       request_buckets=[4], precompile=False, compilation_cache_dir=None, **overrides)
    llm = LLM(config=dataclasses.replace(base, parallel=ParallelConfig(model=model)), progress=False)
    prompts = json.loads((HF_FIXTURES / name / "reference.json").read_text())["prompts"]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert llm.engine.kv_cache.usage == 0.0
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("name,model", [
    ("llama3_gqa4_tied", 2), ("llama3_gqa4_tied", 4), ("llama3_gqa4_tied", 8),  # 2 kv heads: replicated at 4, 8
    ("qwen3_gqa1_untied", 2), ("qwen3_gqa1_untied", 4),  # untied head, q/k norm, head_dim 32
    ("qwen2_gqa4_tied", 8),  # qkv biases
    ("mistral_gqa4_untied", 4),  # sliding window
    ("llama2_mha_untied", 4),
])
def test_engine_greedy_tokens_equal_single_device(name, model):
    reference = json.loads((HF_FIXTURES / name / "reference.json").read_text())["generated"]
    assert hf_engine_tokens(name, model) == reference


def test_heads_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match=r"'heads' axis has 4 entries.*parallel.model must divide 4"):
        hf_engine_tokens("qwen3_gqa1_untied", 8)


def test_kv_memory_accounting_uses_per_device_heads():
    from jaxserve.runner.device_setup import kv_block_bytes

    for name, heads_per_device in [("llama3_gqa4_tied", {1: 2, 2: 1, 4: 1, 8: 1}),  # 2 kv heads
                                   ("qwen3_gqa1_untied", {1: 4, 2: 2, 4: 1})]:  # 4 kv heads
        cfg = loader.load_config(HF_FIXTURES / name)[0]
        one_head = cfg.num_layers * 2 * 16 * cfg.head_dim * 2  # layers, K and V, S=16, H, bf16
        for model, heads in heads_per_device.items():
            assert kv_block_bytes(cfg, 16, 2, tp(model) if model > 1 else None) == heads * one_head, (name, model)


@pytest.fixture(scope="module")
def tiny_tp2():
    # Precompiled (one forward bucket, the sampler variants) for the steady-state test.
    return LLM(config=load_config(ROOT / "configs" / "tiny-tp.yaml", token_buckets=[32], request_buckets=[8],
                                  max_num_batched_tokens=32, max_num_seqs=8, compilation_cache_dir=None),
               progress=False)


def test_embedded_model_tensor_parallel_equals_single_device(tiny_tp2):
    prompts = [f"{a}+{b}=" for a in range(3, 1000, 97) for b in (0, 58, 941)]
    # Some with prompt logprobs: their lm head runs outside the step's shard_map, partitioned by XLA.
    params = [SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=2 if i % 3 == 0 else None)
              for i in range(len(prompts))]
    single = LLM(config=load_config(ROOT / "configs" / "tiny.yaml", token_buckets=[32], request_buckets=[8],
                                    max_num_batched_tokens=32, max_num_seqs=8, precompile=False,
                                    compilation_cache_dir=None), progress=False)

    def results(llm):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        scored = [(t, lp.rank, lp.logprob) for o in outputs[::3] for e in o.prompt_logprobs[1:] for t, lp in e.items()]
        return [o.outputs[0].text for o in outputs], [s[:2] for s in scored], [s[2] for s in scored]

    texts, ranked, logprobs = results(single)
    four = LLM(config=dataclasses.replace(tiny_tp2.config, parallel=ParallelConfig(model=4),
                                          runner=dataclasses.replace(tiny_tp2.config.runner, precompile=False)),
               progress=False)
    for llm in (tiny_tp2, four):
        got_texts, got_ranked, got_logprobs = results(llm)
        assert got_texts == texts and got_ranked == ranked
        np.testing.assert_allclose(got_logprobs, logprobs, atol=1e-4)


def test_tensor_parallel_steady_state_never_compiles(tiny_tp2):
    tiny_tp2.generate(["1+1="], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    mixed = [SamplingParams(temperature=0.0, max_tokens=6), SamplingParams(temperature=0.8, top_p=0.9, seed=3),
             SamplingParams(temperature=1.0, top_k=3, logprobs=2, repetition_penalty=1.2, prompt_logprobs=1)]
    with jax.no_tracing():
        for size in (1, 5, 12):
            prompts = [f"{a}+{a * 7 % 1000}=" for a in range(size)]
            outputs = tiny_tp2.generate(prompts, [mixed[i % 3] for i in range(size)], use_tqdm=False)
            assert all(o.finished and o.outputs[0].token_ids for o in outputs)


def test_all_reduce_mode_is_xla_off_gpu_and_checked():
    from jaxserve.runner.device_setup import setup_all_reduce

    t = tp(2)
    assert setup_all_reduce(t, "auto") == (t, None, None)  # CPU devices: XLA's psum
    assert setup_all_reduce(t, "xla") == (t, None, None)
    with pytest.raises(ValueError, match="one_shot needs the tensor-parallel GPUs in one process"):
        setup_all_reduce(t, "one_shot")
    with pytest.raises(ValueError, match="parallel.all_reduce must be one of"):
        ParallelConfig(model=2, all_reduce="nccl")
