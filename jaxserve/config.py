"""One explicit engine config: frozen dataclasses that map 1:1 onto YAML sections.

    configs/x.yaml --load_config--> EngineConfig(model=ModelConfig, cache=CacheConfig,
                                                 scheduler=SchedulerConfig, runner=RunnerConfig, ...)
    LLM(model=..., **overrides) --EngineConfig.with_overrides--> the same, flat names routed to sections
                                  (a field's name, `section.field`, or vLLM's engine-argument name: VLLM_NAMES)

Unknown keys are errors naming the key and the section (a typo must never be silently ignored). Every value
is checked against its field's annotation (YAML and overrides alike): an int where a float is expected is
accepted, a bool is never an int. No environment variable changes behaviour.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import yaml

from jaxserve.config_speculative import SpeculativeConfig, speculative_from_vllm
from jaxserve.config_types import check_fields, check_type, field_types

DEFAULT_MODEL = str(Path(__file__).resolve().parent / "assets" / "tiny-adder")
# The default config of the command line (package data, so an installed wheel has it too).
DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "tiny.yaml"

@dataclasses.dataclass(frozen=True)
class ModelConfig:
    path: str = DEFAULT_MODEL  # local Hugging Face checkpoint directory
    tokenizer: str | None = None  # tokenizer directory; defaults to `path`
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    max_model_len: int | None = None  # defaults to the checkpoint's max_position_embeddings
    seed: int = 0  # seeds requests that give no seed, so runs repeat (as vLLM does)
    skip_tokenizer_init: bool = False  # no tokenizer: prompts as token ids, outputs as token ids only
    load_format: str = "auto"  # auto: safetensors | dummy: random weights from config.json alone (benchmarks)
    # fp8: quantize a float checkpoint's dense weights at load (per output channel; README "FP8 weights").
    # FP8 checkpoints (config.json's quantization_config) load as FP8 whatever this says.
    quantization: str | None = None

    def __post_init__(self):
        check_fields(self, "model")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"model.dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"model.load_format must be auto (read the safetensors) or dummy (random weights), "
                             f"got {self.load_format!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"model.max_model_len must be >= 1, got {self.max_model_len}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"model.quantization={self.quantization!r} is not supported; use fp8 (FP8 weights) "
                             f"or leave it unset")


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # exact size; else sized from the memory on accelerators, cpu_num_blocks on CPU
    # The KV cache's share of the accelerator memory left free once the weights are loaded (and the step
    # buffers reserved); null: 0.9, unless gpu_memory_utilization is set.
    memory_fraction: float | None = None
    # vLLM's meaning: the share of the device's memory the whole engine may use (weights, step buffers and
    # KV cache); the KV cache gets what is left of it. Set this or memory_fraction, not both.
    gpu_memory_utilization: float | None = None
    cpu_num_blocks: int = 512
    enable_prefix_caching: bool = True
    prefix_hash: str = "sha256"  # sha256 | builtin (fast, keyed per process; single-tenant use)
    # The prefix-cache keys' root: null: random per engine; an integer: engines and restarts with the same
    # seed (and model) name equal prefixes with equal keys, so they share disk-tier blocks.
    prefix_hash_seed: int | None = None
    host_kv_gib: float = 0.0  # host-memory tier under the device cache (README "KV cache tiers"); 0: off
    disk_kv_path: str | None = None  # disk tier below the host tier: a private directory engines may share
    disk_kv_gib: float = 0.0  # the disk tier's size cap (required with disk_kv_path)
    # vLLM's name and values: auto (null): the model's dtype; fp8 or fp8_e4m3: float8_e4m3fn with static K/V
    # scales per layer and kv head (a checkpoint's k_scale / v_scale, else 1), 1 byte per element
    kv_cache_dtype: str | None = "auto"

    def __post_init__(self):
        check_fields(self, "cache")
        if self.kv_cache_dtype is None:
            object.__setattr__(self, "kv_cache_dtype", "auto")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"cache.kv_cache_dtype={self.kv_cache_dtype!r} is not supported; choose one of "
                             f"{list(KV_CACHE_DTYPES)} (fp8 is float8_e4m3fn; fp8_e5m2 is not implemented)")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"cache.block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"cache.num_blocks must be >= 2 (block 0 is the null block), got {self.num_blocks}")
        for name in ("memory_fraction", "gpu_memory_utilization"):
            value = getattr(self, name)
            if value is not None and not 0.0 < value <= 1.0:
                raise ValueError(f"cache.{name} must be in (0, 1], got {value}")
        if self.memory_fraction is not None and self.gpu_memory_utilization is not None:
            raise ValueError("cache.memory_fraction (the KV cache's share of the memory free after the weights) and "
                             "cache.gpu_memory_utilization (vLLM's: the whole engine's share of the device) both size "
                             "the KV cache; set only one")
        if self.prefix_hash not in ("sha256", "builtin"):
            raise ValueError(f"cache.prefix_hash must be sha256 or builtin, got {self.prefix_hash!r}")
        self._check_tiers()

    def _check_tiers(self) -> None:
        if self.prefix_hash == "builtin" and (self.prefix_hash_seed is not None or self.disk_kv_path is not None):
            raise ValueError("cache.prefix_hash_seed and cache.disk_kv_path need cache.prefix_hash: sha256 (builtin "
                             "hashes are randomised per process, so no other engine or restart shares their keys)")
        if self.host_kv_gib < 0 or self.disk_kv_gib < 0:
            raise ValueError(f"cache.host_kv_gib ({self.host_kv_gib}) and cache.disk_kv_gib ({self.disk_kv_gib}) "
                             "must be >= 0 (0: the tier is off)")
        if (self.disk_kv_path is None) != (self.disk_kv_gib == 0):
            raise ValueError("cache.disk_kv_path and cache.disk_kv_gib go together: set both for a disk tier "
                             f"(got disk_kv_path={self.disk_kv_path!r}, disk_kv_gib={self.disk_kv_gib})")
        if self.disk_kv_path is not None and self.host_kv_gib == 0:
            raise ValueError("cache.disk_kv_path needs a host tier (blocks reach the disk through host memory); "
                             "set cache.host_kv_gib (vLLM's kv_offloading_size) > 0")
        if (self.host_kv_gib or self.disk_kv_path) and not self.enable_prefix_caching:
            raise ValueError("cache.host_kv_gib / cache.disk_kv_path hold prefix-cache blocks; they need "
                             "cache.enable_prefix_caching: true")

    @property
    def kv_memory_fraction(self) -> float:
        """memory_fraction, or its default."""
        return 0.9 if self.memory_fraction is None else self.memory_fraction


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 256  # running requests at most
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # > 0: cap one request's prefill chunk per step
    policy: str = "fcfs"  # fcfs | priority (lower value first, then arrival) | fair (per-tenant VTC, core/fairness.py)
    max_n: int = 64  # cap on SamplingParams.n
    max_logprobs: int = 20  # cap on SamplingParams.logprobs and prompt_logprobs; -1: the whole vocabulary
    # Overlap scheduling: step N+1 is dispatched before step N's tokens are read back (docs/ARCHITECTURE.md §4).
    async_scheduling: bool = True
    # How a request preempted for KV blocks resumes: recompute (its blocks are freed, its tokens computed
    # again) | swap (its blocks are copied to the host tier and back; needs cache.host_kv_gib > 0) | auto
    # (per request, the cheaper of the two by core/preemption.py's cost model; recompute without a host tier)
    preemption_mode: str = "auto"

    def __post_init__(self):
        check_fields(self, "scheduler")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("scheduler.max_num_batched_tokens and scheduler.max_num_seqs must be >= 1")
        if self.max_logprobs < -1:
            raise ValueError(f"scheduler.max_logprobs must be >= 0, or -1 for the whole vocabulary, "
                             f"got {self.max_logprobs}")
        if self.policy not in ("fcfs", "priority", "fair"):
            raise ValueError(f"scheduler.policy must be fcfs, priority or fair, got {self.policy!r}")
        if self.preemption_mode not in ("auto", "recompute", "swap"):
            raise ValueError(f"scheduler.preemption_mode must be auto, recompute or swap, got {self.preemption_mode!r}")


FLASH_PREFILL_DEFAULT_TOKENS = 4096  # runner.flash_prefill_token_threshold: null on the GPU "pallas" backend


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    attention_backend: str = "auto"  # auto | reference | pallas
    token_buckets: tuple[int, ...] | None = None  # default: powers of two up to max_num_batched_tokens
    request_buckets: tuple[int, ...] | None = None  # default: powers of two up to max_num_seqs
    precompile: bool = True
    compilation_cache_dir: str | None = "~/.cache/jaxserve/xla"  # null disables the persistent cache
    # > 0: a request with at least this many of a prefill step's tokens attends through the flash attention
    # (pallas_kernels/flash_attention: Mosaic GPU on Hopper) over its K/V gathered from the paged cache,
    # instead of the ragged paged kernel; 0: off; null: FLASH_PREFILL_DEFAULT_TOKENS on the GPU "pallas"
    # backend, off elsewhere. GPU "pallas" and "reference" backends, no sliding window (docs/ARCHITECTURE.md §6).
    flash_prefill_token_threshold: int | None = None

    def __post_init__(self):
        check_fields(self, "runner")
        if self.attention_backend not in ("auto", "reference", "pallas"):
            raise ValueError(f"runner.attention_backend must be auto, reference or pallas, got {self.attention_backend!r}")
        if self.flash_prefill_token_threshold is not None and self.flash_prefill_token_threshold < 0:
            raise ValueError("runner.flash_prefill_token_threshold must be >= 0 (0 turns the flash prefill off; "
                             "null: on for GPUs), "
                             f"got {self.flash_prefill_token_threshold}")
        for name in ("token_buckets", "request_buckets"):
            value = getattr(self, name)
            if value is not None:
                if not value or any(v < 1 for v in value):
                    raise ValueError(f"runner.{name} must be a non-empty list of positive integers")


ALL_REDUCE_MODES = ("auto", "xla", "one_shot")
EXPERT_DISPATCH_MODES = ("auto", "allgather", "all_to_all")  # sharding/expert_parallel's paths A and B


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The device mesh (README "Parallelism"): `data` engine replicas, each tensor-parallel over
    `model` devices; and, for several hosts, how this process joins the others (jax.distributed)."""

    data: int = 1  # data-parallel engine replicas, on disjoint device groups
    model: int = 1  # tensor-parallel devices per replica (must divide the model's attention heads)
    # Expert parallelism: a replica spans expert x model devices; MoE layers shard their experts over the
    # `expert` axis, attention and dense layers run data-parallel over it (each shard its own requests and KV
    # cache; scheduler.max_num_seqs and max_num_batched_tokens are per shard). MoE models only.
    expert: int = 1
    num_redundant_experts: int = 0  # extra expert slots (copies of hot experts), rounded up to fill the devices
    expert_dispatch: str = "auto"  # auto (by the step's size) | allgather | all_to_all: how MoE tokens travel
    # Rebalance the expert placement by the measured load every this many steps (0: only on demand,
    # Engine.rebalance_experts()); each rebalance waits for the step in flight and moves expert weights.
    rebalance_interval_steps: int = 0
    coordinator_address: str | None = None  # "host:port" of process 0, when num_processes > 1
    num_processes: int = 1  # processes (hosts) running the same program
    process_id: int = 0  # this process; 0 schedules and the others follow its steps
    # auto: a peer-memory one-shot kernel for decode-sized all-reduces when the `model` GPUs are in
    # this process (keeps the step one CUDA graph), XLA's everywhere else; xla | one_shot to force
    all_reduce: str = "auto"

    def __post_init__(self):
        check_fields(self, "parallel")
        if self.all_reduce not in ALL_REDUCE_MODES:
            raise ValueError(f"parallel.all_reduce must be one of {ALL_REDUCE_MODES}, got {self.all_reduce!r}")
        if self.expert_dispatch not in EXPERT_DISPATCH_MODES:
            raise ValueError(f"parallel.expert_dispatch must be one of {EXPERT_DISPATCH_MODES}, "
                             f"got {self.expert_dispatch!r}")
        if self.num_redundant_experts < 0:
            raise ValueError(f"parallel.num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
        if self.rebalance_interval_steps < 0:  # (_check_fields checked every type)
            raise ValueError(f"parallel.rebalance_interval_steps must be an integer >= 0 (0: rebalance only on "
                             f"demand), got {self.rebalance_interval_steps!r}")
        if self.expert > 1 and self.num_processes > 1:
            raise ValueError("parallel.expert > 1 runs in one process; set parallel.num_processes to 1")
        if self.expert > 1 and self.all_reduce == "one_shot":
            raise ValueError("parallel.all_reduce=one_shot is not supported with parallel.expert > 1; use auto or xla")
        for name in ("data", "model", "expert", "num_processes"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"parallel.process_id must be in [0, num_processes={self.num_processes}), "
                             f"got {self.process_id!r}")
        if self.num_processes > 1:
            host, _, port = (self.coordinator_address or "").rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"parallel.coordinator_address must be 'host:port' of process 0 when "
                                 f"num_processes > 1, got {self.coordinator_address!r}")
            if self.data > 1:
                raise ValueError("parallel.data > 1 with num_processes > 1 is not supported; span the hosts "
                                 "with parallel.model, or run one server per host")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """`jaxserve serve` only; the engine ignores this section (docs: README "Serving")."""

    host: str = "127.0.0.1"  # 0.0.0.0 to listen on every interface
    port: int = 8000
    # One key or a list; every route but /health, /ping, /version and /metrics. Unset here and on the
    # command line: `jaxserve serve` reads the JAXSERVE_API_KEY environment variable (not visible in ps).
    api_key: str | tuple[str, ...] | None = None
    served_model_name: str | None = None  # the `model` clients send; default: the model directory's name
    max_queued_requests: int = 1024  # accepted but not yet started; more answer 429
    max_body_bytes: int = 1 << 20  # larger request bodies answer 413
    max_header_bytes: int = 16 << 10  # larger request heads answer 431
    # One request's total work: prompts x n x max_tokens generated tokens, and that times
    # (logprobs + 1) logprob entries; more answer 400 (the response would grow with the product).
    max_request_tokens: int = 1 << 20
    max_request_logprobs: int = 1 << 18
    tenant_header: str | None = "x-tenant-id"  # fair-share tenant when no api_key is set; with keys: the key
    drain_timeout_s: float = 30.0  # SIGTERM: wait this long for in-flight requests, then abort them
    retry_after_s: int = 1  # Retry-After of 429 and 503 answers
    # An idle connection (no request yet, or between requests) stays open this long; longer than
    # clients' pool expiry (httpx: 5 s), so a client never reuses a connection the server is closing.
    keep_alive_timeout_s: float = 60.0
    read_timeout_s: float = 30.0  # a request's head and body must arrive within this long of its first byte
    tokenizer_workers: int = 2  # processes that render chat templates and tokenize (off the serving process)
    tokenizer_timeout_s: float = 60.0  # one tokenizing call longer than this: the worker is replaced, 500
    trust_request_chat_template: bool = False  # accept `chat_template` in requests
    access_log: bool = True
    # The engine runs in its own process (jaxserve/engine_process.py), so that its loop never waits for the
    # HTTP event loop's turn at the interpreter; false: an engine thread in the server process. (Multi-host
    # process 0 always runs its engine in the server process.)
    engine_process: bool = True
    # Prefill/decode disaggregation (README): null = one colocated engine; prefill | decode = this instance's
    # role behind `jaxserve router`. kv_transfer_address: the decode instance's KV transfer endpoint (port 0:
    # any free one, reported at GET /pd/info); kv_transfer_token: the secret every instance and the router
    # share (required unless the endpoint is on loopback); kv_transfer_timeout_s: a transfer's deadline;
    # kv_transfer_method (a prefill instance's choice; a decode instance takes either): device (through
    # jax.experimental.transfer, from device to device) or host (bytes over the control connection);
    # kv_install_blocks_per_step: a decode instance with requests running writes at most about this many
    # arrived blocks into its cache between two steps (at least one chunk), so that installing a long
    # prompt's KV never holds up its running streams' next token; 0 = each transfer at once.
    # pd_local_prefill_max_tokens (the router's; --local-prefill-max-tokens): a prompt of at most this many
    # tokens goes to the decode instance without a transfer and is prefilled there; 0 = every prompt
    # through a prefill instance.
    pd_role: str | None = None
    kv_transfer_address: str = "127.0.0.1:0"
    kv_transfer_token: str | None = None
    kv_transfer_timeout_s: float = 10.0
    kv_transfer_method: str = "device"
    kv_install_blocks_per_step: int = 64
    pd_local_prefill_max_tokens: int = 0

    def __post_init__(self):
        check_fields(self, "server")
        keys = self.api_key if isinstance(self.api_key, tuple) else (self.api_key,) if self.api_key is not None else ()
        if not all(isinstance(key, str) and key for key in keys):
            raise ValueError("server.api_key must be a non-empty string, a list of them, or null")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"server.port must be in [0, 65535], got {self.port}")
        for name in ("max_queued_requests", "max_body_bytes", "max_header_bytes", "max_request_tokens",
                     "max_request_logprobs", "tokenizer_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"server.{name} must be >= 1, got {getattr(self, name)}")
        if self.tenant_header is not None:
            object.__setattr__(self, "tenant_header", self.tenant_header.lower())
        if self.drain_timeout_s < 0 or self.retry_after_s < 0:
            raise ValueError("server.drain_timeout_s and server.retry_after_s must be >= 0")
        if self.keep_alive_timeout_s <= 0 or self.read_timeout_s <= 0 or self.tokenizer_timeout_s <= 0:
            raise ValueError("server.keep_alive_timeout_s, server.read_timeout_s and server.tokenizer_timeout_s "
                             "must be > 0")
        if self.pd_role not in (None, "prefill", "decode"):
            raise ValueError(f"server.pd_role must be prefill, decode or null, got {self.pd_role!r}")
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError(f"server.kv_transfer_timeout_s must be > 0, got {self.kv_transfer_timeout_s}")
        if self.kv_transfer_method not in ("device", "host"):
            raise ValueError(f"server.kv_transfer_method must be device or host, got {self.kv_transfer_method!r}")
        if self.pd_local_prefill_max_tokens < 0:
            raise ValueError(f"server.pd_local_prefill_max_tokens must be >= 0 (0: every prompt through a prefill "
                             f"instance), got {self.pd_local_prefill_max_tokens}")
        if self.kv_install_blocks_per_step < 0:
            raise ValueError(f"server.kv_install_blocks_per_step must be >= 0 (0: no limit), got "
                             f"{self.kv_install_blocks_per_step}")
        if self.kv_transfer_token is not None and not self.kv_transfer_token:
            raise ValueError("server.kv_transfer_token must be a non-empty string or null")


# Fields only `jaxserve bench` sets (no command-line flag elsewhere; Engine refuses them unless told).
BENCH_ONLY = {("speculative", "synthetic_acceptance")}

SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "runner": RunnerConfig,
            "parallel": ParallelConfig, "server": ServerConfig, "speculative": SpeculativeConfig}

# vLLM's engine-argument names (`LLM(...)` keywords, `vllm serve` flags) for fields jaxserve names otherwise.
# vLLM names equal to a field's name (max_num_seqs, max_num_batched_tokens, max_model_len, seed, block_size,
# enable_prefix_caching, enable_chunked_prefill, dtype, tokenizer, served_model_name, load_format,
# gpu_memory_utilization, ...) need none.
VLLM_NAMES = {
    "tensor_parallel_size": ("parallel", "model"),
    "data_parallel_size": ("parallel", "data"),
    "num_gpu_blocks_override": ("cache", "num_blocks"),
    "scheduling_policy": ("scheduler", "policy"),
    "kv_offloading_size": ("cache", "host_kv_gib"),
}

# vLLM's names for what jaxserve does not do (yet): the default is accepted, so vLLM code runs unchanged;
# anything else is refused. name -> (accepted values, annotation, the reason given)
NOT_SUPPORTED = {
    "pipeline_parallel_size": ((1,), int, "is not supported yet: use tensor_parallel_size to spread a model"),
    "trust_remote_code": ((False,), bool, "is refused: jaxserve never runs code from a checkpoint (auto_map); "
                                          "it runs the architectures it implements (README: Checkpoints)"),
}


# vLLM's names for a whole section given as one mapping: name -> (section, its translation, help)
VLLM_SECTIONS = {
    "speculative_config": ("speculative", speculative_from_vllm,
                           "vLLM's mapping for the speculative section, e.g. "
                           "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'"),
}

# vLLM's switches that set other fields (applied after every other override): name -> (annotation, help)
VLLM_SWITCHES = {
    "enable_expert_parallel": (bool, "vLLM's switch: true turns data_parallel_size ranks into parallel.expert shards"),
}


def enable_expert_parallel(config: EngineConfig, value: bool) -> EngineConfig:
    """vLLM's enable_expert_parallel: its data-parallel ranks run attention on their own requests and share
    the MoE layers' experts, which is jaxserve's parallel.expert (one engine, expert x model devices). True
    moves parallel.data into parallel.expert (unless parallel.expert is set already)."""
    check_type("enable_expert_parallel", value, bool)
    parallel = config.parallel
    if not value or parallel.expert > 1:
        return config
    if parallel.data == 1:
        raise ValueError("enable_expert_parallel=True with data_parallel_size=1: jaxserve shards experts over "
                         "parallel.expert devices that each run attention for their own requests (vLLM's data-parallel "
                         "ranks under enable_expert_parallel); set data_parallel_size > 1 with it, or set "
                         "parallel.expert")
    return dataclasses.replace(config, parallel=dataclasses.replace(parallel, expert=parallel.data, data=1))


def resolve_option(key: str, value: Any) -> tuple[str, str, Any] | None:
    """An override key -> (section, field, value), its value type-checked under the name the caller used;
    None for a vLLM name of NOT_SUPPORTED left at its default. `model` (or `model_path`) is model.path."""
    if key in ("model", "model_path"):
        check_type(key, value, str | os.PathLike)
        return "model", "path", str(value)
    if key in NOT_SUPPORTED:
        accepted, hint, reason = NOT_SUPPORTED[key]
        check_type(key, value, hint)
        if not any(value is a or (type(value) is type(a) and value == a) for a in accepted):
            raise ValueError(f"{key}={value!r} {reason}; leave {key} at {accepted[0]!r}")
        return None
    if key in VLLM_NAMES:
        section, name = VLLM_NAMES[key]
        label = f"{key} (jaxserve's {section}.{name})"
    elif "." in key and key.split(".", 1)[0] in SECTIONS:
        section, name = key.split(".", 1)
        label = key
    else:
        owners = [s for s, cls in SECTIONS.items() if key in field_types(cls)]
        if not owners:
            raise ValueError(f"unknown engine option {key!r}; see jaxserve/config.py for the options "
                             f"(vLLM's names: {sorted(VLLM_NAMES)})")
        section, name, label = owners[0], key, key
    hints = field_types(SECTIONS[section])
    if name not in hints:
        raise ValueError(f"unknown engine option {key!r}: section {section!r} has {sorted(hints)}")
    check_type(label, value, hints[name])
    return section, name, value


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    runner: RunnerConfig = RunnerConfig()
    parallel: ParallelConfig = ParallelConfig()
    server: ServerConfig = ServerConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> EngineConfig:
        data = data or {}
        unknown = set(data) - set(SECTIONS)
        if unknown:
            raise ValueError(f"{source}: unknown section(s) {sorted(unknown)}; expected {sorted(SECTIONS)}")
        sections = {}
        for name, section_cls in SECTIONS.items():
            values = data.get(name) or {}
            if not isinstance(values, dict):
                raise ValueError(f"{source}: section {name!r} must be a mapping")
            known = {f.name for f in dataclasses.fields(section_cls)}
            bad = set(values) - known
            if bad:
                raise ValueError(f"{source}: unknown key(s) {sorted(bad)} in section {name!r}; known: {sorted(known)}")
            sections[name] = section_cls(**values)
        return cls(**sections)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def with_overrides(self, **overrides: Any) -> EngineConfig:
        """Flat overrides routed to their sections: a field's name (`max_num_seqs=8`), `section.field`, `model`
        for model.path, or vLLM's name (`tensor_parallel_size=2`; see resolve_option; VLLM_SWITCHES last). A
        VLLM_SECTIONS mapping (`speculative_config={...}`) replaces its whole section first; field overrides
        refine it."""
        data = self.to_dict()
        for key, (section, translate, _) in VLLM_SECTIONS.items():
            if key in overrides:
                data[section] = translate(overrides[key])
        for key, value in overrides.items():
            if key in VLLM_SECTIONS:
                continue
            resolved = resolve_option(key, value) if key not in VLLM_SWITCHES else None
            if resolved is not None:
                section, name, value = resolved
                data[section][name] = value
        config = EngineConfig.from_dict(data)
        if "enable_expert_parallel" in overrides:
            config = enable_expert_parallel(config, overrides["enable_expert_parallel"])
        return config


def load_config(path: str | os.PathLike | None = None, **overrides: Any) -> EngineConfig:
    """Read a YAML config (or the defaults when path is None) and apply flat overrides."""
    if path is None:
        config = EngineConfig()
    else:
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"config file {path} not found") from None
        except yaml.YAMLError as err:
            raise ValueError(f"{path}: invalid YAML: {err}") from None
        config = EngineConfig.from_dict(data or {}, source=str(path))
        model_path = config.model.path
        if not os.path.isabs(model_path) and not Path(model_path).exists() and (path.parent / model_path).exists():
            config = config.with_overrides(model=str(path.parent / model_path))
        # model.tokenizer: relative to the config file unless it exists from the working directory; also when
        # it exists nowhere yet, so that the error names the path the config means.
        tokenizer = config.model.tokenizer
        if tokenizer is not None and not os.path.isabs(tokenizer) and not Path(tokenizer).exists():
            config = config.with_overrides(tokenizer=str(path.parent / tokenizer))
    return config.with_overrides(**overrides) if overrides else config
