"""Expert parallelism's steps: one sub-batch per expert shard, stacked shard-major, in one SPMD program.

    ShardedSchedulerOutput (one SchedulerOutput per shard; disjoint runner rows, shard-local block ids)
      --ModelRunner.step_rows per shard--> layouts
      --common (T, R) buckets, the largest shard's--> ModelRunner.fill_batch per shard --stack-->
      ModelBatch of [n, T] / [n, R] / [n, R, max_blocks] arrays + prev_index [n, T], split over "expert"
      --llama.forward: attention and dense layers per shard on its own KV cache [n, ...], MoE layers
        exchange routed tokens over the expert axis (sharding/expert_parallel.py), placement tables as an
        argument--> logits [n * R, V] shard-major --sample--> tokens [n * R]
    shard s's i-th sampling request reads token s * R + i (HostStep.index); the RunnerOutput lists the
    shards' requests shard after shard, which ShardedScheduler.update_from_output splits again.

Everything else (row state, overlap through prev_index, staging into donated buffers, the sampler, the
bucketed precompile) is ModelRunner's: every shard pads to the same (T, R) bucket, so the shapes a step
compiles are ModelRunner's bucket ladder, each field with a leading shard axis. Prompt logprobs are
not supported here yet (ShardedScheduler refuses such requests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.config import EngineConfig
from jaxserve.core import eplb
from jaxserve.core.eplb import Placement
from jaxserve.core.sharded_scheduler import ShardedSchedulerOutput
from jaxserve.models import loader
from jaxserve.models.layers import ModelBatch
from jaxserve.models.loader import LoadedModel
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.step_types import HostStep, StepHandle
from jaxserve.runner.step_program import sharded_stage_fn
from sharding import TensorParallel
from sharding.expert_parallel import ExpertParallel
from sharding.tensor_parallel import zeros


def check_expert_parallel_model(model_config, expert: int) -> None:
    """ValueError unless the model has MoE layers for parallel.expert to shard."""
    if getattr(model_config, "moe", None) is None:
        raise ValueError(f"parallel.expert={expert} shards the experts of MoE layers, but {model_config.architecture} "
                         f"has none; set parallel.expert to 1 (parallel.data runs data-parallel replicas)")


class ExpertParallelRunner(ModelRunner):
    """ModelRunner over an [expert, model] mesh (tp.expert set): `dispatch` takes a ShardedSchedulerOutput."""

    supports_prompt_logprobs = False  # refused per request under expert parallelism

    def __init__(self, config: EngineConfig, tp: TensorParallel, *, model: LoadedModel | None = None):
        check_expert_parallel_model(model.config if model is not None else loader.load_config(config.model.path)[0],
                                    tp.expert_size)
        super().__init__(config, tp, model=model)
        self.batch_sharding = self.logits_sharding = NamedSharding(tp.mesh, PartitionSpec(tp.expert.axis))
        self.stage_fn = sharded_stage_fn(self.batch_sharding)
        self.tokens_sharding = self.on_device  # the next step's stage reads them whole
        spec = self.cfg.moe
        self.host_placement = tp.expert.default_placement(len(spec.sparse_layers), spec.num_experts, self.num_shards)
        self.placement = jax.device_put(self.host_placement, self.on_device)
        # tokens per logical expert of each MoE layer since the last rebalance, [L, E] int32: every step
        # adds its own (the forward's donated argument and last output; no host sync in the step)
        self._load_shape = (len(spec.sparse_layers), spec.num_experts)
        self.expert_load = zeros(self._load_shape, jnp.int32, self.on_device)
        self.step_expert_load = None  # the copy of it that the last dispatched step returned
        self._collected_load = None  # ... and the last collected step's (None: no step since the rebalance)
        self._expert_parallel = ExpertParallel(tp.mesh, tp.expert.axis)

    def precompile(self, progress: bool = True) -> int:
        """ModelRunner.precompile, then the load count restarted: its warm-up's tokens are not served load."""
        count = super().precompile(progress)
        self._restart_load()
        return count

    def _restart_load(self) -> None:
        self.expert_load, self._collected_load = zeros(self._load_shape, jnp.int32, self.on_device), None

    def dispatch(self, out: ShardedSchedulerOutput) -> StepHandle:
        handle = super().dispatch(out)
        handle.expert_load = self.step_expert_load
        return handle

    def _collect(self, handle: StepHandle) -> None:
        super()._collect(handle)
        self._collected_load = handle.expert_load

    def collected_expert_load(self) -> np.ndarray:
        """The load accumulated since the last rebalance up to the last collected step, [L, E] int64: read
        from that step's own copy (on the host already, or arriving: the step is done), so it never waits
        for a step in flight."""
        if self._collected_load is None:
            return np.zeros(self._load_shape, np.int64)
        return np.asarray(self._collected_load).astype(np.int64)

    def read_expert_load(self) -> np.ndarray:
        """The load accumulated since the last rebalance, [L, E] int64 on the host. Waits for the steps
        already dispatched: call it between steps with none in flight (Engine does) so nothing stalls."""
        return np.asarray(self.expert_load).astype(np.int64)

    def rebalance(self, load: np.ndarray | None = None) -> Placement:
        """A new placement for `load` (default: the accumulated load) by eplb.rebalance; moves every MoE
        layer's expert weights into it (ExpertParallel.apply_placement, donated), swaps the placement
        tables and resets the accumulator (an unchanged placement moves nothing). Every array keeps its shape
        and sharding, so nothing compiles after the first move. Call it with no step in flight (the step
        would read the old weights)."""
        load = self.read_expert_load() if load is None else load
        new_host = eplb.rebalance(load, self.host_placement)
        self._restart_load()
        if np.array_equal(new_host.phys_to_logical, self.host_placement.phys_to_logical):
            return self.host_placement  # (already the best placement found: no weight moves)
        new = jax.device_put(new_host, self.on_device)
        for row, layer in enumerate(self.cfg.moe.sparse_layers):
            lp = self.model.params["layers"][layer]
            shardings = (lp["we_gate_up"].sharding, lp["we_down"].sharding)
            moved = self._expert_parallel.apply_placement((lp["we_gate_up"], lp["we_down"]), self.placement, new,
                                                          layer=row)
            # apply_placement splits only the expert axis: an expert's F split over "model" is put back
            lp["we_gate_up"], lp["we_down"] = (w if w.sharding == sharding else jax.device_put(w, sharding)
                                               for w, sharding in zip(moved, shardings))
        self.placement, self.host_placement = new, new_host
        return new_host

    def _host_batch(self, t_pad: int, r_pad: int) -> ModelBatch:
        one = super()._host_batch(t_pad, r_pad)
        return ModelBatch(*(np.zeros((self.num_shards, *a.shape), a.dtype) for a in one))

    def prepare(self, out: ShardedSchedulerOutput) -> HostStep:
        layouts = [self.step_rows(shard_out) for shard_out in out.shards]
        t_pad = self.buckets.pad_tokens(max(layout.num_tokens for layout in layouts))
        r_pad = self.buckets.pad_requests(max(len(layout.rows) for layout in layouts))
        decode_only = all(bool((layout.counts == 1).all()) for layout in layouts)
        filled = [self.fill_batch(layout, t_pad, r_pad) for layout in layouts]
        batch = ModelBatch(*(np.stack(field) for field in zip(*(shard_batch for shard_batch, _ in filled))))
        prev_index = np.stack([shard_prev for _, shard_prev in filled])
        sample_rows = np.concatenate([layout.rows[layout.sample_index] for layout in layouts])
        index = np.concatenate([shard * r_pad + np.arange(len(layout.sample_index))
                                for shard, layout in enumerate(layouts)])
        request_ids = [request_id for shard_out in out.shards
                       for request_id in shard_out.decode_ids + [i.request_id for i in shard_out.scheduled if i.samples]]
        sampling = (self._sampling_metadata(sample_rows, r_pad * self.num_shards, index) if len(sample_rows)
                    else None)
        self.row_prev_index[sample_rows] = index
        self.row_pending[sample_rows] += 1
        return HostStep(batch, prev_index, sample_rows, self.row_generation[sample_rows], request_ids, sampling,
                        decode_only, None, index)
