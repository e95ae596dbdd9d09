"""The parallel mesh: which tensor, data and pipeline rank this process is, and one process
group per dimension.

Ranks are ordered tensor → data → pipeline (Fast-LLM's order): global rank
= tensor_rank + tensor_size × (data_rank + data_size × pipeline_rank), so the ranks of one
tensor group are neighbours (one node, the fastest links) and pipeline ranks are farthest
apart. A dimension of size 1 has no group: nothing is communicated over it."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from fastllm.config.model import DistributedConfig


@dataclass(frozen=True)
class Dimension:
    """One dimension of the mesh as this rank sees it."""

    size: int
    rank: int
    group: dist.ProcessGroup | None
    """None when size is 1."""


@dataclass(frozen=True)
class ParallelMesh:
    world_size: int
    rank: int
    tensor: Dimension
    data: Dimension
    pipeline: Dimension
    sequence_parallel: bool
    """Sequence-tensor parallelism: activations between layers split over the tensor ranks."""

    @staticmethod
    def single() -> ParallelMesh:
        alone = Dimension(1, 0, None)
        return ParallelMesh(1, 0, alone, alone, alone, False)


def build_mesh(config: DistributedConfig, world_size: int, rank: int) -> ParallelMesh:
    """The mesh of `world_size` ranks; every rank must call it (groups are made collectively)."""
    tensor_size, data_size = config.tensor_parallel, config.data_parallel(world_size)
    sizes = (tensor_size, data_size, config.pipeline_parallel)
    coordinates = (
        rank % tensor_size,
        rank // tensor_size % data_size,
        rank // (tensor_size * data_size),
    )
    dimensions = [
        _dimension(sizes, coordinates, axis, world_size > 1) for axis in range(len(sizes))
    ]
    return ParallelMesh(world_size, rank, *dimensions, sequence_parallel=config.sequence_parallel)


def _dimension(
    sizes: tuple[int, int, int], coordinates: tuple[int, int, int], axis: int, distributed: bool
) -> Dimension:
    """This rank's group along `axis`: the ranks whose other coordinates equal this rank's. Every
    rank creates every group of the axis, in the same order, as `new_group` requires."""
    size = sizes[axis]
    if size == 1 or not distributed:
        return Dimension(size, 0, None)
    mine = None
    others = [a for a in range(len(sizes)) if a != axis]
    outer, inner = (sizes[a] for a in others)
    for i in range(outer):
        for j in range(inner):
            ranks = []
            for k in range(size):
                point = [0, 0, 0]
                point[others[0]], point[others[1]], point[axis] = i, j, k
                ranks.append(point[0] + sizes[0] * (point[1] + sizes[1] * point[2]))
            group = dist.new_group(sorted(ranks))
            if (i, j) == tuple(coordinates[a] for a in others):
                mine = group
    return Dimension(size, coordinates[axis], mine)
