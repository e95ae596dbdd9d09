"""One group of parameters (the dense ones, or the experts') in its flat buffers, with what
moves its data: the hooks that put each backward pass's gradients into the buffers, the
reduction of the gradients over the group's data ranks (GradientReducer), and the compute
weights brought back after a step (WeightRefresh, ZeRO-1/2) or gathered while a stage runs
(WeightGatherer, ZeRO-3)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from fastllm.engine.buffers import GroupBuffers
from fastllm.engine.gradient_reducer import GradientReducer
from fastllm.engine.update_fence import UpdateFence
from fastllm.engine.weight_gatherer import WeightGatherer
from fastllm.engine.weight_refresh import WeightRefresh
from fastllm.parallel.tensor import DeferredWork
from fastllm_kernels.recipe import GradientProduct


class ParameterGroup:
    def __init__(
        self,
        buffers: GroupBuffers,
        *,
        deferral: DeferredWork | None,
        tied_here: bool,
        stage_modules: list[list[torch.nn.Module]] | None,
        fence: UpdateFence,
    ) -> None:
        """`deferral`: where the writes of the tensor-split weights' gradients wait for the
        tensor collective (None without tensor parallelism). `tied_here`:
        the head on this rank reads the group's embedding. `stage_modules`: each stage's
        modules, whose forward passes then drive the gathers and refreshes (None: the pipeline
        runner's program does). `fence`: what a gather or refresh of a stage's shard waits
        for of the last update."""
        self.buffers = buffers
        trainable = buffers.trainable  # a frozen group only has weights to gather
        needs_reducer = buffers.data.size > 1 or any(s.tensor_reduced_end for s in buffers.stages)
        self.reducer = GradientReducer(buffers) if trainable and needs_reducer else None
        self._hooks = []
        for stage in buffers.owned if trainable else []:
            for index, parameter in buffers.stages[stage].views.items():
                hook = self._accumulate_hook(index)
                self._hooks.append(parameter.register_post_accumulate_grad_hook(hook))
                # A projection's weight gradient goes straight from the matmul into the buffer.
                recipe = buffers.metas[buffers.names[index]].recipe
                if recipe is not None:
                    recipe.gradient_sink = self._gradient_sink(index, deferral)
        self.gatherer = WeightGatherer(buffers, tied_here, fence) if buffers.shard_weights else None
        if self.gatherer is not None and stage_modules is not None:
            self.gatherer.install_hooks(stage_modules)
        refreshed = trainable and buffers.data.size > 1 and not buffers.shard_weights
        self.refresh = WeightRefresh(buffers, fence) if refreshed else None
        if self.refresh is not None and stage_modules is not None:
            self.refresh.install_hooks(stage_modules)

    def _accumulate_hook(self, index: int):
        # A tensor's hooks are held from C++, out of the garbage collector's sight: a strong
        # reference to this group from one would keep every buffer alive after its owner (a
        # Trainer) is dropped. So the hook holds the group weakly.
        group, stage = weakref.ref(self), self.buffers.layout.parameter(index)[0]

        def hook(parameter: Tensor) -> None:
            # Gradients land in the fp32 buffer (accumulated over micro-batches), never in .grad.
            grad, owner = parameter.grad, group()
            if grad is None or owner is None:  # it went to the parameter's sink, or no group
                return
            owner.write_gradient(
                stage, lambda: owner.buffers.gradients.add(index, grad), every_use=True
            )
            parameter.grad = None

        return hook

    def _gradient_sink(
        self, index: int, deferral: DeferredWork | None
    ) -> Callable[[GradientProduct], None]:
        buffers = self.buffers
        stage = buffers.layout.parameter(index)[0]
        # A column-parallel weight's gradient waits for the collective of the layer's input
        # gradient, to run while it is in flight (parallel.tensor.enter).
        split = buffers.metas[buffers.names[index]].tensor_split is not None
        deferred = deferral if split else None

        def sink(product: GradientProduct) -> None:
            def add() -> None:
                buffers.gradients.add_product(index, product)

            def write() -> None:
                self.write_gradient(stage, add, every_use=False)

            if deferred is not None:
                deferred.defer(write)
            else:
                write()

        return sink

    def write_gradient(self, stage: int, add: Callable[[], None], every_use: bool) -> None:
        """`add()` puts this backward pass's gradient of a parameter of `stage` into its buffer
        (autograd's: summed over `every_use` of the weight; a gradient sink's: one use's); with
        data parallelism, the reducer frees the buffer first and reduces it once the stage is
        done."""
        if self.reducer is not None:
            self.reducer.before_accumulate(stage)
        add()
        if self.reducer is not None:
            self.reducer.parameter_done(stage, every_use)

    def wait_for_weights(self, stage: int) -> None:
        if self.refresh is not None:
            self.refresh.wait(stage)
        if self.gatherer is not None:
            self.gatherer.ensure(stage)

    def finish_backward(self) -> None:
        if self.reducer is not None:
            self.reducer.flush()
        else:
            self.buffers.gradients.complete_all()
        if self.gatherer is not None:
            self.gatherer.keep_only(set())

    def finish_stage_backward(self, stage: int, reduce: bool) -> None:
        if self.reducer is not None:
            self.reducer.stage_done(stage, reduce)
        elif reduce:
            self.buffers.gradients.complete(stage)

    def finish_step_backward(self) -> None:
        if self.reducer is not None:
            self.reducer.finish_step()
        else:
            self.buffers.gradients.complete_all()
        if self.gatherer is not None:
            self.gatherer.keep_only(set())

    def reduce_gradients(self) -> None:
        if self.reducer is not None:
            self.reducer.ensure_reduced()
        else:
            self.buffers.gradients.complete_all()

    def zero_grad(self) -> None:
        for stage in self.buffers.owned:
            self.buffers.gradients.consumed(stage)
        if self.reducer is not None:
            self.reducer.new_step()
