"""The model's parameters as views into flat buffers.

One buffer per stage (the embedding, each group of `layers_per_stage` blocks, the head) holds
the compute weights; a parallel fp32 buffer receives the gradients (GradientBuffers); this
rank's shard of each stage has fp32 master weights (a view of the weights themselves in float32
training) and the two Adam moments. With data parallelism the gradients are summed into the
shards during the backward pass (GradientReducer); ZeRO-2 keeps only the shard of the gradients,
ZeRO-3 also only the shard of the compute weights (WeightGatherer). The layout — offsets,
alignment, the shard each data-parallel rank owns — comes from Rust (`fastllm._native.Layout`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from fastllm import _native
from fastllm.engine.gradient_buffers import GradientBuffers
from fastllm.engine.gradient_reducer import GradientReducer
from fastllm.engine.weight_gatherer import WeightGatherer
from fastllm.model import GPTModel

ALIGNMENT = 128
"""Elements; every parameter starts at a multiple, so kernels see aligned rows."""


def stage_of(name: str, num_layers: int, layers_per_stage: int = 1) -> int:
    """Stage 0: embeddings; then `layers_per_stage` blocks per stage; the last stage: final
    norm and head."""
    if name.startswith("embeddings."):
        return 0
    if name.startswith("layers."):
        return int(name.split(".")[1]) // layers_per_stage + 1
    return -(-num_layers // layers_per_stage) + 1


def stage_modules(model: GPTModel, layers_per_stage: int) -> list[list[torch.nn.Module]]:
    """The modules each stage's forward pass runs, in order (the head's weight is read by the
    loss after the final norm, which starts the last stage)."""
    layers = list(model.layers)
    blocks = [layers[i : i + layers_per_stage] for i in range(0, len(layers), layers_per_stage)]
    return [[model.embeddings], *blocks, [model.final_norm]]


def decays(name: str, parameter: Tensor) -> bool:
    """Weight decay on matrices, not on norms, biases and embeddings."""
    return parameter.dim() >= 2 and not name.startswith("embeddings.") and ".norm" not in name


@dataclass
class Shard:
    """This rank's part of one stage: master weights, moments, and views of the stage's
    gradient and weight buffers on the same range."""

    master: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor
    grad: Tensor
    weight: Tensor
    decay_runs: list[tuple[int, int, bool]]


class FlatModel:
    """Turns `model`'s parameters into views of flat buffers and owns those buffers."""

    def __init__(
        self,
        model: GPTModel,
        *,
        compute_dtype: torch.dtype,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
        zero_stage: int = 1,
        layers_per_stage: int = 1,
    ) -> None:
        self.model, self.compute_dtype, self.device = model, compute_dtype, device
        self.rank, self.world_size = rank, world_size
        self.shard_gradients = zero_stage >= 2 and world_size > 1
        self.shard_weights = zero_stage >= 3 and world_size > 1
        num_layers = model.config.transformer.num_layers
        self.names = [name for name, _ in model.named_parameters()]
        parameters = dict(model.named_parameters())
        self.shapes = {name: parameters[name].shape for name in self.names}
        self.specs = [
            (
                name,
                parameters[name].numel(),
                stage_of(name, num_layers, layers_per_stage),
                decays(name, parameters[name]),
            )
            for name in self.names
        ]
        """(name, numel, stage, weight decay) of every parameter, in model order."""
        self.layout = _native.Layout(self.specs, alignment=ALIGNMENT, world_size=world_size)
        stages = range(self.layout.num_stages)
        self.stage_parameters: list[list[int]] = [[] for _ in stages]
        """Indices of each stage's parameters, in model order."""
        for index in range(len(self.names)):
            self.stage_parameters[self.layout.parameter(index)[0]].append(index)
        self.weights = [self._weight_buffer(model, s) for s in stages]
        self.gradients = GradientBuffers(
            [self.layout.stage_size(s) for s in stages],
            self.stage_parameters,
            self._view,
            self.layout.parameter,
            device,
            pooled=self.shard_gradients,  # ZeRO-2: each stage's full gradient is reduced at once
        )
        self.grads = self.gradients.buffers
        self.shards = [self._shard(stage) for stage in stages]
        self.reducer = GradientReducer(self) if world_size > 1 else None
        # Linear layers' weight gradients go straight from the matmul into the fp32 buffer.
        linear_weights = {
            id(module.weight) for module in model.modules() if isinstance(module, torch.nn.Linear)
        }
        self._hooks = []
        for index, (_, parameter) in enumerate(model.named_parameters()):
            hook = self._accumulate_hook(index)
            self._hooks.append(parameter.register_post_accumulate_grad_hook(hook))
            if id(parameter) in linear_weights:
                parameter.gradient_sink = self._gradient_sink(index)
        self.gatherer = (
            WeightGatherer(self, stage_modules(model, layers_per_stage))
            if self.shard_weights
            else None
        )

    @property
    def mixed_precision(self) -> bool:
        return self.compute_dtype != torch.float32

    def parameter_view(self, buffers: list[Tensor], index: int) -> Tensor:
        return self._view(buffers[self.layout.parameter(index)[0]], index)

    def _view(self, stage_buffer: Tensor, index: int) -> Tensor:
        _, offset, numel = self.layout.parameter(index)
        return stage_buffer[offset : offset + numel].view(self.shapes[self.names[index]])

    def _weight_buffer(self, model: GPTModel, stage: int) -> Tensor:
        """The stage's compute weights, its parameters made views of it. With ZeRO-3 its
        memory is freed at once (before the next stage's is taken): it holds the stage only
        while the stage runs (WeightGatherer)."""
        buffer = torch.zeros(
            self.layout.stage_size(stage), dtype=self.compute_dtype, device=self.device
        )
        for index in self.stage_parameters[stage]:
            _set_parameter(model, self.names[index], torch.nn.Parameter(self._view(buffer, index)))
        if self.shard_weights:
            buffer.untyped_storage().resize_(0)
        return buffer

    def _shard(self, stage: int) -> Shard:
        start, end = self.layout.shard_range(stage, self.rank)
        grad = self.grads[stage][start:end]
        weight = (
            torch.zeros(end - start, dtype=self.compute_dtype, device=self.device)
            if self.shard_weights
            else self.weights[stage][start:end]
        )
        if self.shard_gradients:
            grad = torch.zeros(end - start, dtype=torch.float32, device=self.device)
        master = (
            weight
            if not self.mixed_precision
            else torch.zeros(end - start, dtype=torch.float32, device=self.device)
        )
        return Shard(
            master=master,
            exp_avg=torch.zeros(end - start, dtype=torch.float32, device=self.device),
            exp_avg_sq=torch.zeros(end - start, dtype=torch.float32, device=self.device),
            grad=grad,
            weight=weight,
            decay_runs=self.layout.decay_runs(stage, self.rank),
        )

    def _accumulate_hook(self, index: int):
        write = self._gradient_writer(index)

        def hook(parameter: Tensor) -> None:
            # Gradients land in the fp32 buffer (accumulated over micro-batches), never in .grad.
            grad = parameter.grad
            if grad is None:  # the gradient went to the parameter's sink
                return
            write(lambda: self.gradients.add(index, grad))
            parameter.grad = None

        return hook

    def _gradient_sink(self, index: int):
        write = self._gradient_writer(index)

        def sink(a: Tensor, b: Tensor) -> None:
            write(lambda: self.gradients.add_product(index, a, b))

        return sink

    def _gradient_writer(self, index: int):
        """`writer(add)`: `add()` puts this backward pass's gradient of the parameter into its
        buffer; with data parallelism, the reducer frees the buffer first and reduces it once
        the stage is done."""
        stage = self.layout.parameter(index)[0]

        def writer(add) -> None:
            if self.reducer is not None:
                self.reducer.before_accumulate(stage)
            add()
            if self.reducer is not None:
                self.reducer.parameter_done(stage)

        return writer

    def start_backward(self, last_micro_batch: bool) -> None:
        """Before a backward pass: whether it is the step's last, in which ZeRO-1 sums the
        gradients over ranks while the pass runs (else after it, in `reduce_gradients`)."""
        if self.reducer is not None:
            self.reducer.arm(last_micro_batch)

    def finish_backward(self) -> None:
        """After each backward pass: reduce the gradients of stages still pending and free the
        gathered weights (ZeRO-3)."""
        if self.reducer is not None:
            self.reducer.flush()
        else:
            self.gradients.complete_all()
        if self.gatherer is not None:
            self.gatherer.keep_only(set())

    def reduce_gradients(self) -> None:
        """Before the optimizer reads the shards: every rank's gradients summed into them."""
        if self.reducer is not None:
            self.reducer.ensure_reduced()

    def zero_grad(self) -> None:
        """Start a new step: the next gradients overwrite the buffers and the shards."""
        for stage in range(self.layout.num_stages):
            self.gradients.consumed(stage)
        if self.reducer is not None:
            self.reducer.new_step()

    @torch.no_grad()
    def load_full_parameters(self, tensors: Iterator[tuple[str, Tensor]]) -> None:
        """Set every parameter (fp32 master shard and compute weights) from full tensors."""
        seen = set()
        for name, tensor in tensors:
            index = self.names.index(name)
            if not self.shard_weights:
                self.parameter_view(self.weights, index).copy_(tensor)
            for stage_shard, (param_start, param_end, shard_start, shard_end) in self._owned(index):
                piece = tensor.reshape(-1)[param_start:param_end].to(self.device, torch.float32)
                stage_shard.master[shard_start:shard_end].copy_(piece)
            seen.add(name)
        missing = set(self.names) - seen
        if missing:
            raise KeyError(f"no values given for parameters {sorted(missing)[:5]}")
        self.sync_weights_from_master()

    def _owned(self, index: int) -> list[tuple[Shard, tuple[int, int, int, int]]]:
        stage, _, _ = self.layout.parameter(index)
        return [
            (self.shards[stage], (p0, p1, s0, s1))
            for i, p0, p1, s0, s1 in self.layout.shard_parameters(stage, self.rank)
            if i == index
        ]

    @torch.no_grad()
    def sync_weights_from_master(self) -> None:
        """Compute weights of this rank's shards from the masters (exactly what the optimizer
        step writes), so that a restored run computes bit for bit as the original did."""
        if self.mixed_precision:
            for shard in self.shards:
                shard.weight.copy_(shard.master)

    def full_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """Every parameter in the compute dtype (views: copy each before taking the next). With
        ZeRO-3 each stage is gathered in turn: every rank must iterate to the end."""
        for stage in range(self.layout.num_stages):
            if self.gatherer is not None:
                self.gatherer.ensure(stage)
            for index in self.stage_parameters[stage]:
                yield self.names[index], self._view(self.weights[stage], index)
            if self.gatherer is not None:
                self.gatherer.release(stage)


def _set_parameter(model: torch.nn.Module, name: str, parameter: torch.nn.Parameter) -> None:
    *path, leaf = name.split(".")
    module = model
    for part in path:
        module = getattr(module, part)
    module._parameters[leaf] = parameter
