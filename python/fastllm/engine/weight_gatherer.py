"""ZeRO-3: each rank keeps only its shard of the compute weights; a stage's full weights exist
only while the stage runs.

A stage is all-gathered into its flat buffer one stage ahead of use — in the forward pass
when the previous stage starts, in the backward pass when the next one starts its backward —
and the buffer's storage is freed once the stage is done. The parameters stay views of those
buffers throughout, so the tensors autograd saved in the forward pass read the weights
gathered again for the backward pass. The collectives are asynchronous (on NCCL's own stream
on GPUs) and every rank runs the same stages in the same order, so they match. A stage with FP8
linear layers is gathered as FP8 images of its weights (engine/fp8_gather.py) unless it is
needed whole in bf16."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastllm.engine.buffers import GroupBuffers
from fastllm.engine.fp8_gather import Fp8Gather
from fastllm.engine.stages import stages_read
from fastllm.engine.update_fence import UpdateFence


class WeightGatherer:
    """Gathers and frees the stages this pipeline rank runs: driven by the stages' forward
    passes (`install_hooks`), or by the pipeline runner's program."""

    def __init__(self, buffers: GroupBuffers, tied_here: bool, fence: UpdateFence) -> None:
        """`tied_here`: the group holds the embedding that the head on this rank reads;
        `fence`: what a gather waits for of the last update of its stage's shard."""
        self.group, self.tied_here, self.fence = buffers, tied_here, fence
        # Aliases of the buffers with their own version counters: gathering into them again
        # must not look to autograd like an in-place change of the weights it saved.
        self.buffers = [stage.weights.data for stage in buffers.stages]
        self.nbytes = [b.numel() * b.element_size() for b in self.buffers]
        self.gathered: set[int] = set()
        """Stages whose buffer holds (or is receiving) the full weights."""
        self.pending: dict[int, list[Any]] = {}
        """Stages whose all-gathers are still in flight."""
        self.in_fp8: set[int] = set()
        """Gathered stages whose FP8 weights came as FP8 images (their bf16 values absent)."""
        self.fp8: Fp8Gather | None = None
        """Made at the first gather for a forward or backward pass (the FP8 layers are marked
        after the buffers are made)."""
        self.last = len(buffers.stages) - 1
        self.held = False
        """Every stage gathered and kept (`hold`): the forward hooks do nothing."""

    def install_hooks(self, modules: list[list[torch.nn.Module]]) -> None:
        """Gather in the stages' forward and backward passes (one process per pipeline)."""
        for stage, stage_modules in enumerate(modules):
            stage_modules[0].register_forward_pre_hook(self._forward_hook(stage))
            stage_modules[-1].register_forward_hook(self._output_hook(stage))

    def needs(self, stage: int) -> set[int]:
        """Stages whose weights running `stage` reads."""
        return stages_read(stage, self.last + 1, self.tied_here)

    def weights_changed(self) -> None:
        """The shards were written (an optimizer step, a restore): drop the gathered stages,
        requantize the FP8 images before the next gather."""
        self.keep_only(set())
        if self.fp8 is not None:
            self.fp8.stale = True

    def prefetch(self, stage: int, whole: bool = False) -> None:
        """Start gathering `stage`; `whole`: every weight in bf16, FP8 layers' too."""
        if stage in self.gathered:
            if not (whole and stage in self.in_fp8):
                return
            self.release(stage)
        self.fence.wait(stage)
        if self.fp8 is None and not whole:
            self.fp8 = Fp8Gather(self.group)
        buffer = self.buffers[stage]
        buffer.untyped_storage().resize_(self.nbytes[stage])
        if self.fp8 is not None and stage in self.fp8.stages and not whole:
            self.pending[stage] = self.fp8.gather(stage)
            self.in_fp8.add(stage)
        else:
            shard = self.group.weight_shards[stage]
            group = self.group.data.group
            self.pending[stage] = [
                dist.all_gather_into_tensor(buffer, shard, group=group, async_op=True)
            ]
        self.gathered.add(stage)

    def ensure(self, stage: int, whole: bool = False) -> None:
        """Block until `stage`'s full weights are in its buffer (`whole`: in bf16, FP8 layers'
        too; otherwise those may come as FP8 images)."""
        self.prefetch(stage, whole)
        works = self.pending.pop(stage, None)
        if works is None:
            return
        for work in works:
            work.wait()
        if stage in self.in_fp8:
            assert self.fp8 is not None
            self.fp8.finish(stage, self.buffers[stage])

    def release(self, stage: int) -> None:
        if stage not in self.gathered:
            return
        for work in self.pending.pop(stage, []):  # never free memory a collective still writes
            work.wait()
        if stage in self.in_fp8:
            assert self.fp8 is not None
            self.fp8.release(stage)
            self.in_fp8.discard(stage)
        self.buffers[stage].untyped_storage().resize_(0)
        self.gathered.discard(stage)

    def keep_only(self, stages: set[int]) -> None:
        for stage in sorted(self.gathered - stages):
            self.release(stage)

    def before_forward(self, stage: int) -> None:
        """What `stage`'s forward pass reads gathered, the next stage's on its way (the next
        one this pipeline rank runs), every other stage released."""
        if self.held:
            return
        later = [s for s in self.group.owned if s > stage]
        upcoming = self.needs(later[0]) if later else set()
        self.keep_only(self.needs(stage) | upcoming)
        for needed in sorted(self.needs(stage)):
            self.ensure(needed)
        for ahead in sorted(upcoming):
            self.prefetch(ahead)

    def hold(self) -> None:
        """Gather every stage this pipeline rank runs and keep them until `release_all`,
        whatever runs meanwhile."""
        for stage in self.group.owned:
            self.ensure(stage)
        self.held = True

    def release_all(self) -> None:
        self.held = False
        self.keep_only(set())

    def _forward_hook(self, stage: int) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, _args: Any) -> None:
            self.before_forward(stage)

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
