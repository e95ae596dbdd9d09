"""Data parallelism over the flat buffers: every rank holds the full compute weights but only
its shard of the fp32 masters and Adam moments (ZeRO-1), and with ZeRO-2 only its shard of the
gradients too. After the backward passes, ZeRO-1 reduce-scatters the gradient buffers into the
shards (ZeRO-2 does it for each stage as its backward finishes: GradientReducer); after the
optimizer step, each rank's updated weight shard is all-gathered back into everyone's weights
(ZeRO-3 gathers each stage only while it runs: see WeightGatherer)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fastllm.engine.flat_model import FlatModel


@torch.no_grad()
def sum_gradients(flat: FlatModel) -> None:
    """Sum each rank's shard of the gradients over ranks (the optimizer divides by the world
    size): a reduce-scatter, half the traffic of an all-reduce, since the optimizer reads only
    the shard. With ZeRO-2 this was done during the backward pass."""
    if flat.world_size == 1 or flat.shard_gradients:
        return
    largest = max(shard.grad.numel() for shard in flat.shards)
    scratch = torch.empty(largest, dtype=torch.float32, device=flat.device)
    for grad, shard in zip(flat.grads, flat.shards, strict=True):
        summed = scratch[: shard.grad.numel()]
        dist.reduce_scatter_tensor(summed, grad)
        shard.grad.copy_(summed)


@torch.no_grad()
def gather_weights(flat: FlatModel) -> None:
    """Every rank's updated shard of the compute weights, into every rank's full buffers (with
    ZeRO-3, gathered copies of the old weights are dropped: stages are gathered when used)."""
    if flat.gatherer is not None:
        flat.gatherer.keep_only(set())
        return
    if flat.world_size == 1:
        return
    for stage, shard in enumerate(flat.shards):
        dist.all_gather_into_tensor(flat.weights[stage], shard.weight.clone())
