"""The fp32 gradient buffers of the flat model: one per stage, every parameter's gradient a view
of it, accumulated over the micro-batches of a step.

Nothing zero-fills them: the first gradient a parameter gets after its buffer was consumed
(reduced over ranks, or read by the optimizer) overwrites its view, later ones add to it, and
before a buffer is read whatever the pass did not write is zeroed (`complete`). Gradients come
from autograd (`add`) or straight from a matmul (`add_product`, for the linear layers' gradient
sinks: the product writes or adds into the view itself).

`transient` buffers hold memory only while they hold a gradient: from the first gradient a
stage gets in a step until the step consumes it (the optimizer, or ZeRO-1's reduction once
the optimizer has read the shards). The forward pass of a step's first micro-batch then runs
without them, which lowers its peak (at the loss, with every activation stored) by 4 bytes
per parameter of the stages whose backward has not begun. ZeRO-2 pools two buffers instead."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from fastllm_kernels.accumulate import accumulate_
from fastllm_kernels.recipe import GradientProduct


class GradientBuffers:
    def __init__(
        self,
        stage_sizes: list[int],
        stage_parameters: list[list[int]],
        view: Callable[[Tensor, int], Tensor],
        ranges: Callable[[int], tuple[int, int, int]],
        device: torch.device,
        pooled: bool,
        slots: list[int] | None = None,
        transient: bool = False,
    ) -> None:
        """`view(stage_buffer, index)`: a parameter's view of its stage's buffer; `ranges(index)`:
        its (stage, offset, numel). `pooled` (ZeRO-2): consecutive stages share two buffers
        (stage s the one of `slots[s]`), since a stage's gradient only lives while its backward
        pass runs. Stages of size 0 (run by other pipeline ranks) list no parameters.
        `transient` (not with `pooled`): each stage's memory is taken at its first gradient
        and given back once consumed."""
        assert not (pooled and transient)
        self.stage_parameters, self.pooled, self.transient = stage_parameters, pooled, transient
        stages = range(len(stage_sizes))
        if pooled:
            slots = slots or [s % 2 for s in stages]
            largest = max(stage_sizes)
            pool = [torch.zeros(largest, dtype=torch.float32, device=device) for _ in range(2)]
            self.buffers = [pool[slots[s]][: stage_sizes[s]] for s in stages]
        else:
            self.buffers = [
                torch.zeros(size, dtype=torch.float32, device=device) for size in stage_sizes
            ]
        self.nbytes = [buffer.numel() * buffer.element_size() for buffer in self.buffers]
        self.resident = [True] * len(self.buffers)
        """Per stage: its buffer has its memory (always, unless transient). Transient ones
        give it back at their first `consumed`, once every view of them has been made."""
        indices = [index for stage in stage_parameters for index in stage]
        self.stage_of = {index: ranges(index)[0] for index in indices}
        self.views = {index: view(self.buffers[self.stage_of[index]], index) for index in indices}
        self.fresh = dict.fromkeys(indices, True)
        """Per parameter: its view holds stale values that the next gradient overwrites."""
        self.gaps = [
            _gaps(stage_sizes[s], [ranges(i) for i in stage_parameters[s]])
            if stage_sizes[s]
            else []
            for s in stages
        ]

    @property
    def held_bytes(self) -> int:
        """Bytes the buffers hold once every stage has a gradient (pooled: the two buffers)."""
        return 2 * max(self.nbytes, default=0) if self.pooled else sum(self.nbytes)

    def add(self, index: int, grad: Tensor) -> None:
        self._hold(self.stage_of[index])
        if self.fresh[index]:
            self.views[index].copy_(grad)
            self.fresh[index] = False
        else:
            accumulate_(self.views[index], grad)

    def add_product(self, index: int, product: GradientProduct) -> None:
        self._hold(self.stage_of[index])
        product(self.views[index], not self.fresh[index])
        self.fresh[index] = False

    def complete(self, stage: int) -> None:
        """Before the stage's buffer is read: zero what this pass did not write (a parameter
        that got no gradient; when pooled, the alignment gaps, which the other stages sharing
        the buffer may have written)."""
        if self.stage_parameters[stage]:
            self._hold(stage)
        for index in self.stage_parameters[stage]:
            if self.fresh[index]:
                self.views[index].zero_()
                self.fresh[index] = False
        if self.pooled:
            for start, end in self.gaps[stage]:
                self.buffers[stage][start:end].zero_()

    def complete_all(self) -> None:
        for stage in range(len(self.buffers)):
            self.complete(stage)

    def consumed(self, stage: int) -> None:
        """The stage's buffer was read: the next gradients overwrite it (a transient buffer
        gives its memory back until then)."""
        for index in self.stage_parameters[stage]:
            self.fresh[index] = True
        if self.transient and self.resident[stage]:
            self.buffers[stage].untyped_storage().resize_(0)
            self.resident[stage] = False

    def _hold(self, stage: int) -> None:
        """Give a transient buffer its memory back. Its contents are garbage: every parameter's
        view is fresh (to be overwritten or zeroed), and the alignment gaps are zeroed here
        (the optimizer and the gradient norm read whole shards)."""
        if not self.resident[stage]:
            buffer = self.buffers[stage]
            buffer.untyped_storage().resize_(self.nbytes[stage])
            for start, end in self.gaps[stage]:
                buffer[start:end].zero_()
            self.resident[stage] = True


def _gaps(size: int, parameters: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The ranges of a stage's buffer that none of its (stage, offset, numel) parameters
    cover."""
    gaps, position = [], 0
    for _, offset, numel in sorted(parameters, key=lambda p: p[1]):
        if offset > position:
            gaps.append((position, offset))
        position = offset + numel
    if size > position:
        gaps.append((position, size))
    return gaps
