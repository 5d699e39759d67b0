"""The engine's core loop: add / abort / step, between input processing and output processing.

    prepare_request: InputProcessor (validate + tokenize -> PreparedRequest; queues nothing)
    enqueue:         PreparedRequest -> n child Requests -> scheduler; OutputProcessor tracks them
    step():          scheduler.schedule() -> runner.dispatch() (step N+1, returns at once)
                     then, for step N: runner.collect() -> scheduler.update_from_output()
                     -> OutputProcessor (detokenize, stop strings) -> RequestOutputs
                     (without async_scheduling, step N is collected right after its own dispatch)
    observers:       on_dispatch / on_processed of each step (step_stats.StepObserver; `jaxserve bench`)

The runner loads the model and answers the model's facts (max_model_len, vocabulary, generation
defaults). With parallel.expert > 1 the scheduler is a ShardedScheduler (one Scheduler and KV cache
manager per expert shard) and the runner an ExpertParallelRunner (one step of every shard's requests). A request with n > 1 becomes n children ("{i}_{id}") that share the prompt; the first
child's prompt blocks are registered in the prefix cache when allocated, so the others hit them.
Every bad input raises ValueError naming the parameter; nothing is queued in that case, so the
engine keeps serving. `Engine` implements engine_client.EngineClient.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from jax.sharding import Mesh

from jaxserve import distributed
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core import eplb
from jaxserve.core.kv_cache_manager import KVCacheManager, root_hash
from jaxserve.core.kv_tiers.link import ShardedTierLink
from jaxserve.core.sched_types import SchedulerOutput
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.sharded_scheduler import ShardedKVCache, ShardedScheduler
from jaxserve.engine_client import EngineStats
from jaxserve.input_processor import InputProcessor, PreparedRequest, PromptType
from jaxserve.output_processor import OutputProcessor
from jaxserve.outputs import RequestOutput
from jaxserve.request import Request, RequestStatus
from jaxserve.runner import kv_transfer
from jaxserve.runner.ep_runner import ExpertParallelRunner
from jaxserve.runner.model_runner import MAX_BANNED, ModelRunner
from jaxserve.runner.step_types import StepHandle
from jaxserve.sampling_params import SamplingParams
from jaxserve.step_stats import StepObserver, StepStatsRecorder
from jaxserve.tokenizer import Tokenizer

__all__ = ["Engine", "PreparedRequest"]

logger = logging.getLogger(__name__)


def _load_tokenizer(model: ModelConfig) -> Tokenizer:
    try:
        return Tokenizer.from_dir(model.tokenizer or model.path)
    except FileNotFoundError as err:
        if model.load_format != "dummy":
            raise
        raise FileNotFoundError(
            f"{err}. A load_format: dummy model brings no tokenizer: make one of its vocabulary size with "
            f"`python benchmarks/make_synthetic_tokenizer.py --model-config {model.path}/config.json --out DIR` and "
            f"set model.tokenizer to DIR, or set model.skip_tokenizer_init: true (token-id prompts, no text)") from None


class Engine:
    def __init__(self, config: EngineConfig, progress: bool = True, record_step_stats: bool = False,
                 mesh: Mesh | None = None, allow_synthetic_acceptance: bool = False):
        """`mesh`: this engine's devices (a data-parallel replica's [1, model] mesh); by default the first
        parallel.model devices. With parallel.num_processes > 1 this is process 0's engine; the other
        processes run distributed.run_follower. `record_step_stats`: attach a StepStatsRecorder
        (`step_stats`: its records). `allow_synthetic_acceptance`: jaxserve bench's switch for
        speculative.synthetic_acceptance (outputs not meaningful), refused otherwise."""
        if config.speculative.synthetic_acceptance is not None and not allow_synthetic_acceptance:
            raise ValueError("speculative.synthetic_acceptance is a bench-only option (its outputs are not the "
                             "model's): use `jaxserve bench latency|throughput --spec-synthetic-acceptance A`, "
                             "and leave it unset for LLM and jaxserve serve")
        if mesh is None and config.parallel.data > 1:
            raise ValueError(f"parallel.data={config.parallel.data} runs one engine per replica: use LLM or "
                             "jaxserve.data_parallel.DataParallelEngine, or give each Engine its mesh")
        if config.speculative.enabled and config.parallel.expert > 1:
            raise ValueError("speculative decoding is not supported yet with parallel.expert > 1; leave "
                             "speculative_config unset there")
        if config.speculative.uses_model and config.parallel.num_processes > 1:
            raise ValueError(f"speculative.method={config.speculative.method} is not supported yet with "
                             f"parallel.num_processes > 1; use method ngram there")
        if config.speculative.uses_model and config.parallel.data > 1:
            raise ValueError(f"speculative.method={config.speculative.method} is not supported yet with "
                             f"parallel.data > 1; use method ngram there, or one replica")
        distributed.check_leader(config.parallel)
        self.config = config
        self.tp = distributed.engine_devices(config.parallel, mesh)
        # The tokenizer first: a missing one fails before the weights are loaded.
        tokenizer = None if config.model.skip_tokenizer_init else _load_tokenizer(config.model)
        start = time.monotonic()
        expert_parallel = self.tp is not None and self.tp.expert is not None
        # loads the model
        self.runner = ExpertParallelRunner(config, self.tp) if expert_parallel else ModelRunner(config, self.tp)
        model = self.runner.model
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = model.config.vocab_size
        self.sampling_defaults: dict[str, Any] = dict(model.generation.sampling)
        tokenizer_eos = tokenizer.eos_token_id if tokenizer is not None else None
        self.eos_token_ids = model.generation.eos_token_ids or ((tokenizer_eos,) if tokenizer_eos is not None else ())
        if config.parallel.num_processes > 1:
            self.runner = distributed.connect(self.runner, config.parallel)
        # One scheduler and KV cache manager per expert shard (one without expert parallelism): each shard
        # runs attention over its own requests and cache (core/sharded_scheduler.py).
        shards = self.tp.expert_size if expert_parallel else 1
        # KV cache tiers (host memory, disk) under the prefix cache: each shard its own, over one disk directory
        self.kv_transfer = kv_transfer.build(config, self.runner)
        shard_tiers = self.kv_transfer.shard_tiers if self.kv_transfer is not None else [None] * shards
        # (unseeded shards share one random key root: their disk-tier blocks are hits for each other)
        seed = config.cache.prefix_hash_seed
        if seed is None and shards > 1:
            seed = root_hash(None)
        kv_caches = [KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                    enable_caching=config.cache.enable_prefix_caching,
                                    hash_algo=config.cache.prefix_hash, hash_seed=seed,
                                    tiers=shard_tiers[shard])
                     for shard in range(shards)]
        schedulers = [Scheduler(config.scheduler, kv_cache, self.max_model_len,
                                max_prompt_logprob_rows=self.runner.max_prompt_logprob_rows,
                                first_row=shard * config.scheduler.max_num_seqs, speculative=config.speculative,
                                device_guesses=getattr(self.runner, "ngram", None) is not None)
                      for shard, kv_cache in enumerate(kv_caches)]
        self.kv_cache = kv_caches[0] if shards == 1 else ShardedKVCache(kv_caches)
        # The tiers' link(s) to the KV managers, as one for the mover (None without tiers)
        self.tier_link = (None if self.kv_transfer is None else kv_caches[0].tier_link if shards == 1
                          else ShardedTierLink([kv_cache.tier_link for kv_cache in kv_caches]))
        if self.kv_transfer is not None:
            for kv_cache in kv_caches:
                kv_cache.tier_link.load_budget = self.kv_transfer.load_budget
        self.scheduler = schedulers[0] if shards == 1 else ShardedScheduler(schedulers)
        self.num_compiled = self.runner.precompile(progress) if config.runner.precompile else 0
        if self.kv_transfer is not None and config.runner.precompile:
            self.num_compiled += self.kv_transfer.precompile()
        self.startup_seconds = time.monotonic() - start - self.runner.load_seconds  # compiling, not loading
        sched = config.scheduler
        self.input_processor = InputProcessor(
            tokenizer, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids, max_n=sched.max_n, max_logprobs=sched.max_logprobs,
            max_banned=MAX_BANNED, seed=config.model.seed)
        self.output_processor = OutputProcessor()
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        self.async_scheduling = sched.async_scheduling
        self._in_flight: tuple[SchedulerOutput, StepHandle] | None = None  # dispatched, not yet processed
        self._observers: list[StepObserver] = []
        self.rebalance_interval = config.parallel.rebalance_interval_steps if expert_parallel else 0
        self._steps_since_rebalance = 0
        self._closed = False
        self.step_recorder = StepStatsRecorder() if record_step_stats else None
        if self.step_recorder is not None:
            self.add_observer(self.step_recorder)

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The served tokenizer (None with model.skip_tokenizer_init), owned by the input processor; the
        output processor is handed it with each request."""
        return self.input_processor.tokenizer

    @property
    def model(self):
        """The loaded model (config, params, generation defaults): the runner's."""
        return self.runner.model

    @property
    def step_stats(self):
        """The step records of `record_step_stats` (a bounded deque of StepStats), else None."""
        return self.step_recorder.records if self.step_recorder is not None else None

    def add_observer(self, observer: StepObserver) -> None:
        self._observers.append(observer)

    def remove_observer(self, observer: StepObserver) -> None:
        self._observers.remove(observer)

    # ---- requests ----
    def new_request_id(self) -> str:
        return self.input_processor.new_request_id()

    def prepare_request(self, prompt: PromptType, params: SamplingParams | None = None, *,
                        request_id: str | None = None, priority: int = 0, cache_salt: str | None = None,
                        tenant: str | None = None, strict: bool = False) -> PreparedRequest:
        """Validate and tokenize; raises ValueError naming the parameter. Queues nothing. `strict`:
        max_tokens past the context raises instead of generation stopping at max_model_len."""
        return self.input_processor.prepare(prompt, params, request_id=request_id, priority=priority,
                                            cache_salt=cache_salt, tenant=tenant, strict=strict)

    def enqueue(self, prepared: PreparedRequest) -> None:
        if prepared.request_id in self.output_processor:
            raise ValueError(f"request id {prepared.request_id!r} is already in use")
        n = prepared.params.n
        child_ids = [prepared.request_id] if n == 1 else [f"{i}_{prepared.request_id}" for i in range(n)]
        requests = []
        for index, child_id in enumerate(child_ids):
            request = Request(child_id, prepared.prompt_token_ids, prepared.params, eos_token_ids=self.eos_token_ids,
                              max_tokens=prepared.max_tokens, arrival_time=prepared.arrival_time,
                              priority=prepared.priority, cache_salt=prepared.cache_salt,
                              seed=(prepared.seed + index) % 2**63, tenant=prepared.tenant)
            self.scheduler.add_request(request)
            requests.append(request)
        self.output_processor.add(prepared, requests, self.tokenizer)

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None, **kwargs: Any) -> str:
        prepared = self.prepare_request(prompt, params, **kwargs)
        self.enqueue(prepared)
        return prepared.request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            child_ids = self.output_processor.child_ids(request_id)
            if child_ids:
                self.scheduler.abort_requests(child_ids)
                self._pending.append(self.output_processor.abort(request_id))

    def has_unfinished_requests(self) -> bool:
        # NOTE: an in-flight step with no live request left (the overlap's extra step of requests that
        # finished) does not count: its tokens are dropped whenever the next step processes it.
        return self.output_processor.has_unfinished() or bool(self._pending)

    def stats(self) -> EngineStats:
        kv = self.kv_cache.stats
        expert = {}
        if isinstance(self.runner, ExpertParallelRunner):  # (the last processed step's copy: never waits)
            load = self.runner.collected_expert_load()
            expert = dict(expert_load=tuple(map(tuple, load.tolist())), expert_device_load_max_over_mean=tuple(
                eplb.max_mean_device_load(load, self.runner.host_placement).tolist()))
        usage = self.kv_cache.usage
        tier_usage = self.kv_cache.tier_usage if self.kv_transfer is not None else (("device", usage),)
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), usage,
                           kv.queries, kv.hits, self.scheduler.num_preemptions, **expert,
                           spec_draft_tokens=self.scheduler.num_draft_tokens,
                           spec_accepted_tokens=self.scheduler.num_accepted_tokens,
                           spec_drafts=self.scheduler.num_drafts,
                           spec_accepted_per_position=tuple(self.scheduler.accepted_per_position),
                           kv_cache=kv, kv_tier_usage=tier_usage)

    def close(self) -> None:
        """Shuts the engine down: the step in flight is finished (its outputs dropped) and, with a disk tier,
        every KV block cached on the device or the host tier that the disk lacks is written there, so that a
        restart, or another engine with the same cache.prefix_hash_seed, finds it. Takes no more steps."""
        if self._in_flight is not None:
            previous, self._in_flight = self._in_flight, None
            self._process(*previous, final_only=True)
        if self.kv_transfer is not None and not self._closed:
            self.kv_transfer.close(self.tier_link)
        self._closed = True

    # ---- one step ----
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One engine step. Returns a RequestOutput for each request that changed, or, with
        `final_only`, only for those that finished (offline generation: no per-step copies of every
        running request's tokens and text).

        With async_scheduling (overlap), this dispatches step N+1 and then processes step N, whose
        device work ran while the host scheduled and prepared N+1 (docs/ARCHITECTURE.md §4).
        """
        if self._closed:
            raise RuntimeError("the engine is closed (Engine.close); make a new one")
        if self.rebalance_interval and self._steps_since_rebalance >= self.rebalance_interval:
            self.rebalance_experts(final_only)
        outputs, self._pending = self._pending, []
        t_start = time.perf_counter()
        if self.kv_transfer is not None:  # copies that landed on host: found by this schedule()
            self.kv_transfer.poll(self.tier_link)
        out = self.scheduler.schedule() if self.scheduler.has_unfinished_requests() else None
        if self.kv_transfer is not None:  # blocks evicted or swapped to host / loaded back: before the forward
            moves = self.tier_link.take()
            if moves:
                self.kv_transfer.run(moves)
        current = None
        if out is not None and not out.is_empty:
            t_scheduled = time.perf_counter()
            handle = self.runner.dispatch(out)
            for observer in self._observers:
                observer.on_dispatch(out, handle, t_start, t_scheduled)
            current = (out, handle)
            self._steps_since_rebalance += 1
        previous = current
        if self.async_scheduling:
            previous, self._in_flight = self._in_flight, current
        if previous is not None:
            outputs += self._process(*previous, final_only)
        return outputs

    def rebalance_experts(self, final_only: bool = False) -> eplb.Placement:
        """Expert parallelism: rebalance the expert placement by the load measured since the last rebalance
        (core/eplb.rebalance: hot experts replicated into the redundant slots, replicas packed by load), move
        the expert weights and swap the placement tables. Runs between steps: the step in flight, if any, is
        processed first (its outputs come with the next step()), so no step reads weights while they move.
        Compiles nothing after the first call. Returns the new core/eplb.Placement."""
        if not isinstance(self.runner, ExpertParallelRunner):
            raise ValueError("rebalance_experts needs expert parallelism: set parallel.expert > 1 on an MoE model")
        if self._in_flight is not None:
            previous, self._in_flight = self._in_flight, None
            self._pending += self._process(*previous, final_only)
        self._steps_since_rebalance = 0
        return self.runner.rebalance()

    def _process(self, out: SchedulerOutput, handle: StepHandle, final_only: bool) -> list[RequestOutput]:
        """Reads a dispatched step's tokens back and turns them into request outputs."""
        t_collect = time.perf_counter()
        runner_output = self.runner.collect(handle)
        t_collected = time.perf_counter()
        if runner_output.prompt_logprobs:  # before the outputs that carry them
            self.output_processor.add_prompt_logprobs(runner_output.prompt_logprobs)
        updates = self.scheduler.update_from_output(out, runner_output)
        outputs, stopped = self.output_processor.process(updates, final_only)
        if stopped:  # by a stop string: the scheduler frees them now
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        for observer in self._observers:
            observer.on_processed(out, t_collect, t_collected)
        return outputs
