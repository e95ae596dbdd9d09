"""`Engine`: a built model that trains. `train_step` runs one optimizer step over this rank's
micro-batches of a global batch, `evaluate` the loss of batches, `state_dict` /
`load_state_dict` give and take the whole training state as plain data and sharded tensors
(`engine.checkpointing` converts it to the checkpoint format), `describe` says what it is.
`engine.build.build` makes one from a config."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastllm.checkpoint.distributed import STATE_KINDS
from fastllm.config import TrainerConfig
from fastllm.config.layout import RunLayout
from fastllm.data import Batch
from fastllm.engine.activation_offload import ActivationOffload
from fastllm.engine.batch import BatchPreparer
from fastllm.engine.checkpointing import (
    FP8_PREFIX,
    EngineState,
    TrainingState,
    restore_split_masters,
    sharded_state,
)
from fastllm.engine.data_parallel import gather_weights
from fastllm.engine.learning_rate import phased_learning_rate
from fastllm.engine.model_stages import ModelStages
from fastllm.engine.optimizer import AdamW
from fastllm.engine.precision import LossScaler
from fastllm.engine.reference import ReferenceModel, build_references
from fastllm.engine.replicated_check import check_replicated
from fastllm.engine.schedule.runner import StepRunner
from fastllm.engine.weights_io import whole_parameters
from fastllm.model import GPTModel
from fastllm.model.mlp import take_expert_load, take_step_loads
from fastllm.model.routing import bias_update
from fastllm.parallel.mesh import ParallelMesh
from fastllm.parallel.process_group import Distributed
from fastllm_kernels.fp8.amax_history import AmaxHistories


@dataclass
class Engine:
    """A model that trains on this process, made by `build(config)`: the model with its
    parameters as views of sharded flat buffers, the step's program, AdamW, the loss scale and
    the `state` counters. Every rank of the run makes its own and calls the same methods in the
    same order."""

    config: TrainerConfig
    distributed: Distributed
    layout: RunLayout
    """Every size of the run: the mesh's, the step's micro-batches and stages."""
    mesh: ParallelMesh
    model: GPTModel
    stages: ModelStages
    """The parameters in their flat buffers, by stage and group."""
    offload: ActivationOffload | None
    fp8_histories: AmaxHistories | None
    """The amax histories of delayed FP8 scaling."""
    batches: BatchPreparer
    runner: StepRunner
    """Runs every step's program (one stage for the whole model, or the pipeline's)."""
    optimizer: AdamW
    scaler: LossScaler
    state: TrainingState
    """Where the run is: optimizer steps, consumed samples, skipped steps."""
    references: dict[str, ReferenceModel] = field(default_factory=dict)
    """The frozen models the head losses read in the step (`reference_models` but those whose
    log-probabilities are precomputed)."""
    _named: Tensor | None = field(default=None, repr=False)
    """The last passes' head losses, by `runner.losses` order, until taken."""

    # --- steps --------------------------------------------------------------------------------

    def train_step(self, micro_batches: Sequence[Batch]) -> dict[str, Any]:
        """One optimizer step over this rank's micro-batches of a global batch. Returns `loss`
        (the mean over the trained tokens of the whole global batch, whatever the
        micro-batching, the pieces and the data-parallel split), `lr`, `grad_norm` and
        `skipped` (whether the update was skipped for a gradient that was not finite)."""
        loss = self.forward_backward(micro_batches)
        metrics = self.optimizer_step()  # queued before the loss is read: no wait in between
        return {"loss": loss.item(), **self.take_named_losses(), **metrics}

    def forward_backward(self, micro_batches: Sequence[Batch]) -> Tensor:
        """The forward and backward passes of `micro_batches` (a step's; any number without
        pipelining or breadth-first micro-batches), their gradients added to the buffers, each
        piece's weighted by its share of the micro-batches' trained tokens over every data
        rank; their mean loss over those tokens. `train_step` is this then `optimizer_step`."""
        prepared = self.batches.prepare(micro_batches)
        weighted = self.runner.run(prepared, self.scaler.scale)
        summed = self._data_sum(self._pipeline_sum(self._with_named(weighted)))
        self._named = summed[1:]
        return summed[0]

    def take_named_losses(self) -> dict[str, float]:
        """The last passes' head losses when there are several (NAME_loss, each its mean over
        the global batch, unweighted, as `forward_backward` and `evaluate` return the total)
        and DPO's metrics (TRL's names, means over the pairs)."""
        if self._named is None:
            return {}
        values, self._named = self._named.tolist(), None
        losses = self.runner.losses
        named = dict(zip(self.runner.named_keys, values, strict=True))
        return {
            (f"{key}_loss" if key in losses else key): value
            for key, value in named.items()
            if key not in losses or len(losses) > 1
        }

    def _with_named(self, total: Tensor) -> Tensor:
        """[total, each head loss's and metric's part on this rank] (zeros on ranks that hold
        no head): one reduction for all."""
        named = self.runner.named_losses
        parts = [named.get(key, torch.zeros_like(total)) for key in self.runner.named_keys]
        return torch.stack([total, *(part.to(total.dtype) for part in parts)])

    def optimizer_step(self) -> dict[str, Any]:
        """Clip, update (unless the gradient is not finite), advance the schedule and the data
        position by a global batch."""
        metrics = self._optimizer_step()
        self.state.consumed_samples += self.config.batch.batch_size
        return metrics

    def _optimizer_step(self) -> dict[str, Any]:
        """Clip, update (unless the gradient is not finite) and advance the schedule."""
        state = self.state
        training = self.config.training
        lr = phased_learning_rate(
            self.config.optimizer.learning_rate, training.phases, state.step, training.train_iters
        )
        # The step sums the gradients over data ranks first (ModelStages.reduce_gradients); the
        # pieces' weights already normalize that sum.
        report = self.optimizer.step(lr, self.scaler.scale)
        if self.fp8_histories is not None:
            self.fp8_histories.roll()
        loads = take_step_loads(self.model)
        if loads and not report.skipped:
            self._balance_experts(loads)
        if not report.skipped:
            gather_weights(self.stages, wait=False)  # each stage's forward pass waits for its own
            if self.config.model.multi_stage.debug_tensor_parallel:
                self.stages.fence.wait_for_state()  # it reads the masters
                check_replicated(self.stages.dense.buffers)
        self.scaler.update(report.skipped)
        state.step += 1
        state.skipped_steps += report.skipped
        self.stages.zero_grad()
        return {"lr": lr, "grad_norm": report.grad_norm, "skipped": report.skipped}

    def _balance_experts(self, loads: list[tuple[torch.nn.Parameter, Tensor, float]]) -> None:
        """Each mixture's correction biases moved by its expert loads of the step, summed over
        the data ranks (tensor ranks route the same tokens), so that every rank holding a
        bias moves it alike."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        summed = self._data_sum(torch.stack([load for _, load, _ in loads]).float())
        for (bias, _, rate), load in zip(loads, summed, strict=True):
            self.stages.add_to_masters(names[id(bias)], bias_update(load, rate))

    @torch.no_grad()
    def evaluate(
        self, micro_batches: Sequence[Batch], stop: Callable[[], bool] | None = None
    ) -> float | None:
        """Mean loss over the trained tokens of the micro-batches of every data rank (each
        rank passes its own); None when `stop`, asked by every rank before each micro-batch,
        said to stop."""
        prepared = self.batches.prepare(micro_batches)
        self.model.eval()
        try:
            loss = self.runner.evaluate(prepared, stop)
        finally:
            self.model.train()
        if loss is None:
            return None
        summed = self._data_sum(self._pipeline_sum(self._with_named(loss)))
        self._named = summed[1:]
        return summed[0].item()

    def _pipeline_sum(self, value: Tensor) -> Tensor:
        """`value` summed over the pipeline ranks (each holds its stages' part of the loss)."""
        pipeline = self.mesh.pipeline
        if pipeline.size > 1:
            dist.all_reduce(value, group=pipeline.group)
        return value

    def _data_sum(self, value: Tensor) -> Tensor:
        """`value` summed over the data-parallel ranks (tensor ranks agree on it)."""
        data = self.mesh.data
        if data.size > 1:
            dist.all_reduce(value, group=data.group)
        return value

    def expert_load(self, steps: int) -> dict[str, float]:
        """Tokens routed per expert and step since the last call, over every data rank: the
        most any expert of any layer got, and the mean (what a balanced router gives each)."""
        load = take_expert_load(self.model)
        if self.config.model.base_model.transformer.num_experts == 1 or not steps:
            return {}
        device = self.distributed.device
        if load is None:  # no mixture on this pipeline rank (dense first blocks): it still
            # joins the pipeline ranks' sums
            most = torch.zeros((), dtype=torch.float64, device=device)
            total = torch.zeros(2, dtype=torch.float64, device=device)
        else:
            load = self._data_sum(load).double() / steps
            most = load.max()
            total = torch.stack(
                [load.sum(), torch.tensor(load.numel(), dtype=load.dtype, device=load.device)]
            )
        pipeline = self.mesh.pipeline
        if pipeline.size > 1:  # each pipeline rank counted the layers of its stages
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=pipeline.group)
            dist.all_reduce(total, group=pipeline.group)
        if not total[1]:  # no mixture ran (every block dense)
            return {}
        return {
            "expert_tokens_max": most.item(),
            "expert_tokens_mean": (total[0] / total[1]).item(),
        }

    # --- state --------------------------------------------------------------------------------

    def state_dict(self, writable: bool = False) -> EngineState:
        """The whole training state: counters, loss scale, this rank's RNG streams and amax
        histories, and views of the shards (`writable`: copies of split masters to restore
        into, then handed to `load_state_dict`)."""
        per_rank = {"rng.cpu": torch.get_rng_state()}
        device = self.distributed.device
        if device.type == "cuda":
            per_rank["rng.cuda"] = torch.cuda.get_rng_state(device)
        if self.fp8_histories is not None:
            for key, tensor in self.fp8_histories.state().items():
                per_rank[FP8_PREFIX + key] = tensor.detach().clone()
        return EngineState(
            training=TrainingState(**vars(self.state)),
            optimizer_steps=self.optimizer.step_count,
            loss_scaler=self.scaler.state_dict(),
            per_rank=per_rank,
            sharded=sharded_state(self.stages, STATE_KINDS, writable),
        )

    @torch.no_grad()
    def load_state_dict(self, state: EngineState) -> None:
        """Take `state` (from `state_dict(writable=True)`, its tensors overwritten): the
        compute weights are remade from the masters, bit for bit what the optimizer wrote.
        A `per_rank` entry left out keeps this rank's own; a `ValueError` when the amax
        histories do not fit the model's."""
        restore_split_masters(self.stages, state.sharded)
        self.stages.sync_weights_from_master()
        gather_weights(self.stages)  # the other ranks' shards of the compute weights
        self.state = TrainingState(**vars(state.training))
        self.optimizer.step_count = state.optimizer_steps
        self.scaler.load_state_dict(state.loss_scaler)
        per_rank = state.per_rank
        histories = self.fp8_histories
        if histories is not None:
            keys = [FP8_PREFIX + key for key in histories.state()]
            if all(key in per_rank for key in keys):
                histories.load_state({key[len(FP8_PREFIX) :]: per_rank[key] for key in keys})
        if "rng.cpu" in per_rank:
            torch.set_rng_state(per_rank["rng.cpu"])
        device = self.distributed.device
        if device.type == "cuda" and "rng.cuda" in per_rank:
            torch.cuda.set_rng_state(per_rank["rng.cuda"], device)

    def sharded(self, kinds: tuple[str, ...]) -> Any:
        """Views of the shards of `kinds` (e.g. `("master",)`, a distributed export)."""
        return sharded_state(self.stages, kinds)

    def build_reference(self, name: str) -> ReferenceModel:
        """Reference model `name` of `reference_models`, on the engine's layout, its weights
        loaded: one whose log-probabilities are precomputed, run before training and then
        dropped (every rank calls it). Its stages are the trained model's, when its steps run
        them one at a time (each pipeline rank holding its own)."""
        num_stages = None if self.runner.whole else self.layout.num_stages
        return build_references(
            self.config, {name}, self.mesh, self.distributed.device, num_stages
        )[name]

    def wait_for_weights(self) -> None:
        """Every weight of this rank current: ZeRO-1/2 leave a step's all-gathers in flight
        for each stage's forward pass to wait on, which a forward pass outside the runner
        (lm-eval's, reading the head's weight directly) must not count on, nor on the stage's
        wait for its offloaded update."""
        self.stages.fence.wait_all()
        for group in self.stages.all_groups:
            if group.refresh is not None:
                group.refresh.wait_all()

    def whole_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """Every parameter whole (every rank takes part: tensor slices are gathered, ZeRO-3
        gathers each stage)."""
        return whole_parameters(self.stages)

    # --- description --------------------------------------------------------------------------

    def describe(self) -> str:
        """One line: the model, where and how it trains."""
        config, distributed, mesh = self.config, self.distributed, self.mesh
        batch, stages, layout = config.batch, config.model.multi_stage, self.layout
        micro = layout.micro_batch_size
        accumulated = (
            f"{layout.depth_first} accumulated"
            if layout.breadth_first == 1
            else f"{layout.depth_first} × {layout.breadth_first} breadth-first"
        )
        base = config.model.base_model
        total, active = base.num_parameters(), base.num_parameters(active=True)
        frozen = config.model.num_frozen_parameters()
        parts = [
            f"{total:,} parameters"
            + (f" ({active:,} active per token)" if active < total else "")
            + (f", {frozen:,} of them frozen" if frozen else ""),
            f"{distributed.world_size} × {distributed.device.type}",
            f"{config.model.distributed.training_dtype}"
            + (" (fp32 masters)" if self.stages.mixed_precision else ""),
            f"batch {batch.batch_size} × {batch.sequence_length} tokens"
            f" ({micro} per micro-batch, {accumulated})",
        ]
        if config.model.distributed.fp8_linear != "none":
            delayed = " (delayed scaling)" if self.fp8_histories is not None else ""
            parts.append(f"{config.model.distributed.fp8_linear}{delayed} FP8 linear layers")
        if mesh.tensor.size > 1:
            sequence = " with sequence parallelism" if mesh.tensor.sequence_tensor_parallel else ""
            parts.append(f"tensor parallel {mesh.tensor.size}{sequence}")
        if mesh.pipeline.size > 1:
            parts.append(
                f"pipeline parallel {mesh.pipeline.size} ({layout.num_stages} stages, "
                f"{config.schedule.order.replace('_', '-')})"
            )
        if mesh.data.size > 1:
            parts.append(
                f"data parallel {mesh.data.size}, ZeRO-{stages.zero_stage}, "
                f"{stages.layers_per_stage} layer(s)/stage"
            )
        if mesh.sequence_data.size > 1:
            chunks = config.model.distributed.sequence_data_chunking.replace("_", "-")
            parts.append(f"sequence-data parallel {mesh.sequence_data.size} ({chunks} chunks)")
        if mesh.expert.size > 1:
            parts.append(f"expert parallel {mesh.expert.size}")
        if config.schedule.micro_batch_splits > 1:
            parts.append(f"sequences in {config.schedule.micro_batch_splits} pieces")
        parts.append(f"{stages.recompute} recomputation")
        if stages.offload_optimizer:
            parts.append("optimizer state in host memory")
        if config.training.compile:
            parts.append("compiled blocks")
        return ", ".join(parts)
