"""Sequence-data parallelism: the S ranks of a sequence-data group (consecutive ranks of the
data group) load the same sequences and each computes a part of them: one contiguous chunk
of S (`contiguous`), or chunks r and 2S-1-r of 2S (`head_tail`: with causal attention a
contiguous chunk's keys grow with its rank, a head and a tail chunk's add up to the same for
every rank).

Only attention mixes positions, so only attention communicates: each rank all-gathers the
keys and values of the group's chunks and keeps those of its causal prefix (up to the end of
its last chunk), and their gradients are reduce-scattered back to the chunks' owners in the
backward pass; both collectives run while the queries' part of the work is done. Each of its
chunks attends to the prefix up to its own end. (A loss that sums over a sequence's tokens
before a non-linear step, DPO's, adds its chunks' sums with `sum_chunks`: model/head_losses.py.)
Everything else (ZeRO, the gradient reduction over the data group) sees S more data ranks,
whose micro-batches are chunks weighted by their trained tokens (engine.batch).

The kernels know nothing of this: they only learn that the queries may be the last positions
of the keys (fastllm_kernels.attention)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from fastllm.parallel.dimension import Dimension


@dataclass(frozen=True)
class SequenceDataDimension(Dimension):
    """The sequence-data sub-group of the mesh, with the chunks each of its ranks computes."""

    chunking: Literal["contiguous", "head_tail"] = "contiguous"

    def spans_of(self, rank: int, local: int) -> list[tuple[int, int]]:
        """(start, end) in the sequence of the chunks of `rank`, which holds `local` positions
        of each sequence, in the order it holds them."""
        if self.chunking == "contiguous":
            return [(rank * local, (rank + 1) * local)]
        half, tail = local // 2, 2 * self.size - 1 - rank
        return [(rank * half, (rank + 1) * half), (tail * half, (tail + 1) * half)]

    def spans(self, local: int) -> list[tuple[int, int]]:
        """`spans_of` this rank."""
        return self.spans_of(self.rank, local)

    def take(self, x: Tensor, local: int) -> Tensor:
        """This rank's `local` positions of (batch, ≥ their last position, ...)."""
        parts = [x[:, start:end] for start, end in self.spans(local)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def chunk(self, x: Tensor) -> Tensor:
        """This rank's chunks of (batch, sequence, ...)."""
        return self.take(x, x.shape[1] // self.size)

    def prefix(self, x: Tensor) -> Tensor:
        """(batch, sequence, ...) up to the end of this rank's last chunk: the keys its
        queries see."""
        return x[:, : self.spans(x.shape[1] // self.size)[-1][1]]

    def positions(self, local: int, device: torch.device) -> Tensor:
        """The positions in the sequence of this rank's `local` ones."""
        parts = [torch.arange(start, end, device=device) for start, end in self.spans(local)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def sum_chunks(self, x: Tensor) -> Tensor:
        """`x` summed over the group's ranks, in place (one all-reduce; not differentiable):
        sums over whole sequences of what each rank summed over its chunks."""
        if self.split:
            dist.all_reduce(x, group=self.group)
        return x

    def pieces(self, local: int) -> list[tuple[int, int, int]]:
        """The causal prefix as the gathered chunks make it up, in sequence order: (rank,
        start, end) within what that rank holds."""
        end = self.spans(local)[-1][1]
        found = []
        for rank in range(self.size):
            offset = 0
            for start, stop in self.spans_of(rank, local):
                if start < end:
                    found.append((start, rank, offset, offset + stop - start))
                offset += stop - start
        return [(rank, start, stop) for _, rank, start, stop in sorted(found)]


class KeyValueGather:
    """The all-gather of one layer's keys and values (batch, chunk, kv_heads, head_size) over
    the group, started as soon as they exist so that it runs while the queries are projected
    and rotated; `finish` waits for it and returns those of the causal prefix.

    In the backward pass the reduce-scatter of their gradients is started as soon as they
    exist too, and waited for only where the key/value projection's backward pass reads them:
    autograd runs the query branch's backward passes (created later in the forward pass)
    first, meanwhile."""

    def __init__(self, k: Tensor, v: Tensor, sequence_data: SequenceDataDimension) -> None:
        self.sequence_data = sequence_data
        self.reduction: dist.Work | None = None
        self.in_flight: Tensor | None = None
        """What the reduction reads, kept alive until it is done."""
        self.k, self.v = _ReducedGradients.apply(k, v, self)
        local = torch.stack([k.detach(), v.detach()])
        self.gathered = local.new_empty((sequence_data.size, *local.shape))
        self.work = dist.all_gather_into_tensor(
            self.gathered.view(-1), local.view(-1), group=sequence_data.group, async_op=True
        )

    def finish(self) -> tuple[Tensor, Tensor]:
        k, v = _GatheredPrefix.apply(self.k, self.v, self)
        return k, v


class _ReducedGradients(torch.autograd.Function):
    """The identity; its backward pass waits for the reduce-scatter `_GatheredPrefix`'s
    started, which fills the gradients it is handed."""

    @staticmethod
    def forward(ctx: Any, k: Tensor, v: Tensor, pending: KeyValueGather) -> tuple[Tensor, Tensor]:
        ctx.pending = pending
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx: Any, d_k: Tensor, d_v: Tensor) -> tuple[Tensor, Tensor, None]:
        pending: KeyValueGather = ctx.pending
        assert pending.reduction is not None
        pending.reduction.wait()
        pending.reduction = pending.in_flight = None
        return d_k, d_v, None


class _GatheredPrefix(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, k: Tensor, v: Tensor, pending: KeyValueGather) -> tuple[Tensor, Tensor]:
        sequence_data = pending.sequence_data
        ctx.pending = pending
        ctx.local, ctx.pieces = k.shape[1], sequence_data.pieces(k.shape[1])
        pending.work.wait()
        # (ranks, 2, batch, local, ...) → (2, batch, prefix, ...), in sequence order.
        parts = [pending.gathered[rank, :, :, start:end] for rank, start, end in ctx.pieces]
        prefix = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        return prefix[0], prefix[1]

    @staticmethod
    def backward(ctx: Any, d_k: Tensor, d_v: Tensor) -> tuple[Tensor, Tensor, None]:
        pending: KeyValueGather = ctx.pending
        sequence_data = pending.sequence_data
        # Positions after this rank's last received no gradient from its queries: zeros.
        grads = d_k.new_zeros((sequence_data.size, 2, d_k.shape[0], ctx.local, *d_k.shape[2:]))
        position = 0
        for rank, start, end in ctx.pieces:
            part = slice(position, position + end - start)
            grads[rank, 0, :, start:end] = d_k[:, part]
            grads[rank, 1, :, start:end] = d_v[:, part]
            position += end - start
        mine = grads.new_empty(grads.shape[1:])
        # Filled when `_ReducedGradients` waits: nothing reads them before.
        pending.in_flight = grads
        pending.reduction = dist.reduce_scatter_tensor(
            mine.view(-1), grads.view(-1), group=sequence_data.group, async_op=True
        )
        return mine[0], mine[1], None
