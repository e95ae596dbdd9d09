"""Sequence-data parallelism: the S ranks of a sequence-data group (consecutive ranks of the
data group) load the same sequences and each computes one contiguous chunk of them.

Only attention mixes positions, so only attention communicates: each rank all-gathers the
keys and values of the group's chunks and keeps those of its causal prefix (chunks 0 to its
own), and their gradients are reduce-scattered back to the chunks' owners in the backward
pass. Everything else (ZeRO, the gradient reduction over the data group) sees S more data
ranks, whose micro-batches are chunks weighted by their trained tokens (Trainer.token_shares).

The kernels know nothing of this: they only learn that the queries may be the last positions
of the keys (fastllm_kernels.attention)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class SequenceDataParallel:
    """The sequence-data sub-group of the mesh, as attention uses it."""

    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None

    @property
    def split(self) -> bool:
        return self.size > 1

    def chunk(self, x: Tensor) -> Tensor:
        """This rank's chunk of (batch, sequence, ...)."""
        length = x.shape[1] // self.size
        return x[:, self.rank * length : (self.rank + 1) * length]

    def prefix(self, x: Tensor) -> Tensor:
        """(batch, sequence, ...) up to the end of this rank's chunk: what its queries see."""
        return x[:, : (self.rank + 1) * (x.shape[1] // self.size)]


class KeyValueGather:
    """The all-gather of one layer's keys and values (batch, chunk, kv_heads, head_size) over
    the group, started as soon as they exist so that it runs while the queries are projected
    and rotated; `finish` waits for it and returns those of the causal prefix."""

    def __init__(self, k: Tensor, v: Tensor, sdp: SequenceDataParallel) -> None:
        self.k, self.v, self.sdp = k, v, sdp
        local = torch.stack([k.detach(), v.detach()])
        self.gathered = local.new_empty((sdp.size, *local.shape))
        self.work = dist.all_gather_into_tensor(
            self.gathered.view(-1), local.view(-1), group=sdp.group, async_op=True
        )

    def finish(self) -> tuple[Tensor, Tensor]:
        k, v = _GatheredPrefix.apply(self.k, self.v, self)
        return k, v


class _GatheredPrefix(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, k: Tensor, v: Tensor, pending: KeyValueGather) -> tuple[Tensor, Tensor]:
        sdp = pending.sdp
        ctx.sdp = sdp
        pending.work.wait()
        # (chunks, 2, batch, chunk, ...) → (2, batch, chunks × chunk, ...), rank order.
        prefix = pending.gathered[: sdp.rank + 1].movedim(0, 2)
        prefix = prefix.reshape(2, k.shape[0], -1, *k.shape[2:])
        return prefix[0], prefix[1]

    @staticmethod
    def backward(ctx: Any, d_k: Tensor, d_v: Tensor) -> tuple[Tensor, Tensor, None]:
        sdp: SequenceDataParallel = ctx.sdp
        batch, length = d_k.shape[0], d_k.shape[1] // (sdp.rank + 1)
        # Chunks after this rank's own received no gradient from its queries: zeros.
        grads = d_k.new_zeros((sdp.size, 2, batch, length, *d_k.shape[2:]))
        for i, grad in enumerate((d_k, d_v)):
            chunks = grad.reshape(batch, sdp.rank + 1, length, *grad.shape[2:])
            grads[: sdp.rank + 1, i] = chunks.movedim(1, 0)
        mine = grads.new_empty(grads.shape[1:])
        dist.reduce_scatter_tensor(mine.view(-1), grads.view(-1), group=sdp.group)
        return mine[0], mine[1], None
