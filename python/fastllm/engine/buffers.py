"""One group of parameters as views into flat buffers, over the stages this pipeline rank runs.

A model has one group of dense parameters, sharded over the data dimension, and with expert
parallelism a second of the experts' parameters (this rank's share of them), sharded over the
data ranks holding the same experts (expert_data): two instances of `GroupBuffers`.

Per stage, one buffer holds the compute weights; a parallel fp32 buffer receives the gradients
(GradientBuffers); this data rank's shard of each stage has fp32 master weights (a view of the
weights themselves in float32 training) and the two Adam moments, with `offload_optimizer` in
host memory (the masters only where they are not the compute weights). ZeRO-2 keeps only the
shard of the gradients, ZeRO-3 also only the shard of the compute weights. The layout — offsets,
alignment, the shard each data rank owns — comes from Rust (`fastllm._native.BufferLayout`). With
tensor parallelism each tensor rank has its own buffers, of its slices of the parameters.

Each stage lists its parameters in model order, except that with tensor parallelism the
parameters replicated over tensor ranks come first, those whose gradients are summed over
tensor ranks first of all: one all-reduce of a prefix of the stage's gradient, and the gradient
norm counts the replicated prefix on one tensor rank only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from fastllm import _native
from fastllm.config.layout import pipeline_stages
from fastllm.engine.gradient_buffers import GradientBuffers
from fastllm.engine.host_memory import host_zeros
from fastllm.engine.stages import slot
from fastllm.model.parameters import ParameterMeta
from fastllm.parallel.dimension import Dimension
from fastllm.parallel.tensor import TensorDimension
from fastllm_kernels import master_split

ALIGNMENT = 128
"""Elements; every parameter starts at a multiple, so kernels see aligned rows."""


@dataclass
class Shard:
    """This rank's part of one stage: master weights, moments, and views of the stage's
    gradient and weight buffers on the same range."""

    master: Tensor | None
    """The fp32 master weights (the weights themselves in fp32 training); None when split."""
    exp_avg: Tensor
    exp_avg_sq: Tensor
    grad: Tensor
    weight: Tensor
    decay_runs: list[tuple[int, int, bool]]
    replicated: int
    """Its first `replicated` elements belong to parameters every tensor rank holds whole."""
    master_low: Tensor | None = None
    """bf16 training: the masters are split (fastllm_kernels.master_split), `weight` holding
    their high halves and this (int16) the rest."""

    def master_values(self, start: int = 0, end: int | None = None) -> Tensor:
        """The fp32 masters of [start, end): a view, or when split a new tensor (in host
        memory when the low halves are: `offload_optimizer`)."""
        if self.master_low is None:
            assert self.master is not None
            return self.master[start:end]
        low = self.master_low[start:end]
        return master_split.join(self.weight[start:end].to(low.device), low)

    def set_master(self, start: int, values: Tensor) -> None:
        """Masters [start, start + len(values)) from fp32 values on either device (when split,
        the compute weights too)."""
        end = start + values.numel()
        if self.master_low is None:
            assert self.master is not None
            self.master[start:end].copy_(values)
        else:
            master_split.split_(values, self.weight[start:end], self.master_low[start:end])


@dataclass
class StageBuffer:
    """One group's buffer of one stage."""

    index: int
    """The stage."""
    parameters: list[int]
    """Its parameters' indices, in layout order."""
    weights: Tensor
    """The compute weights: empty for the stages of other pipeline ranks; with ZeRO-3 holding
    memory only while gathered (WeightGatherer)."""
    views: dict[int, torch.nn.Parameter]
    """By index: the model's parameters, views of `weights` (none on other pipeline ranks,
    whose stages' parameters stay on the meta device)."""
    tensor_reduced_end: int
    """Its gradient's elements [0, end) are summed over tensor ranks."""


class GroupBuffers:
    """The flat buffers of `names` (parameters of `model`, in model order), the model's
    parameters made views of them. `stage_of(name)`: the stage a parameter belongs to."""

    def __init__(
        self,
        model: torch.nn.Module,
        names: list[str],
        metas: dict[str, ParameterMeta],
        stage_of: Callable[[str], int],
        *,
        data: Dimension,
        tensor: TensorDimension,
        pipeline: Dimension,
        compute_dtype: torch.dtype,
        device: torch.device,
        zero_stage: int,
        num_stages: int,
        trainable: bool = True,
        offload_optimizer: bool = False,
    ) -> None:
        """`num_stages`: the model's (a stage may hold none of `names`: an empty buffer).
        `trainable` false: frozen parameters, weights only (ZeRO-3 still shards them).
        `offload_optimizer`: the shards' masters and moments in host memory."""
        self.compute_dtype, self.device = compute_dtype, device
        self.trainable = trainable
        self.offload_optimizer = offload_optimizer
        self.data, self.tensor, self.pipeline = data, tensor, pipeline
        """`data`: the dimension the shards and gradient sums span."""
        self.shard_gradients = zero_stage >= 2 and data.size > 1
        self.shard_weights = zero_stage >= 3 and data.size > 1
        self.metas = {name: metas[name] for name in names}
        split = tensor.size > 1

        def reduced(name: str) -> bool:
            return split and metas[name].tensor_reduced(tensor.sequence_tensor_parallel)

        def replicated(name: str) -> bool:
            return split and metas[name].tensor_split is None

        model_order = {name: i for i, name in enumerate(names)}
        self.names = sorted(
            names, key=lambda n: (stage_of(n), not reduced(n), not replicated(n), model_order[n])
        )
        """Every parameter, in layout order (its index is its position here)."""
        self.indices = {name: index for index, name in enumerate(self.names)}
        parameters = {name: model.get_parameter(name) for name in self.names}
        self.shapes = {name: parameters[name].shape for name in self.names}
        self.specs = [
            (name, parameters[name].numel(), stage_of(name), metas[name].weight_decay)
            for name in self.names
        ]
        """(name, numel, stage, weight decay) of every parameter, in layout order."""
        self.layout = _native.BufferLayout(
            self.specs, alignment=ALIGNMENT, data_size=data.size, num_stages=num_stages
        )
        num_stages = self.layout.num_stages
        self.owned = pipeline_stages(num_stages, pipeline.size, pipeline.rank)
        """The stages this pipeline rank runs: only their buffers exist here."""
        stage_parameters: list[list[int]] = [[] for _ in range(num_stages)]
        for index in range(len(self.names)):
            stage_parameters[self.layout.parameter(index)[0]].append(index)
        self.owned_names = {self.names[i] for s in self.owned for i in stage_parameters[s]}
        self.stages = [
            self._stage_buffer(model, s, stage_parameters[s], reduced) for s in range(num_stages)
        ]
        """Every stage's buffer, those of other pipeline ranks' stages empty."""
        self.shards: dict[int, Shard] = {}
        """This data rank's shard of each stage this pipeline rank runs (trainable only)."""
        self.weight_shards: dict[int, Tensor] = {}
        """This data rank's shard of each stage's compute weights (what ZeRO-3 gathers)."""
        if not trainable:
            if self.shard_weights:
                for stage in self.owned:
                    start, end = self.layout.shard_range(stage, data.rank)
                    self.weight_shards[stage] = torch.zeros(
                        end - start, dtype=compute_dtype, device=device
                    )
            return
        self.gradients = GradientBuffers(
            [self.layout.stage_size(s) if s in self.owned else 0 for s in range(num_stages)],
            [stage_parameters[s] if s in self.owned else [] for s in range(num_stages)],
            self.view,
            self.layout.parameter,
            device,
            pooled=self.shard_gradients,  # ZeRO-2: each stage's full gradient is reduced at once
            slots=[self.slot(s) for s in range(num_stages)],
            transient=not self.shard_gradients,  # ZeRO-2 pools two instead
        )
        self.grads = self.gradients.buffers
        self.shards = {
            s: self._shard(s, self._prefix_end(stage_parameters[s], replicated)) for s in self.owned
        }
        self.weight_shards = {s: shard.weight for s, shard in self.shards.items()}
        for stage in self.owned:  # views of the gradients are made: transient ones let go
            self.gradients.consumed(stage)

    @property
    def tied(self) -> bool:
        """It holds a parameter that two stages read (ParameterMeta.tied)."""
        return any(meta.tied for meta in self.metas.values())

    @property
    def mixed_precision(self) -> bool:
        return self.compute_dtype != torch.float32

    @property
    def split_masters(self) -> bool:
        """bf16 compute weights are the high halves of the fp32 masters (Shard.master_low):
        16 bytes per parameter of weights, gradient and Adam state instead of 18."""
        return self.compute_dtype == torch.bfloat16

    def slot(self, stage: int) -> int:
        return slot(stage, self.pipeline.size)

    def view(self, stage_buffer: Tensor, index: int) -> Tensor:
        _, offset, numel = self.layout.parameter(index)
        return stage_buffer[offset : offset + numel].view(self.shapes[self.names[index]])

    def pieces(self, index: int) -> list[tuple[Shard, tuple[int, int, int, int]]]:
        """This rank's pieces of parameter `index` (of a stage it runs): its shard, and (start,
        end) in the parameter and in the shard."""
        stage, _, _ = self.layout.parameter(index)
        return [
            (self.shards[stage], (p0, p1, s0, s1))
            for i, p0, p1, s0, s1 in self.layout.shard_parameters(stage, self.data.rank)
            if i == index
        ]

    def compute_weights(self, tensor: Tensor) -> Tensor:
        """The compute weights of master values: with split masters their high halves, which
        round ties otherwise than a cast (every rank then holds what the owners' shards do)."""
        if not self.split_masters:
            return tensor
        values = tensor.to(self.device, torch.float32)
        high = torch.empty(values.shape, dtype=torch.bfloat16, device=self.device)
        master_split.split_(values, high, torch.empty_like(high, dtype=torch.int16))
        return high

    @torch.no_grad()
    def weights_from_masters(self) -> None:
        """This rank's shards of the compute weights from the masters (exactly what the
        optimizer step writes)."""
        if not self.mixed_precision:
            return
        for shard in self.shards.values():  # none when frozen
            if shard.master is not None:  # split masters hold the weights already
                shard.weight.copy_(shard.master)

    def _stage_buffer(
        self,
        model: torch.nn.Module,
        stage: int,
        parameters: list[int],
        reduced: Callable[[str], bool],
    ) -> StageBuffer:
        """The stage's compute weights, its parameters made views of them. With ZeRO-3 their
        memory is freed at once (before the next stage's is taken): the buffer holds the stage
        only while it runs (WeightGatherer)."""
        buffer = StageBuffer(
            index=stage,
            parameters=parameters,
            weights=torch.zeros(0, dtype=self.compute_dtype, device=self.device),
            views={},
            tensor_reduced_end=self._prefix_end(parameters, reduced),
        )
        if stage not in self.owned:
            return buffer
        buffer.weights = torch.zeros(
            self.layout.stage_size(stage), dtype=self.compute_dtype, device=self.device
        )
        for index in parameters:
            view = torch.nn.Parameter(self.view(buffer.weights, index), self.trainable)
            set_parameter(model, self.names[index], view)
            buffer.views[index] = view
        if self.shard_weights:
            buffer.weights.untyped_storage().resize_(0)
        return buffer

    def _prefix_end(self, parameters: list[int], member: Callable[[str], bool]) -> int:
        """End of a stage's leading `parameters` for which `member` holds (0 if none)."""
        end = 0
        for index in parameters:
            if not member(self.names[index]):
                break
            _, offset, numel = self.layout.parameter(index)
            end = offset + numel
        return end

    def _shard(self, stage: int, replicated_end: int) -> Shard:
        start, end = self.layout.shard_range(stage, self.data.rank)
        grad = self.grads[stage][start:end]
        weight = (
            torch.zeros(end - start, dtype=self.compute_dtype, device=self.device)
            if self.shard_weights
            else self.stages[stage].weights[start:end]
        )
        if self.shard_gradients:
            grad = torch.zeros(end - start, dtype=torch.float32, device=self.device)
        master = master_low = None
        if not self.mixed_precision:
            master = weight
        elif self.split_masters:
            master_low = self._state(end - start, torch.int16)
        else:
            master = self._state(end - start, torch.float32)
        return Shard(
            master=master,
            exp_avg=self._state(end - start, torch.float32),
            exp_avg_sq=self._state(end - start, torch.float32),
            grad=grad,
            weight=weight,
            decay_runs=self.layout.decay_runs(stage, self.data.rank),
            replicated=max(0, min(end, replicated_end) - start),
            master_low=master_low,
        )

    def _state(self, numel: int, dtype: torch.dtype) -> Tensor:
        """Optimizer state of a shard: on the device, or in host memory (page-locked when the
        device is a GPU)."""
        if self.offload_optimizer:
            return host_zeros(numel, dtype, pin=self.device.type == "cuda")
        return torch.zeros(numel, dtype=dtype, device=self.device)


def set_parameter(model: torch.nn.Module, name: str, parameter: torch.nn.Parameter) -> None:
    """Replace `model`'s parameter `name` (dotted) by `parameter`."""
    *path, leaf = name.split(".")
    module = model
    for part in path:
        module = getattr(module, part)
    module._parameters[leaf] = parameter
