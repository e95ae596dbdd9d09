"""A weight two stages read (`ParameterMeta.tied`: the embedding the head shares) when pipeline
parallelism puts the two stages on different ranks: the head's rank holds a copy of the weight
(refreshed after every optimizer step) and its gradient, summed into the embedding's shards
before the optimizer step. The copy is counted once in the gradient norm: only the shards
are."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import Tensor

from fastllm.config.layout import pipeline_rank_of
from fastllm.engine.buffers import GroupBuffers, set_parameter
from fastllm.parallel import point_to_point


def tied_weights(model: torch.nn.Module, buffers: GroupBuffers) -> TiedWeights | None:
    """The tied weight of `buffers` (its first stage's, read by the last stage too) when the
    last stage runs on another pipeline rank than the first and this rank runs one of them."""
    tied = [name for name in buffers.names if buffers.metas[name].tied]
    if not tied:
        return None
    (name,) = tied
    pipeline = buffers.pipeline
    owner_rank = pipeline_rank_of(buffers.layout.parameter(name)[0], pipeline.size)
    reader_rank = pipeline_rank_of(len(buffers.stages) - 1, pipeline.size)
    if reader_rank == owner_rank or pipeline.rank not in (reader_rank, owner_rank):
        return None
    peer = reader_rank if pipeline.rank == owner_rank else owner_rank
    return TiedWeights(model, buffers, name, dist.get_global_rank(pipeline.group, peer))


class TiedWeights:
    def __init__(self, model: torch.nn.Module, buffers: GroupBuffers, name: str, peer: int) -> None:
        """`peer`: global rank of the other side (same tensor and data ranks)."""
        self.buffers, self.name, self.peer = buffers, name, peer
        self.index = buffers.indices[name]
        self.stage = buffers.layout.parameter(self.index)[0]
        self.weight: Tensor | None = None
        """On the reader's rank: the copy, which the head reads."""
        self.grad: Tensor | None = None
        """On the reader's rank: its fp32 gradient, accumulated over the step's micro-batches
        (none for a frozen weight, whose copy is loaded once and never changes)."""
        self.fresh = True
        if name in buffers.owned_names:
            return
        shape, device = buffers.shapes[name], buffers.device
        self.weight = torch.zeros(shape, dtype=buffers.compute_dtype, device=device)
        parameter = torch.nn.Parameter(self.weight, requires_grad=buffers.trainable)
        set_parameter(model, name, parameter)
        if not buffers.trainable:
            return
        self.grad = torch.zeros(shape, dtype=torch.float32, device=device)
        # Held weakly, as the flat buffers' hooks hold their group (ParameterGroup).
        tied = weakref.ref(self)

        def hook(parameter: Tensor) -> None:
            copy = tied()
            assert copy is not None and copy.grad is not None and parameter.grad is not None
            if copy.fresh:
                copy.grad.copy_(parameter.grad)
                copy.fresh = False
            else:
                copy.grad.add_(parameter.grad)
            parameter.grad = None

        self._hook = parameter.register_post_accumulate_grad_hook(hook)

    def load(self, tensor: Tensor) -> None:
        """The copy from this rank's slice of the whole weight (the reader's rank)."""
        assert self.weight is not None
        self.weight.copy_(self.buffers.compute_weights(tensor))

    @torch.no_grad()
    def reduce_gradient(self) -> None:
        """The reader's rank sums its copy's gradient over data ranks and sends each owner
        rank the piece of its shard, which adds it."""
        data, pieces = self.buffers.data, self._pieces()
        if self.grad is not None:
            if self.fresh:
                self.grad.zero_()
            if data.size > 1:
                dist.all_reduce(self.grad, group=data.group)
            flat = self.grad.reshape(-1)
            for p0, p1, _, _ in pieces:
                point_to_point.send(flat[p0:p1], self.peer)
            self.fresh = True
            return
        shard = self.buffers.shards[self.stage]
        for p0, p1, s0, s1 in pieces:
            received = torch.empty(p1 - p0, dtype=torch.float32, device=self.buffers.device)
            shard.grad[s0:s1].add_(point_to_point.recv(received, self.peer))

    @torch.no_grad()
    def sync(self) -> None:
        """The owner's rank sends the reader's rank its shard's piece of the updated weight;
        the reader's ranks sum the pieces of all data ranks into their copies."""
        buffers, pieces = self.buffers, self._pieces()
        if self.weight is None:
            weight = buffers.shards[self.stage].weight
            for _, _, s0, s1 in pieces:
                point_to_point.send(weight[s0:s1], self.peer)
            return
        flat = self.weight.reshape(-1)
        flat.zero_()
        for p0, p1, _, _ in pieces:
            received = torch.empty(p1 - p0, dtype=buffers.compute_dtype, device=buffers.device)
            flat[p0:p1].copy_(point_to_point.recv(received, self.peer))
        if buffers.data.size > 1:
            dist.all_reduce(self.weight, group=buffers.data.group)

    def _pieces(self) -> list[tuple[int, int, int, int]]:
        """(parameter start, end, shard start, end) of the weight in this data rank's shard
        of its stage."""
        layout, rank = self.buffers.layout, self.buffers.data.rank
        return [
            (p0, p1, s0, s1)
            for i, p0, p1, s0, s1 in layout.shard_parameters(self.stage, rank)
            if i == self.index
        ]
