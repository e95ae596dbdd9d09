"""ZeRO-2: each stage's gradient is reduce-scattered into the ranks' shards as soon as its
backward pass is done, overlapping the backward pass of the stages before it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from fastllm.engine.flat_model import FlatModel


class GradientReducer:
    """ZeRO-2: once every parameter of a stage has its gradient for this backward pass, the
    stage's full gradient is summed over ranks into each rank's shard by an asynchronous
    reduce-scatter, which overlaps the backward pass of the stages before it: straight into the
    shard for the step's first micro-batch, else into a scratch buffer added to the shard just
    before the stage that reuses that buffer needs it (or at the end of the pass). Stages finish
    in the same order on every rank, so the collectives match."""

    def __init__(self, flat: FlatModel) -> None:
        self.flat = flat
        self.expected = [0] * flat.layout.num_stages
        for _, _, stage, _ in flat.specs:
            self.expected[stage] += 1
        self.received = [0] * flat.layout.num_stages
        # What a reduce-scatter writes, one buffer per gradient buffer (stage parity).
        largest = max(shard.grad.numel() for shard in flat.shards)
        pool = [torch.empty(largest, dtype=torch.float32, device=flat.device) for _ in range(2)]
        self.scratch = [pool[s % 2][: shard.grad.numel()] for s, shard in enumerate(flat.shards)]
        self.in_flight: dict[int, tuple[Any, int]] = {}
        """Per gradient buffer (stage parity): the reduce-scatter reading it, and its stage."""
        self.shard_fresh = [True] * flat.layout.num_stages
        """Per stage: the shard holds no gradient of this step yet."""

    def new_step(self) -> None:
        self.shard_fresh = [True] * len(self.shard_fresh)

    def before_accumulate(self, stage: int) -> None:
        pending = self.in_flight.get(stage % 2)
        if pending is not None and pending[1] != stage:
            self._complete(stage % 2)

    def parameter_done(self, stage: int) -> None:
        self.received[stage] += 1
        if self.received[stage] == self.expected[stage]:
            self._start(stage)

    def flush(self) -> None:
        for stage in reversed(range(len(self.received))):
            if self.received[stage] < self.expected[stage]:
                self._start(stage)
        for parity in list(self.in_flight):
            self._complete(parity)
        self.received = [0] * len(self.received)

    @torch.no_grad()
    def _start(self, stage: int) -> None:
        if stage % 2 in self.in_flight:
            self._complete(stage % 2)
        self.received[stage] = self.expected[stage]
        self.flat.complete_gradients(stage)
        target = self.flat.shards[stage].grad if self.shard_fresh[stage] else self.scratch[stage]
        work = dist.reduce_scatter_tensor(target, self.flat.grads[stage], async_op=True)
        self.in_flight[stage % 2] = (work, stage)

    @torch.no_grad()
    def _complete(self, parity: int) -> None:
        work, stage = self.in_flight.pop(parity)
        work.wait()
        if self.shard_fresh[stage]:
            self.shard_fresh[stage] = False
        else:
            self.flat.shards[stage].grad.add_(self.scratch[stage])
        self.flat.consumed_gradients(stage)
