"""The engine loop: add_request / step / abort_request.

    add_request: validate (before anything is queued) -> tokenize -> n child Requests -> scheduler
    step():      scheduler.schedule() -> runner.dispatch() (step N+1, returns at once)
                 then, for step N: runner.collect() -> scheduler.update_from_output()
                 -> per child OutputStream (detokenize, stop strings) -> RequestOutputs
                 (without async_scheduling, step N is collected right after its own dispatch)

A request with n > 1 becomes n children ("{i}_{id}") that share the prompt; the first child's
prompt blocks are registered in the prefix cache when allocated, so the others hit them.
Every bad input raises ValueError naming the parameter; nothing is queued in that case, so the
engine keeps serving.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import queue
import random
import threading
import time
from typing import Any

from jax.sharding import Mesh

from jaxserve import distributed
from jaxserve.config import EngineConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.sched_types import SchedulerOutput
from jaxserve.core.scheduler import Scheduler
from jaxserve.models import llama, loader
from jaxserve.outputs import OutputStream, PromptLogprobsStream, RequestMetrics, RequestOutput
from jaxserve.request import Request, RequestStatus
from jaxserve.runner.model_runner import MAX_BANNED, ModelRunner, StepHandle
from jaxserve.sampling_params import SamplingParams
from jaxserve.step_stats import StepStats
from jaxserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PreparedRequest:
    """A validated request, ready to enqueue."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    seed: int
    priority: int
    cache_salt: str | None
    arrival_time: float
    tenant: str | None = None


@dataclasses.dataclass
class _Parent:
    prepared: PreparedRequest
    child_ids: list[str]
    requests: list[Request]
    streams: list[OutputStream]
    metrics: RequestMetrics
    finished: set[str] = dataclasses.field(default_factory=set)
    prompt_logprobs: PromptLogprobsStream | None = None  # with SamplingParams.prompt_logprobs


class Engine:
    def __init__(self, config: EngineConfig, progress: bool = True, record_step_stats: bool = False,
                 mesh: Mesh | None = None):
        """`mesh`: this engine's devices (a data-parallel replica's [1, model] mesh); by default the first
        parallel.model devices. With parallel.num_processes > 1 only process 0 returns from here: the
        others follow its steps, then exit (jaxserve/distributed.py)."""
        if mesh is None and config.parallel.data > 1:
            raise ValueError(f"parallel.data={config.parallel.data} runs one engine per replica: use LLM or "
                             "jaxserve.data_parallel.DataParallelEngine, or give each Engine its mesh")
        self.config = config
        self.tp = distributed.engine_devices(config.parallel, mesh)
        self.model = loader.load_model(config.model.path, dtype=config.model.dtype,
                                       load_format=config.model.load_format,
                                       place=llama.param_placer(self.tp) if self.tp is not None else None)
        self.tokenizer = (None if config.model.skip_tokenizer_init
                          else Tokenizer.from_dir(config.model.tokenizer or config.model.path))
        limit = self.model.config.max_position_embeddings
        self.max_model_len = config.model.max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(f"model.max_model_len={self.max_model_len} exceeds the model's max_position_embeddings "
                             f"({limit}); lower max_model_len")
        self.vocab_size = self.model.config.vocab_size
        tokenizer_eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        self.eos_token_ids = self.model.generation.eos_token_ids or (
            (tokenizer_eos,) if tokenizer_eos is not None else ())
        start = time.monotonic()
        self.runner = ModelRunner(self.model, config, self.max_model_len, self.tp)
        if config.parallel.num_processes > 1:
            self.runner = distributed.connect(self.runner, config.parallel)
        self.kv_cache = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                       enable_caching=config.cache.enable_prefix_caching,
                                       hash_algo=config.cache.prefix_hash)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.max_model_len)
        self.num_compiled = self.runner.precompile(progress) if config.runner.precompile else 0
        self.startup_seconds = time.monotonic() - start
        self._seeds = random.Random(config.model.seed)
        self._ids = itertools.count()
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, tuple[str, int]] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        self.async_scheduling = config.scheduler.async_scheduling
        self._in_flight: tuple[SchedulerOutput, StepHandle] | None = None  # dispatched, not yet processed
        # Per-step timings for `jaxserve bench`, when asked for (a watcher thread stamps device completion).
        self.step_stats: collections.deque[StepStats] | None = None
        if record_step_stats:
            self.step_stats = collections.deque(maxlen=100_000)
            self._stats_by_step: dict[int, StepStats] = {}
            self._watch_queue: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=self._watch_device, name="jaxserve-step-watcher", daemon=True).start()

    # ---- requests ----
    def new_request_id(self) -> str:
        return str(next(self._ids))

    def prepare_request(self, prompt: str | dict[str, Any] | list[int], params: SamplingParams | None = None, *,
                        request_id: str | None = None, priority: int = 0,
                        cache_salt: str | None = None, tenant: str | None = None) -> PreparedRequest:
        """Validate and tokenize; raises ValueError naming the parameter. Queues nothing."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.verify_against_engine(max_n=self.config.scheduler.max_n, max_logprobs=self.config.scheduler.max_logprobs,
                                     vocab_size=self.vocab_size)
        if self.tokenizer is None and (params.stop or not isinstance(prompt, dict)):
            raise ValueError("this engine runs without a tokenizer (skip_tokenizer_init): pass prompts as "
                             "{'prompt_token_ids': [...]} and no stop strings")
        text, token_ids = self._tokenize(prompt)
        if isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt", cache_salt)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string")
        if not token_ids:
            raise ValueError("prompt must not be empty")
        bad = next((t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size),
                   None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad!r} is out of vocabulary (vocab_size {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(token_ids)}) is longer than the maximum model length of "
                f"{self.max_model_len} minus one generated token. Make sure that max_model_len is no smaller than the "
                f"number of text tokens plus one, or shorten the prompt.")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(token_ids)
        if len(token_ids) + max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens={max_tokens} plus the prompt's {len(token_ids)} tokens exceeds max_model_len="
                f"{self.max_model_len}; lower max_tokens or shorten the prompt")
        if params.min_tokens > 0 and len(self.eos_token_ids) + len(params.stop_token_ids) > MAX_BANNED:
            raise ValueError(f"stop_token_ids: at most {MAX_BANNED - len(self.eos_token_ids)} stop token ids are "
                             f"supported together with min_tokens > 0")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        return PreparedRequest(request_id or self.new_request_id(), text, token_ids, params, max_tokens, seed,
                               priority, cache_salt, time.monotonic(), tenant)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt and isinstance(prompt["prompt"], str) and self.tokenizer is not None:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' (str) or 'prompt_token_ids' (list of int)")
        raise ValueError(f"prompt must be a string or a dict with prompt_token_ids, got {type(prompt).__name__}")

    def enqueue(self, prepared: PreparedRequest) -> None:
        if prepared.request_id in self._parents:
            raise ValueError(f"request id {prepared.request_id!r} is already in use")
        n = prepared.params.n
        child_ids = [prepared.request_id] if n == 1 else [f"{i}_{prepared.request_id}" for i in range(n)]
        streams, requests = [], []
        for index, child_id in enumerate(child_ids):
            request = Request(child_id, prepared.prompt_token_ids, prepared.params, eos_token_ids=self.eos_token_ids,
                              max_tokens=prepared.max_tokens, arrival_time=prepared.arrival_time,
                              priority=prepared.priority, cache_salt=prepared.cache_salt,
                              seed=(prepared.seed + index) % 2**63, tenant=prepared.tenant)
            self.scheduler.add_request(request)
            requests.append(request)
            params = prepared.params if self.tokenizer is not None else dataclasses.replace(
                prepared.params, detokenize=False)
            streams.append(OutputStream(self.tokenizer, params, prepared.prompt_token_ids, index))
            self._child_to_parent[child_id] = (prepared.request_id, index)
        prompt_logprobs = None
        if prepared.params.prompt_logprobs is not None:
            prompt_logprobs = PromptLogprobsStream(self.tokenizer if prepared.params.detokenize else None,
                                                   prepared.prompt_token_ids)
        self._parents[prepared.request_id] = _Parent(prepared, child_ids, requests, streams,
                                                     RequestMetrics(prepared.arrival_time),
                                                     prompt_logprobs=prompt_logprobs)

    def add_request(self, prompt, params: SamplingParams | None = None, **kwargs) -> str:
        prepared = self.prepare_request(prompt, params, **kwargs)
        self.enqueue(prepared)
        return prepared.request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self._parents.get(request_id)
            if parent is None:
                continue
            self.scheduler.abort_requests(parent.child_ids)
            for child_id, stream in zip(parent.child_ids, parent.streams):
                if child_id not in parent.finished:
                    stream.finish("abort", None)
                    parent.finished.add(child_id)
            self._pending.append(self._output(parent))

    def has_unfinished_requests(self) -> bool:
        # NOTE: an in-flight step with no live request left (the overlap's extra step of requests that
        # finished) does not count: its tokens are dropped whenever the next step processes it.
        return bool(self._parents) or bool(self._pending)

    # ---- one step ----
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One engine step. Returns a RequestOutput for each request that changed, or, with
        `final_only`, only for those that finished (offline generation: no per-step copies of every
        running request's tokens and text).

        With async_scheduling (overlap), this dispatches step N+1 and then processes step N, whose
        device work ran while the host scheduled and prepared N+1 (DESIGN §7).
        """
        outputs, self._pending = self._pending, []
        t_start = time.perf_counter()
        out = self.scheduler.schedule() if self.scheduler.has_unfinished_requests() else None
        handle = None
        if out is not None and not out.is_empty:
            t_scheduled = time.perf_counter()
            handle = self.runner.dispatch(out)
            if self.step_stats is not None:
                self._record_dispatch(out, handle, t_start, t_scheduled)
        current = (out, handle) if handle is not None else None
        if self.async_scheduling:
            previous, self._in_flight = self._in_flight, current
        else:
            previous = current
        if previous is not None:
            outputs += self._process(*previous, final_only)
        return outputs

    def _process(self, out: SchedulerOutput, handle: StepHandle, final_only: bool) -> list[RequestOutput]:
        """Reads a dispatched step's tokens back and turns them into request outputs."""
        t_collect = time.perf_counter()
        runner_output = self.runner.collect(handle)
        t_collected = time.perf_counter()
        changed: dict[str, _Parent] = {}
        now = time.monotonic()
        for chunk in runner_output.prompt_logprobs or ():  # before the outputs that carry them
            parent = self._parents.get(self._child_to_parent.get(chunk.request_id, ("", 0))[0])
            if parent is not None and parent.prompt_logprobs is not None:
                parent.prompt_logprobs.add(chunk)
        updates = self.scheduler.update_from_output(out, runner_output)
        finished, logprobs = updates.finished, updates.logprobs
        for i, (request, token) in enumerate(zip(updates.requests, updates.tokens)):
            request_id = request.request_id
            parent_id, index = self._child_to_parent[request_id]
            parent = self._parents[parent_id]
            stream = parent.streams[index]
            status, stop_reason = finished.get(request_id, (None, None)) if finished else (None, None)
            by_token = status == RequestStatus.FINISHED_STOPPED
            token_logprobs = logprobs[i] if logprobs is not None else None
            stop_str = stream.append([token], [token_logprobs] if token_logprobs else None, by_token)
            if stop_str is not None and status is None:
                self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_STOPPED)
                status, stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
            if status is not None:
                stream.finish(status.finish_reason, stop_reason)
                parent.finished.add(request_id)
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
            changed[parent_id] = parent
        outputs = [self._output(parent) for parent in changed.values()
                   if not final_only or len(parent.finished) == len(parent.child_ids)]
        if self.step_stats is not None and out.step in self._stats_by_step:
            stats = self._stats_by_step.pop(out.step)
            stats.readback_s = t_collected - t_collect
            stats.t_end = time.perf_counter()
            stats.update_s = stats.t_end - t_collected
        return outputs

    # ---- step timings (bench) ----
    def _record_dispatch(self, out: SchedulerOutput, handle: StepHandle, t_start: float, t_scheduled: float) -> None:
        now = time.perf_counter()
        stats = StepStats(out.step, out.num_scheduled_tokens, len(out.decode_rows) + len(out.scheduled),
                          out.num_scheduled_tokens - len(out.decode_rows), t_start, t_scheduled - t_start,
                          now - t_scheduled, now)
        self.step_stats.append(stats)
        self._stats_by_step[out.step] = stats
        self._watch_queue.put((stats, handle.ready))

    def _watch_device(self) -> None:
        """Watcher thread: stamps each step's device completion time (StepStats.done_t)."""
        while True:
            stats, ready = self._watch_queue.get()
            ready.block_until_ready()
            stats.done_t = time.perf_counter()

    def _output(self, parent: _Parent) -> RequestOutput:
        finished = len(parent.finished) == len(parent.child_ids)
        prepared = parent.prepared
        if finished:
            parent.metrics.finished_time = time.monotonic()
            del self._parents[prepared.request_id]
            for child_id in parent.child_ids:
                self._child_to_parent.pop(child_id, None)
        return RequestOutput(prepared.request_id, prepared.prompt, prepared.prompt_token_ids,
                             [stream.completion_output() for stream in parent.streams], finished,
                             max(parent.requests[0].num_cached_tokens, 0),
                             parent.prompt_logprobs.result() if parent.prompt_logprobs is not None else None,
                             metrics=parent.metrics)
