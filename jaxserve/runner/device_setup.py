"""What a ModelRunner sets up before its first step: the model (loaded and placed; on one Hopper GPU its
per-channel FP8 weights held [N, K] for the decode kernel), the tensor-parallel all-reduce kernel and its
workspace, the persistent compilation cache, the attention backend, and how many KV-cache blocks fit on the
device (from XLA's allocator statistics, or from the driver when the allocator keeps none)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import FLASH_PREFILL_DEFAULT_TOKENS, EngineConfig
from jaxserve.models import kv_scales, loader, quant, registry
from jaxserve.models.family import ModelConfig
from jaxserve.models.loader import LoadedModel
from jaxserve.private_dir import private_directory
from pallas_kernels.paged_attention import fp8
from sharding import MODEL_AXIS, TensorParallel

logger = logging.getLogger(__name__)


def load_model(config: EngineConfig, tp: TensorParallel | None = None) -> LoadedModel:
    """The model of config.model, each tensor placed straight into its sharding on `tp`'s mesh (by its
    family's param_placer), or on the default device without `tp`; its FP8 weights then held [N, K]
    where `holds_fp8_transposed` says so."""
    model = config.model
    loaded = loader.load_model(model.path, dtype=model.dtype, load_format=model.load_format, tp=tp,
                               quantization=model.quantization)
    if holds_fp8_transposed(loaded.config, tp):
        loaded = dataclasses.replace(loaded, params=hold_fp8_transposed(loaded.params))
    return loaded


def holds_fp8_transposed(cfg: ModelConfig, tp: TensorParallel | None) -> bool:
    """Whether an engine holds its per-channel FP8 weights as [N, K] (K contiguous) for the W8A8 Mosaic GPU
    decode kernel (models/quant.py): FP8 weights of a bfloat16 model (the kernel writes bfloat16) on one
    device (no tensor or expert parallelism: their shards keep the weights' own layout) of a Hopper GPU."""
    if getattr(cfg, "quantization", None) is None or getattr(cfg, "dtype", None) != "bfloat16":
        return False
    if tp is not None and (tp.mesh.size > 1 or tp.expert is not None):
        return False
    from pallas_kernels.fp8_gemm import mosaic_gpu  # noqa: PLC0415 - Mosaic GPU loads where it may run
    return mosaic_gpu.runs_on(jax.devices()[0] if tp is None else tp.mesh.devices.flat[0])


def hold_fp8_transposed(params):
    """params with every FP8 weight with per-channel scales held [N, K] (quant.hold_transposed), each layer's
    groups of them that share an input joined into one (FUSED_FP8); block-scaled weights, and everything
    else, as they are. Consumes `params`: each weight's [K, N] q is freed once its transpose is made, and
    a group's weights once they are joined, so the load's peak is one group above the model's.

    NOTE: the weights are transposed here, on the device after loading, rather than in the loader: every
    way weights arrive (an FP8 checkpoint, online quantization, dummy weights) passes through here, the
    loader and the tensor-parallel placement keep one layout, and a device transposes at its memory
    bandwidth, far faster than the host reads a checkpoint."""
    def hold(w):
        held = quant.hold_transposed(w)
        if held is not w and isinstance(w.q, jax.Array):
            held.q.block_until_ready()
            w.q.delete()
        return held
    params = jax.tree.map(hold, params, is_leaf=lambda node: isinstance(node, quant.Fp8Weight))
    for lp in params.get("layers", ()):
        for fused, parts in FUSED_FP8.items():
            if all(name in lp for name in parts) and (w := quant.fuse_outputs([lp[n] for n in parts])) is not None:
                w.q.block_until_ready()
                for name in parts:
                    lp.pop(name).q.delete()
                lp[fused] = w
    return params


# Per-channel FP8 weights held [N, K] that share their input are joined (quant.fuse_outputs): one decode kernel
# and one quantization of the activations per group (XLA merges the bfloat16 dots of a group itself, but not
# the kernel's custom calls). models/llama.py's _qkv and _out_and_mlp read the joined weights.
FUSED_FP8 = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


def resolve_max_model_len(config: EngineConfig, model_config) -> int:
    """model.max_model_len, or the model's max_position_embeddings; ValueError past the latter."""
    limit = model_config.max_position_embeddings
    max_model_len = config.model.max_model_len or limit
    if max_model_len > limit:
        raise ValueError(f"model.max_model_len={max_model_len} exceeds the model's max_position_embeddings "
                         f"({limit}); lower max_model_len")
    return max_model_len


def kv_cache_dtype(config: EngineConfig, cfg: ModelConfig, attention_backend: str):
    """The KV cache's dtype: the model's, or float8_e4m3fn for cache.kv_cache_dtype fp8 / fp8_e4m3
    (refused where no attention path reads it: the TPU kernel)."""
    if config.cache.kv_cache_dtype not in fp8.NAMES:
        return cfg.jnp_dtype
    if attention_backend == "pallas" and jax.default_backend() == "tpu":
        raise ValueError(f"cache.kv_cache_dtype={config.cache.kv_cache_dtype} is not supported yet by the TPU "
                         "attention kernel; use kv_cache_dtype auto, or runner.attention_backend reference")
    return fp8.DTYPE


def with_kv_scales(model: LoadedModel, config: EngineConfig, tp: TensorParallel | None) -> LoadedModel:
    """`model` with each layer's fp8 K/V scales among its params (models/kv_scales.py), placed like its
    kv heads; unchanged when they are there already."""
    if all("kv_scale" in lp for lp in model.params["layers"]):
        return model
    place = registry.family_of(model.config).param_placer(tp) if tp is not None else None
    params = kv_scales.load(model.path, model.params, model.config, config.model.load_format, place)
    return dataclasses.replace(model, params=params)


def setup_all_reduce(tp: TensorParallel | None, mode: str, dtype="bfloat16"):
    """-> (tp, comm, workspace): `tp` with the all-reduce kernel the step uses, the kernel's device state
    (the pointer table, an argument of every step) and the buffers behind it (kept alive by the runner).

    one_shot (what `auto` picks for tensor parallelism over the GPUs of one process): the decode-sized
    all-reduces run pallas_kernels.all_reduce, which XLA captures in the step's CUDA graph; its own
    one-shot all-reduce splits the graph at every call, and replaying the pieces of a split step makes
    the host, not the GPUs, set the pace (benchmarks/RESULTS.md). xla: lax.psum everywhere (CPU, TPU, several
    processes: the kernel reaches its peers through raw device pointers, which only one process holds).
    The kernel's workspace carries the model's dtype (`dtype`: bfloat16 or float32) for the activations
    and float32 for the logits' gather."""
    if tp is None or tp.size == 1 or mode == "xla" or tp.expert is not None:
        return tp, None, None  # (the kernel's table covers one "model" group: not an [expert, model] mesh)
    devices = list(tp.mesh.devices.flat)
    hopper = all(float(getattr(d, "compute_capability", 0) or 0) >= 9.0 for d in devices)
    dtype = jnp.dtype(dtype).name
    if devices[0].platform != "gpu" or jax.process_count() > 1 or not hopper or dtype not in ("bfloat16", "float32"):
        if mode == "one_shot":
            raise ValueError(f"parallel.all_reduce=one_shot needs the tensor-parallel GPUs in one process, sm_90 or "
                             f"newer, and a bfloat16 or float32 model; this mesh is {devices[0].platform} "
                             f"({getattr(devices[0], 'device_kind', '')}) over {jax.process_count()} process(es), "
                             f"dtype {dtype}: use auto or xla")
        return tp, None, None
    from pallas_kernels.all_reduce.mosaic_gpu import OneShotAllReduce, Workspace
    # the activations' all-reduces ([T, D] up to 64 x 8192) and the float32 logits' gather (decode
    # steps of up to 4 requests at a 128K vocabulary)
    sizes = {dtype: 64 * 8192}
    sizes["float32"] = max(sizes.get("float32", 0), 4 * 128 * 1024)
    workspace = Workspace(devices, sizes)
    tp = dataclasses.replace(tp, all_reduce=OneShotAllReduce.of(workspace))
    return tp, workspace.table(tp.mesh, MODEL_AXIS), workspace


def enable_compilation_cache(directory: str | None) -> None:
    """JAX's persistent compilation cache in a private directory (`private_directory`). Its entries are
    trusted code."""
    if not directory:
        return
    path = private_directory(directory)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def _pallas_supports(cfg: ModelConfig, block_size: int) -> bool:
    """Shapes the Pallas kernels take: Triton needs power-of-two head dims >= 16 and page sizes."""
    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0
    return pow2(cfg.head_dim) and cfg.head_dim >= 16 and pow2(block_size)


def resolve_attention_backend(name: str, cfg: ModelConfig, block_size: int) -> str:
    """auto: the Pallas kernels on GPU and TPU when they take the model's shapes, else the reference."""
    if name == "auto":
        if jax.default_backend() not in ("gpu", "tpu"):
            return "reference"
        if not _pallas_supports(cfg, block_size):
            logger.warning("attention_backend auto: head_dim=%d / block_size=%d are not supported by the Pallas "
                           "kernels; using the reference attention", cfg.head_dim, block_size)
            return "reference"
        return "pallas"
    return name


def flash_prefill_threshold(configured: int | None, attention_backend: str) -> int:
    """runner.flash_prefill_token_threshold as the step programs take it: null is FLASH_PREFILL_DEFAULT_TOKENS
    with the "pallas" backend on a GPU (the flash kernels), 0 (off) elsewhere."""
    if configured is not None:
        return configured
    on_gpu = attention_backend == "pallas" and jax.default_backend() == "gpu"
    return FLASH_PREFILL_DEFAULT_TOKENS if on_gpu else 0


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype_bytes: int, tp: TensorParallel | None = None) -> int:
    """Bytes of one KV block (all layers, K and V) on one device: with tensor parallelism a device holds
    its kv heads only (num_kv_heads / tp, or one replicated head when num_kv_heads < tp)."""
    kv_heads = cfg.num_kv_heads if tp is None else tp.local_size("kv_heads", cfg.num_kv_heads, "num_key_value_heads")
    return cfg.num_layers * 2 * block_size * kv_heads * cfg.head_dim * dtype_bytes


def driver_memory(device) -> tuple[int, int] | None:
    """(limit, in_use) bytes of a CUDA device from the driver, or None off CUDA. For allocators that keep
    no statistics, e.g. the VMM allocator that XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP
    selects: it maps memory as it is used, within a budget of XLA_CLIENT_MEM_FRACTION (or
    XLA_PYTHON_CLIENT_MEM_FRACTION; default 0.75) of the device. `limit` is that budget; `in_use` what
    the device holds now (cuMemGetInfo in the primary context XLA uses), so limit - in_use is what XLA
    may still allocate."""
    import ctypes

    if getattr(device, "platform", None) != "gpu":
        return None
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    handle, ctx = ctypes.c_int(), ctypes.c_void_p()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    if (cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(handle), getattr(device, "local_hardware_id", device.id))
            or cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), handle)):
        return None
    try:
        if cuda.cuCtxPushCurrent_v2(ctx):
            return None
        try:
            if cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)):
                return None
        finally:
            cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        cuda.cuDevicePrimaryCtxRelease_v2(handle)
    budget = next((float(v) for v in map(os.environ.get, ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"))
                   if v), 0.75)  # (jaxlib reads the first name, then the older one)
    return int(budget * total.value), total.value - free.value


def device_memory(device) -> tuple[int, int]:
    """(limit, in_use): the bytes XLA may hold on `device` in all (memory_stats' bytes_limit, or the
    driver's figures when the allocator keeps no statistics) and those in use now."""
    stats = device.memory_stats()
    if stats:
        return stats.get("bytes_limit", 0), stats.get("bytes_in_use", 0)
    memory = driver_memory(device)
    if memory is None:
        raise ValueError(f"cannot tell the free memory of {device} (its allocator keeps no statistics): "
                         f"set cache.num_blocks")
    return memory


def kv_cache_num_blocks(cfg: ModelConfig, config: EngineConfig, max_model_len: int, dtype_bytes: int,
                       tp: TensorParallel | None = None, reserved_bytes: int = 0, extra_block_bytes: int = 0) -> int:
    """Blocks that fit on one of the engine's devices (or the configured count); over several processes,
    the fewest any process offers, so that every process builds the same cache. `reserved_bytes`: buffers
    made later (step inputs and outputs, temporaries). `extra_block_bytes`: what each block holds besides
    the model's K/V (a draft model's K/V in the same blocks).

    memory_fraction (jaxserve's): that share of the memory free after the weights and `reserved_bytes`.
    gpu_memory_utilization (vLLM's): the engine may hold that share of the device's memory (XLA's limit),
    and the KV cache gets what the weights, whatever else is in use and `reserved_bytes` leave of it."""
    cache = config.cache
    per_block = kv_block_bytes(cfg, cache.block_size, dtype_bytes, tp) + extra_block_bytes
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
    elif jax.default_backend() == "cpu":
        num_blocks = cache.cpu_num_blocks
    else:
        device = jax.devices()[0] if tp is None else tp.mesh.local_devices[0]
        limit, in_use = device_memory(device)  # in_use: the weights (and whatever else is loaded)
        if cache.gpu_memory_utilization is None:
            num_blocks = int((limit - in_use - reserved_bytes) * cache.kv_memory_fraction) // per_block
        else:
            allowed = int(limit * cache.gpu_memory_utilization)
            if allowed - in_use - reserved_bytes <= 0:
                gib = 2**30
                raise ValueError(
                    f"cache.gpu_memory_utilization={cache.gpu_memory_utilization} lets the engine use "
                    f"{allowed / gib:.2f} GiB of the device's {limit / gib:.2f} GiB, but {in_use / gib:.2f} GiB are "
                    f"in use after loading the weights and the step buffers need {reserved_bytes / gib:.2f} GiB "
                    f"more ({(in_use + reserved_bytes) / gib:.2f} GiB): nothing is left for the KV cache; raise "
                    f"gpu_memory_utilization, or spread the model over more devices")
            num_blocks = (allowed - in_use - reserved_bytes) // per_block
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        offer = min(num_blocks, np.iinfo(np.int32).max)  # (block ids are int32)
        num_blocks = int(multihost_utils.process_allgather(np.int32(offer)).min())
    needed = math.ceil(max_model_len / cache.block_size) + 1  # + the null block
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache has {num_blocks} blocks of {cache.block_size} tokens ({num_blocks * per_block / 2**30:.2f} "
            f"GiB) but one request of max_model_len={max_model_len} needs {needed} (with the null block); raise "
            f"cache.num_blocks, cache.memory_fraction or cache.gpu_memory_utilization, or lower "
            f"model.max_model_len"
        )
    return num_blocks
