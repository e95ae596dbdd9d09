"""The model's parameters as views into flat buffers.

One buffer per stage (the embedding, each group of `layers_per_stage` blocks, the head) holds
the compute weights; a parallel fp32 buffer receives the gradients (GradientBuffers); this
rank's shard of each stage has fp32 master weights (a view of the weights themselves in float32
training) and the two Adam moments. With data parallelism the gradients are summed into the
shards during the backward pass (GradientReducer); ZeRO-2 keeps only the shard of the gradients,
ZeRO-3 also only the shard of the compute weights (WeightGatherer). The buffer layout —
offsets, alignment, the shard each data-parallel rank owns — comes from Rust
(`fastllm._native.BufferLayout`). With tensor parallelism each tensor rank has its own buffers,
of its slices of the parameters; ZeRO shards them over the data group only. With expert
parallelism the experts' parameters (each rank's share of them) are laid out in a second
FlatModel of their own (`experts`), whose ZeRO shards and gradient sums span the data ranks
holding the same experts."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from fastllm import _native
from fastllm.engine.gradient_buffers import GradientBuffers
from fastllm.engine.gradient_reducer import GradientReducer
from fastllm.engine.weight_gatherer import WeightGatherer
from fastllm.engine.weight_refresh import WeightRefresh
from fastllm.model import GPTModel
from fastllm.model.parameters import full_shape, parameter_metas
from fastllm.parallel import point_to_point
from fastllm.parallel.mesh import ParallelMesh
from fastllm_kernels import master_split
from fastllm_kernels.recipe import GradientProduct

ALIGNMENT = 128
"""Elements; every parameter starts at a multiple, so kernels see aligned rows."""


def stage_of_layer(layer: int, num_layers: int, layers_per_stage: int = 1) -> int:
    """Model position `layer` (0 the embedding, 1 … num_layers the blocks, num_layers + 1 the
    final norm and the head): `layers_per_stage` blocks per stage, the embedding with the
    first, the head with the last."""
    last = max(1, -(-num_layers // layers_per_stage)) - 1
    return min(max(layer - 1, 0) // layers_per_stage, last)


def stage_positions(stage: int, num_layers: int, layers_per_stage: int = 1) -> tuple[int, int]:
    """The first and last model positions of `stage` (what `GPTModel.run_positions` takes)."""
    first = 0 if stage == 0 else stage * layers_per_stage + 1
    last = min((stage + 1) * layers_per_stage, num_layers)
    if stage_of_layer(num_layers + 1, num_layers, layers_per_stage) == stage:
        last = num_layers + 1
    return first, last


def stage_modules(model: GPTModel, layers_per_stage: int) -> list[list[torch.nn.Module]]:
    """The modules each stage's forward pass runs, in order (the head's weight is read by the
    loss after the final norm)."""
    positions = model.layer_modules()
    num_layers = len(positions) - 2
    stages: list[list[torch.nn.Module]] = []
    for layer, modules in enumerate(positions):
        stage = stage_of_layer(layer, num_layers, layers_per_stage)
        if stage == len(stages):
            stages.append([])
        stages[stage] += modules
    return stages


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
        """The fp32 masters of [start, end): a view, or when split a new tensor."""
        if self.master_low is None:
            assert self.master is not None
            return self.master[start:end]
        return master_split.join(self.weight[start:end], self.master_low[start:end])

    def set_master(self, start: int, values: Tensor) -> None:
        """Masters [start, start + len(values)) from fp32 values (when split, the compute
        weights too)."""
        end = start + values.numel()
        if self.master_low is None:
            assert self.master is not None
            self.master[start:end].copy_(values)
        else:
            master_split.split_(values, self.weight[start:end], self.master_low[start:end])


@dataclass
class TiedCopy:
    """Pipeline parallelism with a tied embedding and head on different ranks: the head's rank
    holds a copy of the embedding weight (refreshed after every optimizer step) and its
    gradient, summed into the embedding's shards before the optimizer step."""

    peer: int
    """Global rank of the other side (same tensor and data ranks): the head's rank on the
    embedding's, the embedding's on the head's."""
    index: int
    """The embedding weight's parameter index."""
    weight: Tensor | None = None
    """On the head's rank: the copy, which the head reads."""
    grad: Tensor | None = None
    """On the head's rank: its fp32 gradient, accumulated over the step's micro-batches."""
    fresh: bool = True


class FlatModel:
    """Turns `model`'s parameters into views of flat buffers and owns those buffers.

    Each stage lists its parameters in model order, except that with tensor parallelism the
    parameters replicated over tensor ranks come first, those whose gradients are summed over
    tensor ranks first of all: one all-reduce of a prefix of the stage's gradient, and the
    gradient norm counts the replicated prefix on one tensor rank only.

    With expert parallelism this instance holds every parameter but the experts', and
    `experts` holds those: the methods the trainer calls act on both (`parts`)."""

    def __init__(
        self,
        model: GPTModel,
        *,
        compute_dtype: torch.dtype,
        device: torch.device,
        mesh: ParallelMesh | None = None,
        zero_stage: int = 1,
        layers_per_stage: int = 1,
        gather_in_forward: bool = True,
        experts: bool = False,
    ) -> None:
        """`gather_in_forward`: ZeRO-3 gathers are driven by the stages' forward and backward
        passes (false: by the pipeline runner's program). `experts`: the instance of an
        expert-parallel model's expert parameters (made by the other one)."""
        self.model, self.compute_dtype, self.device = model, compute_dtype, device
        self.mesh = mesh or ParallelMesh.single()
        self.data = self.mesh.expert_data if experts else self.mesh.data
        self.tensor, self.pipeline = self.mesh.tensor, self.mesh.pipeline
        self.shard_gradients = zero_stage >= 2 and self.data.size > 1
        self.shard_weights = zero_stage >= 3 and self.data.size > 1
        num_layers = model.config.transformer.num_layers
        self.metas = parameter_metas(model)
        expert_parallel = self.mesh.expert.size > 1
        parameters = {
            name: parameter
            for name, parameter in model.named_parameters()
            if (expert_parallel and self.metas[name].expert_split) == experts
        }
        split = self.tensor.size > 1

        def reduced(name: str) -> bool:
            return split and self.metas[name].tensor_reduced(self.tensor.sequence_tensor_parallel)

        def replicated(name: str) -> bool:
            return split and self.metas[name].tensor_split is None

        def stage(name: str) -> int:
            return stage_of_layer(self.metas[name].layer, num_layers, layers_per_stage)

        model_order = {name: i for i, name in enumerate(parameters)}
        self.names = sorted(
            parameters,
            key=lambda n: (stage(n), not reduced(n), not replicated(n), model_order[n]),
        )
        self.shapes = {name: parameters[name].shape for name in self.names}
        self.specs = [
            (name, parameters[name].numel(), stage(name), self.metas[name].weight_decay)
            for name in self.names
        ]
        """(name, numel, stage, weight decay) of every parameter, in layout order."""
        self.layout = _native.BufferLayout(
            self.specs, alignment=ALIGNMENT, data_size=self.data.size
        )
        stages = range(self.layout.num_stages)
        self.owned = [s for s in stages if s % self.pipeline.size == self.pipeline.rank]
        """The stages this pipeline rank runs (stage s on rank s mod pipeline size); only
        their buffers exist here, the other stages' parameters stay on the meta device."""
        self.stage_parameters: list[list[int]] = [[] for _ in stages]
        """Indices of each stage's parameters, in layout order."""
        for index in range(len(self.names)):
            self.stage_parameters[self.layout.parameter(index)[0]].append(index)
        self.owned_names = {
            self.names[i] for stage in self.owned for i in self.stage_parameters[stage]
        }
        self.tensor_reduced_end = [self._prefix_end(s, reduced) for s in stages]
        """Per stage: its gradient's elements [0, end) are summed over tensor ranks."""
        self.replicated_end = [self._prefix_end(s, replicated) for s in stages]
        self.weights = [self._weight_buffer(model, s) for s in stages]
        self.gradients = GradientBuffers(
            [self.layout.stage_size(s) if s in self.owned else 0 for s in stages],
            [self.stage_parameters[s] if s in self.owned else [] for s in stages],
            self._view,
            self.layout.parameter,
            device,
            pooled=self.shard_gradients,  # ZeRO-2: each stage's full gradient is reduced at once
            slots=[self.slot(s) for s in stages],
            transient=not self.shard_gradients,  # ZeRO-2 pools two instead
        )
        self.grads = self.gradients.buffers
        self.shards = {stage: self._shard(stage) for stage in self.owned}
        """This rank's shard of each stage it runs."""
        for stage in self.owned:  # views of the gradients are made: transient ones let go
            self.gradients.consumed(stage)
        self.tied_copy = self._tied_copy(model)
        needs_reducer = self.data.size > 1 or any(self.tensor_reduced_end)
        self.reducer = GradientReducer(self) if needs_reducer else None
        self._hooks = []
        for index, name in enumerate(self.names):
            if name not in self.owned_names:
                continue
            parameter = self.model.get_parameter(name)
            hook = self._accumulate_hook(index)
            self._hooks.append(parameter.register_post_accumulate_grad_hook(hook))
            # A projection's weight gradient goes straight from the matmul into the fp32 buffer.
            recipe = self.metas[name].recipe
            if recipe is not None:
                recipe.gradient_sink = self._gradient_sink(index)
        self.gatherer = WeightGatherer(self) if self.shard_weights else None
        if self.gatherer is not None and gather_in_forward:
            self.gatherer.install_hooks(stage_modules(model, layers_per_stage))
        self.refresh = (
            WeightRefresh(self) if self.data.size > 1 and not self.shard_weights else None
        )
        if self.refresh is not None and gather_in_forward:
            self.refresh.install_hooks(stage_modules(model, layers_per_stage))
        self.experts = (
            FlatModel(
                model,
                compute_dtype=compute_dtype,
                device=device,
                mesh=mesh,
                zero_stage=zero_stage,
                layers_per_stage=layers_per_stage,
                gather_in_forward=gather_in_forward,
                experts=True,
            )
            if expert_parallel and not experts
            else None
        )
        """With expert parallelism: the experts' parameters, in buffers of their own."""

    @property
    def parts(self) -> list[FlatModel]:
        """This instance and, with expert parallelism, the experts'."""
        return [self] if self.experts is None else [self, self.experts]

    def part_of(self, name: str) -> FlatModel:
        """The instance that holds parameter `name`."""
        return self.experts if self.experts is not None and name in self.experts.shapes else self

    def wait_for_weights(self, stage: int) -> None:
        """Block until `stage`'s full compute weights are in place (ZeRO-1/2 after a step,
        ZeRO-3 whenever it runs)."""
        for part in self.parts:
            if part.refresh is not None:
                part.refresh.wait(stage)
            if part.gatherer is not None:
                part.gatherer.ensure(stage)

    def prefetch_weights(self, stage: int) -> None:
        """ZeRO-3: start gathering `stage`'s full compute weights (the pipeline runner)."""
        for part in self.parts:
            if part.gatherer is not None:
                part.gatherer.prefetch(stage)

    def release_weights(self, stage: int | None = None) -> None:
        """ZeRO-3: free `stage`'s gathered weights (every stage's with None)."""
        for part in self.parts:
            if part.gatherer is not None:
                if stage is None:
                    part.gatherer.keep_only(set())
                else:
                    part.gatherer.release(stage)

    def arm_reduction(self, reduce: bool) -> None:
        """Whether the coming backward pass of a pipeline step reduces its stage."""
        for part in self.parts:
            if part.reducer is not None:
                part.reducer.armed = reduce

    def slot(self, stage: int) -> int:
        """Which of two buffers `stage` uses where consecutive stages of this rank alternate
        (pooled ZeRO-2 gradients, reduce-scatter outputs)."""
        return (stage // self.pipeline.size) % 2

    def _tied_copy(self, model: GPTModel) -> TiedCopy | None:
        """The tied embedding's copy when the head runs on another pipeline rank."""
        stages = self.layout.num_stages
        head_rank, embedding_rank = (stages - 1) % self.pipeline.size, 0
        if not self.tied or head_rank == embedding_rank:
            return None
        if self.pipeline.rank not in (head_rank, embedding_rank):
            return None
        name = "embeddings.weight"
        index = self.names.index(name)
        peer = head_rank if self.pipeline.rank == embedding_rank else embedding_rank
        copy = TiedCopy(peer=dist.get_global_rank(self.pipeline.group, peer), index=index)
        if self.pipeline.rank == embedding_rank:
            return copy
        shape = self.shapes[name]
        copy.weight = torch.zeros(shape, dtype=self.compute_dtype, device=self.device)
        copy.grad = torch.zeros(shape, dtype=torch.float32, device=self.device)
        parameter = torch.nn.Parameter(copy.weight)
        _set_parameter(model, name, parameter)

        def hook(parameter: Tensor) -> None:
            assert copy.grad is not None and parameter.grad is not None
            if copy.fresh:
                copy.grad.copy_(parameter.grad)
                copy.fresh = False
            else:
                copy.grad.add_(parameter.grad)
            parameter.grad = None

        self._tied_hook = parameter.register_post_accumulate_grad_hook(hook)
        return copy

    def _prefix_end(self, stage: int, member: Callable[[str], bool]) -> int:
        """End of the stage's leading parameters for which `member` holds (0 if none)."""
        end = 0
        for index in self.stage_parameters[stage]:
            if not member(self.names[index]):
                break
            _, offset, numel = self.layout.parameter(index)
            end = offset + numel
        return end

    @property
    def tied(self) -> bool:
        return any(self.metas[name].tied for name in self.names)

    @property
    def tied_here(self) -> bool:
        """The head reads the embedding's own weights (tied, and on this rank)."""
        return self.tied and self.tied_copy is None

    @property
    def mixed_precision(self) -> bool:
        return self.compute_dtype != torch.float32

    @property
    def split_masters(self) -> bool:
        """bf16 compute weights are the high halves of the fp32 masters (Shard.master_low):
        16 bytes per parameter of weights, gradient and Adam state instead of 18."""
        return self.compute_dtype == torch.bfloat16

    def parameter_view(self, buffers: list[Tensor], index: int) -> Tensor:
        return self._view(buffers[self.layout.parameter(index)[0]], index)

    def _view(self, stage_buffer: Tensor, index: int) -> Tensor:
        _, offset, numel = self.layout.parameter(index)
        return stage_buffer[offset : offset + numel].view(self.shapes[self.names[index]])

    def _weight_buffer(self, model: GPTModel, stage: int) -> Tensor:
        """The stage's compute weights, its parameters made views of it. With ZeRO-3 its
        memory is freed at once (before the next stage's is taken): it holds the stage only
        while the stage runs (WeightGatherer)."""
        if stage not in self.owned:
            return torch.zeros(0, dtype=self.compute_dtype, device=self.device)
        buffer = torch.zeros(
            self.layout.stage_size(stage), dtype=self.compute_dtype, device=self.device
        )
        for index in self.stage_parameters[stage]:
            name = self.names[index]
            _set_parameter(model, name, torch.nn.Parameter(self._view(buffer, index)))
        if self.shard_weights:
            buffer.untyped_storage().resize_(0)
        return buffer

    def _shard(self, stage: int) -> Shard:
        start, end = self.layout.shard_range(stage, self.data.rank)
        grad = self.grads[stage][start:end]
        weight = (
            torch.zeros(end - start, dtype=self.compute_dtype, device=self.device)
            if self.shard_weights
            else self.weights[stage][start:end]
        )
        if self.shard_gradients:
            grad = torch.zeros(end - start, dtype=torch.float32, device=self.device)
        master = master_low = None
        if not self.mixed_precision:
            master = weight
        elif self.split_masters:
            master_low = torch.zeros(end - start, dtype=torch.int16, device=self.device)
        else:
            master = torch.zeros(end - start, dtype=torch.float32, device=self.device)
        return Shard(
            master=master,
            exp_avg=torch.zeros(end - start, dtype=torch.float32, device=self.device),
            exp_avg_sq=torch.zeros(end - start, dtype=torch.float32, device=self.device),
            grad=grad,
            weight=weight,
            decay_runs=self.layout.decay_runs(stage, self.data.rank),
            replicated=max(0, min(end, self.replicated_end[stage]) - start),
            master_low=master_low,
        )

    def _accumulate_hook(self, index: int):
        # A tensor's hooks are held from C++, out of the garbage collector's sight: a strong
        # reference to this model from one would keep every buffer alive after its owner (a
        # Trainer) is dropped. So the hook holds the model weakly.
        flat, stage = weakref.ref(self), self.layout.parameter(index)[0]

        def hook(parameter: Tensor) -> None:
            # Gradients land in the fp32 buffer (accumulated over micro-batches), never in .grad.
            grad, model = parameter.grad, flat()
            if grad is None or model is None:  # it went to the parameter's sink, or no model
                return
            model._write_gradient(stage, lambda: model.gradients.add(index, grad))
            parameter.grad = None

        return hook

    def _gradient_sink(self, index: int):
        stage = self.layout.parameter(index)[0]
        # A column-parallel weight's gradient waits for the collective of the layer's input
        # gradient, to run while it is in flight (tensor_parallel.enter).
        deferral = self.tensor.deferral if self.tensor.split else None
        if self.metas[self.names[index]].tensor_split is None:
            deferral = None

        def sink(product: GradientProduct) -> None:
            def write() -> None:
                self._write_gradient(stage, lambda: self.gradients.add_product(index, product))

            if deferral is not None:
                deferral.defer(write)
            else:
                write()

        return sink

    def _write_gradient(self, stage: int, add: Callable[[], None]) -> None:
        """`add()` puts this backward pass's gradient of a parameter of `stage` into its buffer;
        with data parallelism, the reducer frees the buffer first and reduces it once the stage
        is done."""
        if self.reducer is not None:
            self.reducer.before_accumulate(stage)
        add()
        if self.reducer is not None:
            self.reducer.parameter_done(stage)

    def start_backward(self, last_micro_batch: bool) -> None:
        """Before a backward pass: whether it is the step's last, in which ZeRO-1 sums the
        gradients over ranks while the pass runs (else after it, in `reduce_gradients`)."""
        if self.reducer is not None:
            self.reducer.arm(last_micro_batch)
        if self.experts is not None:
            self.experts.start_backward(last_micro_batch)

    def finish_backward(self) -> None:
        """After each backward pass: reduce the gradients of stages still pending and free the
        gathered weights (ZeRO-3)."""
        self.tensor.run_deferred()
        if self.reducer is not None:
            self.reducer.flush()
        else:
            self.gradients.complete_all()
        if self.gatherer is not None:
            self.gatherer.keep_only(set())
        if self.experts is not None:
            self.experts.finish_backward()

    def finish_stage_backward(self, stage: int, reduce: bool) -> None:
        """After a pipeline step's backward pass of `stage` (begun with `reducer.armed =
        reduce`): run the deferred weight gradients, and start the stage's reduction if it was
        to be reduced and some parameter got no gradient."""
        self.tensor.run_deferred()
        if self.reducer is not None:
            self.reducer.stage_done(stage, reduce)
        elif reduce:
            self.gradients.complete(stage)
        if self.experts is not None:
            self.experts.finish_stage_backward(stage, reduce)

    def finish_step_backward(self) -> None:
        """After the last backward pass of a pipeline step: wait for the reductions, free the
        gathered weights (ZeRO-3) and add the tied head's gradient to the embedding's."""
        if self.reducer is not None:
            self.reducer.finish_step()
        else:
            self.gradients.complete_all()
        if self.gatherer is not None:
            self.gatherer.keep_only(set())
        self._reduce_tied_gradient()
        if self.experts is not None:
            self.experts.finish_step_backward()

    @torch.no_grad()
    def _reduce_tied_gradient(self) -> None:
        """The head's rank sums its copy's gradient over data ranks and sends each embedding
        rank the piece of its shard, which adds it."""
        copy = self.tied_copy
        if copy is None:
            return
        pieces = self._embedding_pieces()
        if copy.grad is not None:
            if copy.fresh:
                copy.grad.zero_()
            if self.data.size > 1:
                dist.all_reduce(copy.grad, group=self.data.group)
            flat = copy.grad.reshape(-1)
            for p0, p1, _, _ in pieces:
                point_to_point.send(flat[p0:p1], copy.peer)
            copy.fresh = True
            return
        shard = self.shards[0]
        for p0, p1, s0, s1 in pieces:
            received = torch.empty(p1 - p0, dtype=torch.float32, device=self.device)
            shard.grad[s0:s1].add_(point_to_point.recv(received, copy.peer))

    def _embedding_pieces(self) -> list[tuple[int, int, int, int]]:
        """(parameter start, end, shard start, end) of the embedding in this data rank's shard
        of stage 0."""
        assert self.tied_copy is not None
        index = self.tied_copy.index
        return [
            (p0, p1, s0, s1)
            for i, p0, p1, s0, s1 in self.layout.shard_parameters(0, self.data.rank)
            if i == index
        ]

    @torch.no_grad()
    def sync_tied_copy(self) -> None:
        """The embedding's rank sends the head's rank its shard's piece of the updated weight;
        the head's ranks sum the pieces of all data ranks into their copies."""
        copy = self.tied_copy
        if copy is None:
            return
        pieces = self._embedding_pieces()
        if copy.weight is None:
            weight = self.shards[0].weight
            for _, _, s0, s1 in pieces:
                point_to_point.send(weight[s0:s1], copy.peer)
            return
        flat = copy.weight.reshape(-1)
        flat.zero_()
        for p0, p1, _, _ in pieces:
            received = torch.empty(p1 - p0, dtype=self.compute_dtype, device=self.device)
            flat[p0:p1].copy_(point_to_point.recv(received, copy.peer))
        if self.data.size > 1:
            dist.all_reduce(copy.weight, group=self.data.group)

    def reduce_gradients(self) -> None:
        """Before the optimizer reads the shards: every rank's gradients summed into them, and
        without reductions the buffers complete (held, and zero where no gradient came, even
        when no backward pass ran)."""
        for part in self.parts:
            if part.reducer is not None:
                part.reducer.ensure_reduced()
            else:
                part.gradients.complete_all()

    def zero_grad(self) -> None:
        """Start a new step: the next gradients overwrite the buffers and the shards."""
        for part in self.parts:
            for stage in part.owned:
                part.gradients.consumed(stage)
            if part.reducer is not None:
                part.reducer.new_step()

    @torch.no_grad()
    def load_full_parameters(self, tensors: Iterator[tuple[str, Tensor]]) -> None:
        """Set every parameter (fp32 master shard and compute weights) from whole tensors, of
        which this tensor rank keeps its slice."""
        seen = set()
        for name, tensor in tensors:
            seen.add(name)
            self.part_of(name)._load(name, self.local(name, tensor))
        missing = {name for part in self.parts for name in part.names} - seen
        if missing:
            raise KeyError(f"no values given for parameters {sorted(missing)[:5]}")
        self.sync_weights_from_master()

    def _load(self, name: str, tensor: Tensor) -> None:
        """Set parameter `name` from this rank's slice of it."""
        if name not in self.owned_names:
            copy = self.tied_copy
            if copy is not None and copy.weight is not None and name == self.names[copy.index]:
                copy.weight.copy_(self._compute_weights(tensor))
            return
        index = self.names.index(name)
        if not self.shard_weights:
            self.parameter_view(self.weights, index).copy_(self._compute_weights(tensor))
        for stage_shard, (param_start, param_end, shard_start, _) in self._owned(index):
            piece = tensor.reshape(-1)[param_start:param_end].to(self.device, torch.float32)
            stage_shard.set_master(shard_start, piece)

    def _compute_weights(self, tensor: Tensor) -> Tensor:
        """The compute weights of master values: with split masters their high halves, which
        round ties otherwise than a cast (every rank then holds what the owners' shards do)."""
        if not self.split_masters:
            return tensor
        values = tensor.to(self.device, torch.float32)
        high = torch.empty(values.shape, dtype=torch.bfloat16, device=self.device)
        master_split.split_(values, high, torch.empty_like(high, dtype=torch.int16))
        return high

    def local(self, name: str, whole: Tensor) -> Tensor:
        """This rank's slice of parameter `name`'s whole tensor: its experts' (expert
        parallelism), its tensor slice of them."""
        expert = self.mesh.expert
        if self.metas[name].expert_split and expert.size > 1:
            whole = whole.chunk(expert.size)[expert.rank]
        split = self.metas[name].tensor_split
        if split is None or self.tensor.size == 1:
            return whole
        return split.local(whole, self.tensor.rank, self.tensor.size)

    def whole_shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(self.part_of(name).shapes[name])
        shape = full_shape(shape, self.metas[name].tensor_split if self.tensor.size > 1 else None)
        if self.metas[name].expert_split:
            shape = (shape[0] * self.mesh.expert.size, *shape[1:])
        return shape

    def _owned(self, index: int) -> list[tuple[Shard, tuple[int, int, int, int]]]:
        """This rank's pieces of parameter `index` (of a stage it runs)."""
        stage, _, _ = self.layout.parameter(index)
        return [
            (self.shards[stage], (p0, p1, s0, s1))
            for i, p0, p1, s0, s1 in self.layout.shard_parameters(stage, self.data.rank)
            if i == index
        ]

    @torch.no_grad()
    def sync_weights_from_master(self) -> None:
        """Compute weights of this rank's shards from the masters (exactly what the optimizer
        step writes), so that a restored run computes bit for bit as the original did."""
        for part in self.parts:
            for shard in part.shards.values():
                if shard.master is not None and self.mixed_precision:
                    shard.weight.copy_(shard.master)  # split masters hold the weights already
        for part in self.parts:
            if part.gatherer is not None:
                part.gatherer.weights_changed()

    def full_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """Every parameter of this tensor rank in the compute dtype (views: copy each before
        taking the next), each sent by the pipeline rank that holds it. With ZeRO-3 each stage
        is gathered in turn: every rank must iterate to the end."""
        if self.refresh is not None:
            self.refresh.wait_all()
        for stage in range(self.layout.num_stages):
            owned = stage in self.owned
            if self.gatherer is not None and owned:
                self.gatherer.ensure(stage, whole=True)
            for index in self.stage_parameters[stage]:
                name = self.names[index]
                if self.pipeline.size == 1:
                    yield name, self._view(self.weights[stage], index)
                    continue
                tensor = (
                    self._view(self.weights[stage], index)
                    if owned
                    else torch.empty(
                        self.shapes[name], dtype=self.compute_dtype, device=self.device
                    )
                )
                source = dist.get_global_rank(self.pipeline.group, stage % self.pipeline.size)
                dist.broadcast(tensor, src=source, group=self.pipeline.group)
                yield name, tensor
            if self.gatherer is not None and owned:
                self.gatherer.release(stage)

    def whole_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """Every parameter whole, its tensor-parallel slices (and expert-parallel shares)
        gathered: every rank of the tensor and expert groups (and with ZeRO-3 of the data
        group) must iterate to the end."""
        expert = self.mesh.expert
        for part in self.parts:
            for name, tensor in part.full_parameters():
                split = self.metas[name].tensor_split
                if split is not None and self.tensor.size > 1:
                    slices = [torch.empty_like(tensor) for _ in range(self.tensor.size)]
                    dist.all_gather(slices, tensor.contiguous(), group=self.tensor.group)
                    tensor = split.merge(slices)
                if part is self.experts:
                    shares = [torch.empty_like(tensor) for _ in range(expert.size)]
                    dist.all_gather(shares, tensor.contiguous(), group=expert.group)
                    tensor = torch.cat(shares)
                yield name, tensor


def _set_parameter(model: torch.nn.Module, name: str, parameter: torch.nn.Parameter) -> None:
    *path, leaf = name.split(".")
    module = model
    for part in path:
        module = getattr(module, part)
    module._parameters[leaf] = parameter
