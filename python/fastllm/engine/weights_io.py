"""Whole parameters in and out of the flat buffers: loading (every rank keeps its tensor slice,
its experts and its shard of them), and the weights for an export (each parameter sent by the
pipeline rank that holds it, its tensor slices and expert shares merged)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from fastllm.config.layout import pipeline_rank_of
from fastllm.engine.buffers import GroupBuffers
from fastllm.engine.model_stages import ModelStages
from fastllm.engine.parameter_group import ParameterGroup
from fastllm.model.parameters import full_shape


@torch.no_grad()
def load_full_parameters(stages: ModelStages, tensors: Iterator[tuple[str, Tensor]]) -> None:
    """Set every parameter (fp32 master shard and compute weights) from whole tensors, of
    which this rank keeps its slice."""
    seen = set()
    for name, tensor in tensors:
        seen.add(name)
        _load(stages, name, local(stages, name, tensor))
    missing = {name for group in stages.all_groups for name in group.buffers.names} - seen
    if missing:
        raise KeyError(f"no values given for parameters {sorted(missing)[:5]}")
    stages.sync_weights_from_master()


def _load(stages: ModelStages, name: str, tensor: Tensor) -> None:
    """Set parameter `name` from this rank's slice of it."""
    buffers = stages.group_of(name).buffers
    if name not in buffers.owned_names:
        for tied in (stages.tied, stages.frozen_tied):
            if tied is not None and tied.weight is not None and name == tied.name:
                tied.load(tensor)
        return
    index = buffers.indices[name]
    if not buffers.trainable:  # weights only: the values rounded to the compute dtype
        _load_frozen(buffers, index, tensor)
        return
    if not buffers.shard_weights:
        weights = buffers.stages[buffers.layout.parameter(index)[0]].weights
        buffers.view(weights, index).copy_(buffers.compute_weights(tensor))
    for shard, (param_start, param_end, shard_start, _) in buffers.pieces(index):
        piece = tensor.reshape(-1)[param_start:param_end].to(buffers.device, torch.float32)
        shard.set_master(shard_start, piece)


def _load_frozen(buffers: GroupBuffers, index: int, tensor: Tensor) -> None:
    stage = buffers.layout.parameter(index)[0]
    values = tensor.to(buffers.device, buffers.compute_dtype)
    if not buffers.shard_weights:
        buffers.view(buffers.stages[stage].weights, index).copy_(values)
        return
    for i, param_start, param_end, shard_start, shard_end in buffers.layout.shard_parameters(
        stage, buffers.data.rank
    ):
        if i == index:
            piece = values.reshape(-1)[param_start:param_end]
            buffers.weight_shards[stage][shard_start:shard_end].copy_(piece)


def local(stages: ModelStages, name: str, whole: Tensor) -> Tensor:
    """This rank's slice of parameter `name`'s whole tensor: its experts' (expert
    parallelism), its tensor slice of them."""
    mesh, meta = stages.mesh, stages.metas[name]
    if meta.expert_split and mesh.expert.size > 1:
        whole = whole.chunk(mesh.expert.size)[mesh.expert.rank]
    if meta.tensor_split is None or mesh.tensor.size == 1:
        return whole
    return meta.tensor_split.local(whole, mesh.tensor.rank, mesh.tensor.size)


def whole_shape(stages: ModelStages, name: str) -> tuple[int, ...]:
    mesh, meta = stages.mesh, stages.metas[name]
    shape = tuple(stages.group_of(name).buffers.shapes[name])
    shape = full_shape(shape, meta.tensor_split if mesh.tensor.size > 1 else None)
    if meta.expert_split:
        shape = (shape[0] * mesh.expert.size, *shape[1:])
    return shape


def full_parameters(group: ParameterGroup) -> Iterator[tuple[str, Tensor]]:
    """Every parameter of the group on this tensor rank in the compute dtype (views: copy each
    before taking the next), each sent by the pipeline rank that holds it. With ZeRO-3 each
    stage is gathered in turn: every rank must iterate to the end."""
    buffers, gatherer = group.buffers, group.gatherer
    pipeline = buffers.pipeline
    if group.refresh is not None:
        group.refresh.wait_all()
    for stage in buffers.stages:
        owned = stage.index in buffers.owned
        if gatherer is not None and owned:
            gatherer.ensure(stage.index, whole=True)
        for index in stage.parameters:
            name = buffers.names[index]
            if pipeline.size == 1:
                yield name, buffers.view(stage.weights, index)
                continue
            tensor = (
                buffers.view(stage.weights, index)
                if owned
                else torch.empty(
                    buffers.shapes[name], dtype=buffers.compute_dtype, device=buffers.device
                )
            )
            source = pipeline_rank_of(stage.index, pipeline.size)
            source = dist.get_global_rank(pipeline.group, source)
            dist.broadcast(tensor, src=source, group=pipeline.group)
            yield name, tensor
        if gatherer is not None and owned:
            gatherer.release(stage.index)


def whole_parameters(stages: ModelStages) -> Iterator[tuple[str, Tensor]]:
    """Every parameter whole, its tensor-parallel slices (and expert-parallel shares)
    gathered: every rank of the tensor and expert groups (and with ZeRO-3 of the data
    group) must iterate to the end."""
    stages.fence.wait_all()  # the last offloaded update of every stage
    tensor_dimension, expert = stages.mesh.tensor, stages.mesh.expert
    for group in stages.all_groups:
        for name, tensor in full_parameters(group):
            split = stages.metas[name].tensor_split
            if split is not None and tensor_dimension.size > 1:
                slices = [torch.empty_like(tensor) for _ in range(tensor_dimension.size)]
                dist.all_gather(slices, tensor.contiguous(), group=tensor_dimension.group)
                tensor = split.merge(slices)
            if group in stages.expert_groups:
                shares = [torch.empty_like(tensor) for _ in range(expert.size)]
                dist.all_gather(shares, tensor.contiguous(), group=expert.group)
                tensor = torch.cat(shares)
            yield name, tensor
