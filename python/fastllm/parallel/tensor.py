"""Megatron-style tensor parallelism as explicit autograd functions on ordinary tensors (the
parameters stay views of the flat buffers; no DTensor).

A block's residual stream is replicated on the tensor ranks (or, with sequence-tensor
parallelism, split along the sequence). `enter` hands it to the column-parallel projections
that follow (q/k/v, the MLP's first layer, the vocab-parallel head): identity forward and
all-reduce backward, or all-gather forward and reduce-scatter backward. `leave` takes the
partial sums of a row-parallel projection (attention output, the MLP's second layer, the
vocab-parallel embedding) back to the stream: all-reduce forward, or reduce-scatter forward
and all-gather backward. The backward collective of `enter` overlaps the weight-gradient
matmuls of the projections it feeds: their gradient sinks are deferred to it.

The kernels know nothing of this; the model calls these functions where a layer is split."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from fastllm.parallel.dimension import Dimension


class DeferredWork:
    """Weight-gradient matmuls waiting for the next backward collective of `enter` to overlap
    with. The engine owns the queue (its gradient sinks fill it) and hands it to the tensor
    dimension; whatever no collective ran, the engine runs after the backward pass."""

    def __init__(self) -> None:
        self._work: list[Callable[[], None]] = []

    def defer(self, work: Callable[[], None]) -> None:
        self._work.append(work)

    def run(self) -> None:
        # Gradient arithmetic is never differentiated; outside autograd's backward pass (after
        # it, when no collective ran the work: a frozen first block leaves the first trained
        # layer's input without a gradient, so nothing follows it) grad mode is on.
        with torch.no_grad():
            while self._work:
                self._work.pop(0)()


@dataclass(frozen=True)
class TensorDimension(Dimension):
    """The tensor dimension of the mesh, with what its collectives need."""

    sequence_tensor_parallel: bool = False
    """Activations between layers split along the sequence over the tensor ranks (it needs
    more than one)."""
    deferral: DeferredWork | None = field(default=None, compare=False)
    """The engine's weight-gradient queue, run while `enter`'s backward collective is in
    flight; None: nothing deferred (a model built outside an engine)."""

    def run_deferred(self) -> None:
        if self.deferral is not None:
            self.deferral.run()


def enter(x: Tensor, tensor: TensorDimension) -> Tensor:
    """The residual stream (batch, sequence or its chunk, hidden) as the column-parallel layers
    read it: whole. Backward: the gradient summed over the tensor ranks."""
    if not tensor.split:
        return x
    return _Enter.apply(x, tensor)


def leave(x: Tensor, tensor: TensorDimension, bias: Tensor | None = None) -> Tensor:
    """This rank's partial sums (batch, sequence, hidden) summed over the tensor ranks, as the
    residual stream holds them (this rank's sequence chunk with sequence parallelism), plus
    the row-parallel layer's `bias`, added once after the sum."""
    out = _Leave.apply(x, tensor) if tensor.split else x
    return out if bias is None else out + bias


def counted_once(x: Tensor, tensor: TensorDimension) -> Tensor:
    """x, a value every tensor rank computes whole from the same inputs (a router's auxiliary
    loss), whose gradient flows into parameters and inputs that are summed over the tensor
    ranks: identity forward, the gradient divided by the tensor size, so the sum counts it
    once."""
    return _CountedOnce.apply(x, tensor.size) if tensor.split else x


def summed(x: Tensor, tensor: TensorDimension) -> Tensor:
    """The sum over the tensor ranks of x, each rank's part of a statistic of a tensor they
    split (the squares of its heads, for a norm over all heads), which each rank then applies
    to its own slice: all-reduce forward, and all-reduce backward, since each rank's gradient
    of the sum covers only its own slice's use of it."""
    return _Summed.apply(x, tensor) if tensor.split else x


class _Summed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, tensor: TensorDimension) -> Tensor:
        ctx.tensor = tensor
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=tensor.group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        out = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=ctx.tensor.group)
        return out, None


class _CountedOnce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, size: int) -> Tensor:
        ctx.size = size
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad / ctx.size, None


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, tensor: TensorDimension) -> Tensor:
        ctx.tensor = tensor
        return _gather_sequence(x, tensor) if tensor.sequence_tensor_parallel else x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        tensor: TensorDimension = ctx.tensor
        if tensor.sequence_tensor_parallel:
            out, work = _reduce_scatter_sequence(grad, tensor, async_op=True)
        else:
            out = grad.contiguous()
            work = dist.all_reduce(out, group=tensor.group, async_op=True)
        tensor.run_deferred()  # the weight gradients of the projections fed, while the sum runs
        work.wait()
        return out, None


class _Leave(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, tensor: TensorDimension) -> Tensor:
        ctx.tensor = tensor
        if tensor.sequence_tensor_parallel:
            return _reduce_scatter_sequence(x, tensor, async_op=False)[0]
        out = x.contiguous()
        dist.all_reduce(out, group=tensor.group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        tensor: TensorDimension = ctx.tensor
        return (_gather_sequence(grad, tensor) if tensor.sequence_tensor_parallel else grad), None


def _gather_sequence(x: Tensor, tensor: TensorDimension) -> Tensor:
    """(batch, chunk, ...) on each rank → (batch, size × chunk, ...), rank r's chunk r-th."""
    gathered = torch.empty((tensor.size, *x.shape), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(gathered.view(-1), x.contiguous().view(-1), group=tensor.group)
    return gathered.movedim(0, 1).reshape(x.shape[0], -1, *x.shape[2:])


def _reduce_scatter_sequence(
    x: Tensor, tensor: TensorDimension, async_op: bool
) -> tuple[Tensor, Any]:
    """(batch, sequence, ...) partial sums → this rank's chunk of their sum."""
    batch, length = x.shape[:2]
    chunks = (
        x.reshape(batch, tensor.size, length // tensor.size, *x.shape[2:])
        .movedim(1, 0)
        .contiguous()
    )
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    work = dist.reduce_scatter_tensor(
        out.view(-1), chunks.view(-1), group=tensor.group, async_op=async_op
    )
    return out, work


def gathered_vocabulary(x: Tensor, tensor: TensorDimension) -> Tensor:
    """(..., vocab / size) on each rank, its contiguous vocabulary slice → (..., vocab), rank
    r's slice r-th. Not differentiable: logits read whole (generation)."""
    gathered = torch.empty((tensor.size, *x.shape), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(gathered.view(-1), x.contiguous().view(-1), group=tensor.group)
    return gathered.movedim(0, -2).reshape(*x.shape[:-1], -1)


def vocab_parallel_embedding(ids: Tensor, weight: Tensor, tensor: TensorDimension) -> Tensor:
    """Rows of the embedding whose vocabulary is split in contiguous ranges over the tensor
    ranks: each rank looks up the ids in its range, zeros elsewhere, and `leave` sums them."""
    first = tensor.rank * weight.shape[0]
    local = ids - first
    outside = (local < 0) | (local >= weight.shape[0])
    rows = F.embedding(local.masked_fill(outside, 0), weight)
    return leave(rows.masked_fill(outside.unsqueeze(-1), 0.0), tensor)
