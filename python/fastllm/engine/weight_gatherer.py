"""ZeRO-3: each rank keeps only its shard of the compute weights; a stage's full weights exist
only while the stage runs.

A stage is all-gathered into its flat buffer one stage ahead of use — in the forward pass
when the previous stage starts, in the backward pass when the next one starts its backward —
and the buffer's storage is freed once the stage is done. The parameters stay views of those
buffers throughout, so the tensors autograd saved in the forward pass read the weights
gathered again for the backward pass. The collectives are asynchronous (on NCCL's own stream
on GPUs) and every rank runs the same stages in the same order, so they match."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastllm.engine.pipeline.schedule import stages_read

if TYPE_CHECKING:
    from fastllm.engine.flat_model import FlatModel


class WeightGatherer:
    """Gathers and frees the stages this pipeline rank runs: driven by the stages' forward
    passes (`install_hooks`), or by the pipeline runner's program."""

    def __init__(self, flat: FlatModel) -> None:
        self.flat = flat
        # Aliases of the buffers with their own version counters: gathering into them again
        # must not look to autograd like an in-place change of the weights it saved.
        self.buffers = [weights.data for weights in flat.weights]
        self.nbytes = [b.numel() * b.element_size() for b in self.buffers]
        self.gathered: set[int] = set()
        """Stages whose buffer holds (or is receiving) the full weights."""
        self.pending: dict[int, Any] = {}
        """Stages whose all-gather is still in flight."""
        self.last = flat.layout.num_stages - 1

    def install_hooks(self, modules: list[list[torch.nn.Module]]) -> None:
        """Gather in the stages' forward and backward passes (one process per pipeline)."""
        for stage, stage_modules in enumerate(modules):
            stage_modules[0].register_forward_pre_hook(self._forward_hook(stage))
            stage_modules[-1].register_forward_hook(self._output_hook(stage))

    def needs(self, stage: int) -> set[int]:
        """Stages whose weights running `stage` reads."""
        return stages_read(stage, self.last + 1, self.flat.tied_here)

    def prefetch(self, stage: int) -> None:
        if stage in self.gathered:
            return
        buffer = self.buffers[stage]
        buffer.untyped_storage().resize_(self.nbytes[stage])
        self.pending[stage] = dist.all_gather_into_tensor(
            buffer, self.flat.shards[stage].weight, group=self.flat.data.group, async_op=True
        )
        self.gathered.add(stage)

    def ensure(self, stage: int) -> None:
        """Block until `stage`'s full weights are in its buffer."""
        self.prefetch(stage)
        work = self.pending.pop(stage, None)
        if work is not None:
            work.wait()

    def release(self, stage: int) -> None:
        if stage not in self.gathered:
            return
        work = self.pending.pop(stage, None)
        if work is not None:  # never free memory a collective still writes
            work.wait()
        self.buffers[stage].untyped_storage().resize_(0)
        self.gathered.discard(stage)

    def keep_only(self, stages: set[int]) -> None:
        for stage in sorted(self.gathered - stages):
            self.release(stage)

    def _forward_hook(self, stage: int) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, _args: Any) -> None:
            upcoming = self.needs(stage + 1) if stage < self.last else set()
            self.keep_only(self.needs(stage) | upcoming)
            for needed in sorted(self.needs(stage)):
                self.ensure(needed)
            for ahead in sorted(upcoming):
                self.prefetch(ahead)

        return hook

    def _before_backward(self, stage: int) -> None:
        upcoming = {stage - 1} if stage > 0 else set()
        self.keep_only({stage} | upcoming)
        self.ensure(stage)
        for ahead in upcoming:
            self.prefetch(ahead)

    def _output_hook(self, stage: int) -> Callable[..., Any]:
        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
            if not torch.is_grad_enabled():
                return output
            return _on_backward(output, lambda: self._before_backward(stage))

        return hook


def _on_backward(output: Any, callback: Callable[[], None]) -> Any:
    """`output` (a tensor or a tuple holding tensors), with `callback` called once the
    gradients of all its tensors that need one are ready, before they flow further back."""
    items = list(output) if isinstance(output, tuple) else [output]
    positions = [
        i for i, item in enumerate(items) if isinstance(item, Tensor) and item.requires_grad
    ]
    if not positions:
        return output
    wrapped = _BeforeBackward.apply(callback, *(items[i] for i in positions))
    for i, tensor in zip(positions, wrapped, strict=True):
        items[i] = tensor
    return tuple(items) if isinstance(output, tuple) else items[0]


class _BeforeBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)
