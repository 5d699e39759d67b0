"""Data parallelism: parallel.data engine replicas on disjoint device groups behind one Engine-like facade.

    parallel {data, model} --make_mesh [data, model]--> replica_meshes --> one Engine per row [1, model]
    add_request / enqueue: validated once (by replica 0) --RequestDistributor.choose--> one replica
    step(): every busy replica steps, in its own thread (their device work overlaps) -> outputs merged
    abort_request: to the replica holding the request

The distributor balances by load: the tokens a replica's unfinished requests hold or will hold
(prompt + max_tokens, for each of the n sequences). It prefers the replica that already served
the request's prefix: it remembers each replica's recent full-block chains (block_size tokens,
chained like the prefix cache's keys, salted by cache_salt) and sends a request to the replica
with the longest match, unless that replica's load exceeds the least loaded one's by more than
`max_imbalance` tokens (default: one step's token budget). It cannot see evictions inside a
replica, so a preference is a guess that costs nothing when wrong.

KV cache tiers: each replica has its own host tier of cache.host_kv_gib (host memory taken is parallel.data
times that) and all share the disk tier's directory, so a block one replica wrote is a disk hit for the
others. Without cache.prefix_hash_seed the replicas share one random key root (drawn here), so their keys
agree with each other's and no one else's.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import secrets
from concurrent.futures import ThreadPoolExecutor

from jaxserve.config import EngineConfig
from jaxserve.engine import Engine
from jaxserve.engine_client import EngineStats, PreparedRequest
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer
from sharding import make_mesh, replica_meshes

MAX_PREFIX_BLOCKS = 64  # blocks of a prompt's prefix the distributor compares
MAX_REMEMBERED_BLOCKS = 1 << 16  # chain keys remembered per replica (least recently used dropped)


class RequestDistributor:
    """Chooses the replica of each request: the prefix holder when its load allows, else the least loaded."""

    def __init__(self, num_replicas: int, block_size: int, max_imbalance: int):
        self.block_size = block_size
        self.max_imbalance = max_imbalance
        self.loads = [0] * num_replicas
        self._chains: list[collections.OrderedDict[int, None]] = [collections.OrderedDict()
                                                                   for _ in range(num_replicas)]

    def _chain(self, token_ids: list[int], cache_salt: str | None) -> list[int]:
        keys, parent = [], hash(("jaxserve-prefix", cache_salt))
        full = min(len(token_ids) // self.block_size, MAX_PREFIX_BLOCKS)
        for start in range(0, full * self.block_size, self.block_size):
            parent = hash((parent, tuple(token_ids[start: start + self.block_size])))
            keys.append(parent)
        return keys

    def _matched(self, replica: int, keys: list[int]) -> int:
        chains = self._chains[replica]
        return next((i for i, key in enumerate(keys) if key not in chains), len(keys))

    def choose(self, token_ids: list[int], cache_salt: str | None, cost: int) -> int:
        """The replica for a request of `cost` tokens; its load grows by `cost` until `release`."""
        keys = self._chain(token_ids, cache_salt)
        least = min(range(len(self.loads)), key=lambda i: (self.loads[i], i))
        matches = [self._matched(i, keys) for i in range(len(self.loads))]
        holder = max(range(len(self.loads)), key=lambda i: (matches[i], -self.loads[i], -i))
        replica = holder if matches[holder] and self.loads[holder] - self.loads[least] <= self.max_imbalance else least
        self.loads[replica] += cost
        chains = self._chains[replica]
        for key in keys:
            chains[key] = None
            chains.move_to_end(key)
        while len(chains) > MAX_REMEMBERED_BLOCKS:
            chains.popitem(last=False)
        return replica

    def release(self, replica: int, cost: int) -> None:
        self.loads[replica] -= cost


class DataParallelEngine:
    """An engine client (engine_client.EngineClient, as Engine) over parallel.data replicas: what `LLM` and
    `jaxserve serve` call. One thread drives it, as an Engine; stats() combines the replicas'."""

    def __init__(self, config: EngineConfig, progress: bool = True):
        parallel = config.parallel
        if parallel.num_processes > 1:
            raise ValueError("parallel.data > 1 runs in one process; set parallel.num_processes to 1")
        meshes = replica_meshes(make_mesh(parallel.data, parallel.model, expert=parallel.expert))
        if config.cache.disk_kv_path is not None and config.cache.prefix_hash_seed is None:
            config = dataclasses.replace(config, cache=dataclasses.replace(config.cache,
                                                                           prefix_hash_seed=secrets.randbits(63)))
        self.engines = [Engine(config, progress, mesh=mesh) for mesh in meshes]
        first = self.engines[0]
        self.config, self.model = config, first.model
        self.max_model_len, self.vocab_size = first.max_model_len, first.vocab_size
        self.sampling_defaults = first.sampling_defaults
        self.eos_token_ids = first.eos_token_ids
        self.distributor = RequestDistributor(len(self.engines), config.cache.block_size,
                                              config.scheduler.max_num_batched_tokens)
        self._owners: dict[str, tuple[int, int]] = {}  # request id -> (replica, cost)
        self._ids = itertools.count()
        self._pool = ThreadPoolExecutor(len(self.engines), thread_name_prefix="jaxserve-replica")

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The replicas' tokenizer (the first one's prepares every request)."""
        return self.engines[0].tokenizer

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def prepare_request(self, prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                        **kwargs) -> PreparedRequest:
        """Validate and tokenize (every replica would answer the same); queues nothing."""
        return self.engines[0].prepare_request(prompt, params, request_id=request_id or self.new_request_id(),
                                               **kwargs)

    def enqueue(self, prepared: PreparedRequest) -> None:
        if prepared.request_id in self._owners:
            raise ValueError(f"request id {prepared.request_id!r} is already in use")
        cost = (len(prepared.prompt_token_ids) + prepared.max_tokens) * prepared.params.n
        replica = self.distributor.choose(prepared.prompt_token_ids, prepared.cache_salt, cost)
        try:
            self.engines[replica].enqueue(prepared)
        except Exception:
            self.distributor.release(replica, cost)
            raise
        self._owners[prepared.request_id] = (replica, cost)

    def add_request(self, prompt, params: SamplingParams | None = None, **kwargs) -> str:
        prepared = self.prepare_request(prompt, params, **kwargs)
        self.enqueue(prepared)
        return prepared.request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            owner = self._owners.get(request_id)
            if owner is not None:
                self.engines[owner[0]].abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(engine.has_unfinished_requests() for engine in self.engines)

    def stats(self) -> EngineStats:
        return EngineStats.combine([engine.stats() for engine in self.engines])

    def close(self) -> None:
        for engine in self.engines:
            engine.close()

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One step of every replica that has work, concurrently; their outputs, replica by replica."""
        busy = [engine for engine in self.engines if engine.has_unfinished_requests()]
        outputs = [output for replica_outputs in self._pool.map(lambda e: e.step(final_only=final_only), busy)
                   for output in replica_outputs]
        for output in outputs:
            if output.finished:
                replica, cost = self._owners.pop(output.request_id)
                self.distributor.release(replica, cost)
        return outputs
