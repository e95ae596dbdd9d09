"""Summing the gradients over data-parallel ranks into each rank's shard, stage by stage, as
soon as a stage's backward pass is done, overlapping the backward pass of the stages before it.
ZeRO-2 and 3 do it in every backward pass (the full gradient of a stage lives only that long);
ZeRO-1 in the last backward pass of a step (the step's program arms it), or before the
optimizer step when no backward pass did. With tensor parallelism, the prefix of a stage's gradient that belongs to
parameters replicated over tensor ranks is first all-reduced over the tensor group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fastllm.engine.buffers import GroupBuffers


class GradientReducer:
    """Once every parameter of a stage has its gradient for this backward pass, the stage's full
    gradient is summed over ranks into each rank's shard by an asynchronous reduce-scatter.

    ZeRO-2 (`buffers.shard_gradients`): straight into the shard for the step's first micro-batch,
    else into a scratch buffer added to the shard just before the stage that reuses the full
    buffer (stage parity) needs it, or at the end of the pass. ZeRO-1: into a scratch buffer
    copied over the shard's part of the full buffer, only while `armed` (the step's last
    backward pass: `ModelStages.arm_reduction`). Stages finish in the same order on every rank, so the collectives match."""

    def __init__(self, buffers: GroupBuffers) -> None:
        self.buffers = buffers
        self.sharded = buffers.shard_gradients
        self.armed = self.sharded
        """Reduce in this backward pass (always with ZeRO-2)."""
        self.uses = 1
        """The forward passes the coming backward pass runs back through (a micro-batch's
        pieces, when it runs whole): a gradient sink writes once per use, autograd once."""
        self.expected = [
            sum(not buffers.metas[buffers.names[i]].balancing_bias for i in stage.parameters)
            for stage in buffers.stages
        ]
        """Per stage, its parameters that get gradients; it is done once it received
        `expected * uses` writes."""
        self.received = [0] * len(buffers.stages)
        """Per stage, the writes of this backward pass, each counted in uses."""
        # What a reduce-scatter writes: two buffers used in turn (`buffers.slot`).
        # (None with one data rank: the tensor all-reduce works in place.)
        shards, device = buffers.shards, buffers.device
        largest = max(s.grad.numel() for s in shards.values()) if buffers.data.size > 1 else 0
        pool = [torch.empty(largest, dtype=torch.float32, device=device) for _ in range(2)]
        self.scratch = {
            stage: pool[buffers.slot(stage)][: shard.grad.numel()]
            for stage, shard in shards.items()
        }
        self.in_flight: dict[int, tuple[Any, int]] = {}
        """Per scratch buffer (`buffers.slot`): the reduce-scatter writing it, and its stage."""
        self.shard_fresh = [True] * len(buffers.stages)
        """ZeRO-2, per stage: the shard holds no gradient of this step yet."""
        self.reduced = False
        """ZeRO-1: this step's gradients are summed; another backward pass would be lost."""

    def new_step(self) -> None:
        self.shard_fresh = [True] * len(self.shard_fresh)
        self.reduced = False
        self.armed = self.sharded

    def before_accumulate(self, stage: int) -> None:
        if self.reduced:
            raise RuntimeError(
                "a backward pass after this step's gradients were summed over ranks: only the "
                "step's last backward pass may reduce them (ZeRO-1)"
            )
        slot = self.buffers.slot(stage)
        pending = self.in_flight.get(slot)
        if self.sharded and pending is not None and pending[1] != stage:
            self._complete(slot)

    def parameter_done(self, stage: int, every_use: bool) -> None:
        """A gradient of a parameter of `stage` was written: its sum over `every_use` (autograd
        summed the uses first), or over one use (a gradient sink)."""
        self.received[stage] += self.uses if every_use else 1
        if self.armed and self.received[stage] == self._complete_count(stage):
            self._start(stage)

    def _complete_count(self, stage: int) -> int:
        return self.expected[stage] * self.uses

    def flush(self) -> None:
        """End of a backward pass: when armed, reduce the stages still pending (a parameter
        without gradient leaves its stage incomplete) and wait for every reduction."""
        if self.armed:
            self._reduce_remaining()
            self.reduced = not self.sharded
        else:
            self.buffers.gradients.complete_all()
        self.received = [0] * len(self.received)

    def stage_done(self, stage: int, reduce: bool) -> None:
        """A pipeline step's backward pass of `stage` is over (run with `armed = reduce`):
        when reducing, start it if some parameter got no gradient; count afresh."""
        if reduce and self.received[stage] < self._complete_count(stage):
            self._start(stage)
        elif not reduce:
            self.buffers.gradients.complete(stage)
        self.received[stage] = 0

    def finish_step(self) -> None:
        """The pipeline step's backward passes are over: wait for the reductions (ZeRO-1 has
        now summed every stage)."""
        for slot in list(self.in_flight):
            self._complete(slot)
        self.reduced = not self.sharded

    def ensure_reduced(self) -> None:
        """Before the optimizer reads the shards: ZeRO-1 sums now if no backward pass did."""
        if not self.sharded and not self.reduced:
            self.received = [0] * len(self.received)
            self._reduce_remaining()
            self.reduced = True

    def _reduce_remaining(self) -> None:
        for stage in reversed(self.buffers.owned):
            if self.received[stage] < self._complete_count(stage):
                self._start(stage)
        for slot in list(self.in_flight):
            self._complete(slot)

    @torch.no_grad()
    def _start(self, stage: int) -> None:
        buffers = self.buffers
        slot = buffers.slot(stage)
        if slot in self.in_flight:
            self._complete(slot)
        self.received[stage] = self._complete_count(stage)
        buffers.gradients.complete(stage)
        grads, reduced_end = buffers.grads[stage], buffers.stages[stage].tensor_reduced_end
        work = None
        if reduced_end:  # the replicated parameters' parts, summed over tensor ranks first
            work = dist.all_reduce(grads[:reduced_end], group=buffers.tensor.group, async_op=True)
        if buffers.data.size > 1:
            if work is not None:
                work.wait()
            shard = buffers.shards[stage]
            direct = self.sharded and self.shard_fresh[stage]
            target = shard.grad if direct else self.scratch[stage]
            work = dist.reduce_scatter_tensor(
                target, grads, group=buffers.data.group, async_op=True
            )
        if work is not None:
            self.in_flight[slot] = (work, stage)

    @torch.no_grad()
    def _complete(self, slot: int) -> None:
        work, stage = self.in_flight.pop(slot)
        work.wait()
        if self.buffers.data.size == 1:  # the shard is the whole buffer, summed in place
            return
        shard = self.buffers.shards[stage]
        if not self.sharded:
            shard.grad.copy_(self.scratch[stage])  # the rank's range of its full buffer
            return
        if self.shard_fresh[stage]:
            self.shard_fresh[stage] = False
        else:
            shard.grad.add_(self.scratch[stage])
        self.buffers.gradients.consumed(stage)
