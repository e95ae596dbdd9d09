"""The model's parameters in flat buffers, by stage and by group: what the engine, the step
runner, the optimizer and the checkpoint state use.

The dense parameters form one group, sharded over the data dimension; with expert parallelism
the experts' parameters (this rank's share of them) form a second, sharded over the data ranks
holding the same experts (expert_data). A `Stage` is a model span and its buffer of each group;
the step's operations act on every group."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor

from fastllm.config.layout import num_stages
from fastllm.engine.buffers import GroupBuffers, StageBuffer
from fastllm.engine.parameter_group import ParameterGroup
from fastllm.engine.stages import stage_modules, stage_of_layer, stage_positions
from fastllm.engine.tied_weights import TiedWeights, tied_weights
from fastllm.engine.update_fence import Immediate, Streams, UpdateFence, device_streams
from fastllm.model import GPTModel
from fastllm.model.parameters import parameter_metas
from fastllm.parallel.dimension import Dimension
from fastllm.parallel.mesh import ParallelMesh


@dataclass(frozen=True)
class Stage:
    index: int
    positions: tuple[int, int]
    """Its first and last model positions (what `GPTModel.run_positions` takes)."""
    buffers: list[StageBuffer]
    """Its buffer of each group (`ModelStages.groups`): its parameters' views."""


class ModelStages:
    """Makes `model`'s parameters views of flat buffers and owns those buffers."""

    def __init__(
        self,
        model: GPTModel,
        *,
        compute_dtype: torch.dtype,
        device: torch.device,
        mesh: ParallelMesh | None = None,
        zero_stage: int = 1,
        layers_per_stage: int | Fraction = 1,
        gather_in_forward: bool = True,
        offload_optimizer: bool = False,
        streams: Streams | None = None,
    ) -> None:
        """`gather_in_forward`: ZeRO-3 gathers and ZeRO-1/2 refreshes are driven by the stages'
        forward and backward passes (false: by the pipeline runner's program).
        `offload_optimizer`: the trained groups' masters and moments in host memory, their
        update on `streams` (default: the device's)."""
        self.compute_dtype, self.device = compute_dtype, device
        self.offload_optimizer = offload_optimizer
        if streams is None:
            streams = device_streams(device) if offload_optimizer else Immediate()
        self.fence = UpdateFence(streams)
        """What the use of a stage's weights and of the state waits for of the last update
        (`offload_optimizer`'s runs beside the next step)."""
        self.mesh = mesh = mesh or ParallelMesh.single()
        self.metas = metas = parameter_metas(model)
        num_layers = model.config.transformer.num_layers
        expert_parallel = mesh.expert.size > 1
        names = [name for name, _ in model.named_parameters()]
        modules = stage_modules(model, layers_per_stage)
        self.tensor = mesh.tensor
        deferral = mesh.tensor.deferral if mesh.tensor.split else None

        trained = [name for name in names if not metas[name].frozen]

        def make_buffers(group: list[str], data: Dimension, trainable: bool = True) -> GroupBuffers:
            return GroupBuffers(
                model,
                group,
                metas,
                lambda name: stage_of_layer(metas[name].layer, num_layers, layers_per_stage),
                data=data,
                tensor=mesh.tensor,
                pipeline=mesh.pipeline,
                compute_dtype=compute_dtype,
                device=device,
                zero_stage=zero_stage,
                num_stages=num_stages(num_layers, layers_per_stage),
                trainable=trainable,
                offload_optimizer=offload_optimizer,
            )

        def trained_buffers(experts: bool) -> GroupBuffers:
            group = [n for n in trained if (expert_parallel and metas[n].expert_split) == experts]
            return make_buffers(group, mesh.expert_data if experts else mesh.data)

        def make_group(buffers: GroupBuffers, tied_here: bool) -> ParameterGroup:
            return ParameterGroup(
                buffers,
                deferral=deferral,
                tied_here=tied_here,
                stage_modules=modules if gather_in_forward else None,
                fence=self.fence,
            )

        if offload_optimizer and gather_in_forward:
            # Before the groups' hooks: a stage's forward pass waits for its own update.
            for stage, first_modules in enumerate(modules):
                first_modules[0].register_forward_pre_hook(self._fence_hook(stage))

        dense = trained_buffers(experts=False)
        self.tied = tied_weights(model, dense)
        """The embedding's copy and its gradient, when the head runs on another pipeline rank."""
        self.tied_here = dense.tied and self.tied is None
        """The head reads the embedding's own weights (tied, and on this rank)."""
        self.dense = make_group(dense, self.tied_here)
        self.experts = make_group(trained_buffers(True), False) if expert_parallel else None
        """With expert parallelism: the experts' parameters, in buffers of their own."""
        self.groups = [self.dense] if self.experts is None else [self.dense, self.experts]
        """The groups that train: what the optimizer steps, reduces and checkpoints."""
        # Frozen parameters: weights only, gathered with ZeRO-3; no gradient sinks are made
        # for them (the deferral goes unused). Under expert parallelism the frozen experts are
        # split and sharded as the trained ones are, in buffers of their own.
        frozen = [name for name in names if metas[name].frozen]
        frozen_experts = [n for n in frozen if expert_parallel and metas[n].expert_split]
        frozen_dense = [n for n in frozen if n not in set(frozen_experts)]
        self.frozen_tied: TiedWeights | None = None
        """A frozen embedding's copy, when the head runs on another pipeline rank."""
        self.frozen: ParameterGroup | None = None
        """The frozen parameters (`model.freeze`, LoRA's `freeze_others`) but experts split
        by expert parallelism."""
        if frozen_dense:
            buffers = make_buffers(frozen_dense, mesh.data, trainable=False)
            self.frozen_tied = tied_weights(model, buffers)
            self.frozen = make_group(buffers, buffers.tied and self.frozen_tied is None)
        self.frozen_experts: ParameterGroup | None = None
        """With expert parallelism: the frozen experts."""
        if frozen_experts:
            buffers = make_buffers(frozen_experts, mesh.expert_data, trainable=False)
            self.frozen_experts = make_group(buffers, False)
        self.frozen_groups = [g for g in (self.frozen, self.frozen_experts) if g is not None]
        """The groups that do not train."""
        self.expert_groups = [g for g in (self.experts, self.frozen_experts) if g is not None]
        """The groups whose experts are split over the expert group."""
        self.all_groups = [*self.groups, *self.frozen_groups]
        """Every group: the trained ones and the frozen ones."""
        self.stages = [
            Stage(
                stage,
                stage_positions(stage, num_layers, layers_per_stage),
                [g.buffers.stages[stage] for g in self.groups],
            )
            for stage in range(num_stages(num_layers, layers_per_stage))
        ]

    @property
    def mixed_precision(self) -> bool:
        return self.compute_dtype != torch.float32

    @property
    def weights_sharded(self) -> bool:
        """ZeRO-3 over several data ranks: a stage runs on weights gathered for it."""
        return any(group.gatherer is not None for group in self.all_groups)

    def group_of(self, name: str) -> ParameterGroup:
        """The group that holds parameter `name`."""
        for group in self.all_groups[1:]:
            if name in group.buffers.indices:
                return group
        return self.dense

    def _fence_hook(self, stage: int) -> Callable[..., None]:
        fence = self.fence

        def hook(_module: torch.nn.Module, _args: Any) -> None:
            fence.wait(stage)

        return hook

    def wait_for_weights(self, stage: int) -> None:
        """Block until `stage`'s full compute weights are in place (its offloaded update,
        ZeRO-1/2's refresh after a step, ZeRO-3's gather whenever it runs)."""
        self.fence.wait(stage)
        for group in self.all_groups:
            group.wait_for_weights(stage)

    def prefetch_weights(self, stage: int) -> None:
        """ZeRO-3: start gathering `stage`'s full compute weights (the pipeline runner)."""
        for group in self.all_groups:
            if group.gatherer is not None:
                group.gatherer.prefetch(stage)

    def gather_for_forward(self, stage: int) -> None:
        """ZeRO-3, a forward pass run stage by stage outside the step's runner (lm-eval's):
        what running `stage` reads gathered, the next stage's on its way, the others released
        (what the stages' forward hooks do, where they are installed)."""
        for group in self.all_groups:
            if group.gatherer is not None:
                group.gatherer.before_forward(stage)

    def hold_weights(self) -> None:
        """ZeRO-3: every stage's weights gathered and kept, the forward hooks idle, until
        `release_weights()`: many small forward passes (generation) gather once."""
        for group in self.all_groups:
            if group.gatherer is not None:
                group.gatherer.hold()

    def release_weights(self, stage: int | None = None) -> None:
        """ZeRO-3: free `stage`'s gathered weights (every stage's with None)."""
        for group in self.all_groups:
            if group.gatherer is not None:
                if stage is None:
                    group.gatherer.release_all()
                else:
                    group.gatherer.release(stage)

    def arm_reduction(self, reduce: bool, final: bool | None = None, uses: int = 1) -> None:
        """Whether the coming backward pass reduces the gradients of its stages (the step's
        program says: ZeRO-1 in the step's last, ZeRO-2/3 in each micro-batch's last). With
        `final` (a backward pass through the whole model: whether it is the step's last), a
        group whose gradients are not sharded reduces only then (ZeRO-1 semantics, which a
        ZeRO-2/3 run over one data rank of the group has), whatever `reduce` says. `uses`: the
        forward passes it runs back through (a whole micro-batch's pieces), each of which
        writes the gradients of the weights with a gradient sink once."""
        for group in self.groups:
            reducer = group.reducer
            if reducer is not None:
                reducer.armed = reduce if final is None or reducer.sharded else final
                reducer.uses = uses

    def finish_backward(self) -> None:
        """After a backward pass through the whole model (begun with `arm_reduction`): when
        reducing, reduce the stages still pending and wait for every reduction; free the
        gathered weights (ZeRO-3)."""
        self.tensor.run_deferred()
        for group in self.groups:
            group.finish_backward()

    def finish_stage_backward(self, stage: int, reduce: bool) -> None:
        """After a pipeline step's backward pass of `stage` (begun with `arm_reduction(reduce)`):
        run the deferred weight gradients, and start the stage's reduction if it was to be
        reduced and some parameter got no gradient."""
        self.tensor.run_deferred()
        for group in self.groups:
            group.finish_stage_backward(stage, reduce)

    def finish_step_backward(self) -> None:
        """After the last backward pass of a pipeline step: wait for the reductions, free the
        gathered weights (ZeRO-3) and add the tied head's gradient to the embedding's."""
        self.dense.finish_step_backward()
        if self.tied is not None:
            self.tied.reduce_gradient()
        if self.experts is not None:
            self.experts.finish_step_backward()

    def reduce_gradients(self) -> None:
        """Before the optimizer reads the shards: every rank's gradients summed into them, and
        without reductions the buffers complete (held, and zero where no gradient came, even
        when no backward pass ran)."""
        for group in self.groups:
            group.reduce_gradients()

    def zero_grad(self) -> None:
        """Start a new step: the next gradients overwrite the buffers and the shards."""
        for group in self.groups:
            group.zero_grad()

    @torch.no_grad()
    def add_to_masters(self, name: str, delta: Tensor) -> None:
        """Add `delta` (the whole parameter's shape) to this rank's shards of parameter
        `name`'s masters and compute weights, as an optimizer step writes them (the refresh
        or gather after the step takes them to the other ranks)."""
        self.fence.wait_for_state()
        buffers = self.group_of(name).buffers
        flat = delta.reshape(-1).float()
        for shard, (p0, p1, s0, s1) in buffers.pieces(buffers.indices[name]):
            values = shard.master_values(s0, s1) + flat[p0:p1].to(shard.exp_avg.device)
            shard.set_master(s0, values)
            if shard.master_low is None:  # else set_master wrote the compute weights too
                shard.weight[s0:s1].copy_(values)

    @torch.no_grad()
    def sync_weights_from_master(self) -> None:
        """Compute weights of this rank's shards from the masters (exactly what the optimizer
        step writes), so that a restored run computes bit for bit as the original did."""
        for group in self.groups:
            group.buffers.weights_from_masters()
        for group in self.all_groups:
            if group.gatherer is not None:
                group.gatherer.weights_changed()
