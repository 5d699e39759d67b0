"""One explicit engine config: frozen dataclasses that map 1:1 onto YAML sections.

    configs/x.yaml --load_config--> EngineConfig(model=ModelConfig, cache=CacheConfig,
                                                 scheduler=SchedulerConfig, runner=RunnerConfig)
    LLM(model=..., **overrides) --EngineConfig.from_overrides--> the same, flat names routed to sections

Unknown keys are errors naming the key and the section (a typo must never be silently ignored).
No environment variable changes behaviour.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import yaml

DEFAULT_MODEL = str(Path(__file__).resolve().parent / "assets" / "tiny-adder")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    path: str = DEFAULT_MODEL  # local Hugging Face checkpoint directory
    tokenizer: str | None = None  # defaults to `path`
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    max_model_len: int | None = None  # defaults to the checkpoint's max_position_embeddings
    seed: int = 0  # seeds requests that give no seed, so runs repeat (as vLLM does)
    skip_tokenizer_init: bool = False  # no tokenizer: prompts as token ids, outputs as token ids only
    load_format: str = "auto"  # auto: safetensors | dummy: random weights from config.json alone (benchmarks)

    def __post_init__(self):
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"model.dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"model.load_format must be auto (read the safetensors) or dummy (random weights), "
                             f"got {self.load_format!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"model.max_model_len must be >= 1, got {self.max_model_len}")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # exact size; else memory_fraction on accelerators, cpu_num_blocks on CPU
    memory_fraction: float = 0.9  # share of free accelerator memory given to the KV cache
    cpu_num_blocks: int = 512
    enable_prefix_caching: bool = True
    prefix_hash: str = "sha256"  # sha256 | builtin (fast, keyed per process; single-tenant use)

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"cache.block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"cache.num_blocks must be >= 2 (block 0 is the null block), got {self.num_blocks}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"cache.memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.prefix_hash not in ("sha256", "builtin"):
            raise ValueError(f"cache.prefix_hash must be sha256 or builtin, got {self.prefix_hash!r}")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 256  # running requests at most
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # > 0: cap one request's prefill chunk per step
    policy: str = "fcfs"  # fcfs | priority (lower value first, then arrival) | fair (per-tenant VTC, core/fairness.py)
    max_n: int = 64  # cap on SamplingParams.n
    max_logprobs: int = 20
    # Overlap scheduling: step N+1 is dispatched before step N's tokens are read back (DESIGN §7).
    async_scheduling: bool = True

    def __post_init__(self):
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("scheduler.max_num_batched_tokens and scheduler.max_num_seqs must be >= 1")
        if self.policy not in ("fcfs", "priority", "fair"):
            raise ValueError(f"scheduler.policy must be fcfs, priority or fair, got {self.policy!r}")


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    attention_backend: str = "auto"  # auto | reference | pallas
    token_buckets: tuple[int, ...] | None = None  # default: powers of two up to max_num_batched_tokens
    request_buckets: tuple[int, ...] | None = None  # default: powers of two up to max_num_seqs
    precompile: bool = True
    compilation_cache_dir: str | None = "~/.cache/jaxserve/xla"  # null disables the persistent cache

    def __post_init__(self):
        if self.attention_backend not in ("auto", "reference", "pallas"):
            raise ValueError(f"runner.attention_backend must be auto, reference or pallas, got {self.attention_backend!r}")
        for name in ("token_buckets", "request_buckets"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(int(v) for v in value))
                if not value or any(v < 1 for v in value):
                    raise ValueError(f"runner.{name} must be a non-empty list of positive integers")


ALL_REDUCE_MODES = ("auto", "xla", "one_shot")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The device mesh (README "Parallelism"): `data` engine replicas, each tensor-parallel over
    `model` devices; and, for several hosts, how this process joins the others (jax.distributed)."""

    data: int = 1  # data-parallel engine replicas, on disjoint device groups
    model: int = 1  # tensor-parallel devices per replica (must divide the model's attention heads)
    coordinator_address: str | None = None  # "host:port" of process 0, when num_processes > 1
    num_processes: int = 1  # processes (hosts) running the same program
    process_id: int = 0  # this process; 0 schedules and the others follow its steps
    # auto: a peer-memory one-shot kernel for decode-sized all-reduces when the `model` GPUs are in
    # this process (keeps the step one CUDA graph), XLA's everywhere else; xla | one_shot to force
    all_reduce: str = "auto"

    def __post_init__(self):
        if self.all_reduce not in ALL_REDUCE_MODES:
            raise ValueError(f"parallel.all_reduce must be one of {ALL_REDUCE_MODES}, got {self.all_reduce!r}")
        for name in ("data", "model", "num_processes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.process_id, int) or not 0 <= self.process_id < self.num_processes:
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
    trust_request_chat_template: bool = False  # accept `chat_template` in requests
    access_log: bool = True

    def __post_init__(self):
        if isinstance(self.api_key, (list, tuple)):
            object.__setattr__(self, "api_key", tuple(self.api_key))
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
        if self.keep_alive_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ValueError("server.keep_alive_timeout_s and server.read_timeout_s must be > 0")


SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "runner": RunnerConfig,
            "parallel": ParallelConfig, "server": ServerConfig}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    runner: RunnerConfig = RunnerConfig()
    parallel: ParallelConfig = ParallelConfig()
    server: ServerConfig = ServerConfig()

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
        """Flat overrides (`max_num_seqs=8`, `block_size=4`, `model="dir"`) routed to their sections."""
        data = self.to_dict()
        for key, value in overrides.items():
            if key == "model" or key == "model_path":
                data["model"]["path"] = str(value)
                continue
            owners = [name for name, cls in SECTIONS.items() if key in {f.name for f in dataclasses.fields(cls)}]
            if not owners:
                raise ValueError(f"unknown engine option {key!r}; see jaxserve/config.py for the options")
            data[owners[0]][key] = value
        return EngineConfig.from_dict(data)


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
    return config.with_overrides(**overrides) if overrides else config
