"""Data parallelism over the flat buffers: every rank holds the full compute weights and the
full gradient buffer, but only its shard of the fp32 masters and Adam moments (ZeRO stage 1).
After the backward passes, gradients are summed over ranks; after the optimizer step, each
rank's updated weight shard is all-gathered back into everyone's weights."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fastllm.engine.flat_model import FlatModel


@torch.no_grad()
def sum_gradients(flat: FlatModel) -> None:
    """Sum the gradient buffers over ranks (the optimizer divides by the world size)."""
    if flat.world_size == 1:
        return
    for grad in flat.grads:
        dist.all_reduce(grad)


@torch.no_grad()
def gather_weights(flat: FlatModel) -> None:
    """Every rank's updated shard of the compute weights, into every rank's full buffers."""
    if flat.world_size == 1:
        return
    for stage, shard in enumerate(flat.shards):
        dist.all_gather_into_tensor(flat.weights[stage], shard.weight.clone())
