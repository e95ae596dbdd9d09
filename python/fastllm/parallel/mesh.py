"""The parallel mesh: which tensor, data and pipeline rank this process is, and one process
group per dimension.

Ranks are ordered tensor → data → pipeline (Fast-LLM's order): global rank
= tensor_rank + tensor_size × (data_rank + data_size × pipeline_rank), so the ranks of one
tensor group are neighbours (one node, the fastest links) and pipeline ranks are farthest
apart. A dimension of size 1 has no group: nothing is communicated over it. Sequence-data
parallelism adds a sub-group of the data dimension: consecutive data ranks that share each
sequence. Expert parallelism adds two: consecutive data ranks that split the experts among
them (expert), and the data ranks that hold the same experts (expert_data, every E-th). With
either, lm-eval's documents are split over the blocks of data ranks that both make up
(document_groups)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch.distributed as dist

from fastllm.config.layout import MeshShape
from fastllm.parallel.dimension import Dimension
from fastllm.parallel.sequence_data import SequenceDataDimension
from fastllm.parallel.tensor import DeferredWork, TensorDimension


@dataclass(frozen=True)
class ParallelMesh:
    world_size: int
    rank: int
    tensor: TensorDimension
    data: Dimension
    pipeline: Dimension
    sequence_data: SequenceDataDimension = field(default_factory=SequenceDataDimension)
    """The consecutive data ranks that load the same sequences, each computing its chunk of
    them (rank r the r-th); the data dimension still spans them for ZeRO and gradients."""
    expert: Dimension = field(default_factory=Dimension)
    """The consecutive data ranks that split each mixture's experts (rank r the r-th share)
    and exchange tokens."""
    expert_data: Dimension = field(default_factory=Dimension)
    """The data ranks that hold the same experts (one per expert group): ZeRO shards the
    expert parameters over them and sums their gradients."""
    document_groups: Dimension | None = None
    """The data dimension as lm-eval splits its documents: one rank per block of consecutive
    data ranks that answer the same ones (a sequence-data group shares each sequence; the
    all-to-alls of an expert group pair every forward pass of its ranks), this rank in the
    group of the blocks' ranks at its place (every B-th); None: the data dimension."""

    @property
    def sample_groups(self) -> Dimension:
        """The data dimension as the data loader sees it: one rank per sequence-data group."""
        sdp = self.sequence_data.size
        return Dimension(self.data.size // sdp, self.data.rank // sdp, None)

    @staticmethod
    def single() -> ParallelMesh:
        return ParallelMesh(1, 0, TensorDimension(), Dimension(), Dimension())

    def with_deferral(self, deferral: DeferredWork) -> ParallelMesh:
        """The mesh whose tensor dimension runs `deferral` (the engine's queue of weight
        gradients) during its backward collectives; build the model with it."""
        return replace(self, tensor=replace(self.tensor, deferral=deferral))


def build_mesh(layout: MeshShape, rank: int) -> ParallelMesh:
    """The mesh of `layout`'s ranks; every rank must call it (groups are made collectively)."""
    world_size, tensor_size, data_size = layout.world_size, layout.tensor, layout.data
    sizes = (tensor_size, data_size, layout.pipeline)
    coordinates = (
        rank % tensor_size,
        rank // tensor_size % data_size,
        rank // (tensor_size * data_size),
    )
    tensor, data, pipeline = (
        _dimension(sizes, coordinates, axis, world_size > 1) for axis in range(len(sizes))
    )
    sequence_data = _data_blocks(layout.sequence_data, sizes, coordinates)
    expert = _data_blocks(layout.expert, sizes, coordinates)
    expert_data = _data_strides(layout.expert, sizes, coordinates)
    block = math.lcm(layout.sequence_data, layout.expert)
    documents = None if block == 1 else _data_strides(block, sizes, coordinates)
    return ParallelMesh(
        world_size,
        rank,
        TensorDimension(
            tensor.size,
            tensor.rank,
            tensor.group,
            sequence_tensor_parallel=layout.sequence_tensor_parallel,
        ),
        data,
        pipeline,
        SequenceDataDimension(
            sequence_data.size,
            sequence_data.rank,
            sequence_data.group,
            chunking=layout.sequence_data_chunking,
        ),
        expert,
        expert_data,
        documents,
    )


def _data_blocks(
    size: int, sizes: tuple[int, int, int], coordinates: tuple[int, int, int]
) -> Dimension:
    """This rank's block of `size` consecutive data ranks."""
    if size == 1:
        return Dimension()
    data_size = sizes[1]
    blocks = [list(range(first, first + size)) for first in range(0, data_size, size)]
    return Dimension(size, coordinates[1] % size, _data_subgroup(blocks, sizes, coordinates))


def _data_strides(
    stride: int, sizes: tuple[int, int, int], coordinates: tuple[int, int, int]
) -> Dimension:
    """The data ranks equal to this rank's modulo `stride` (one per block of `stride`); size 1
    when stride is 1 (no expert parallelism: the mesh's expert dimensions are unused)."""
    data_size = sizes[1]
    size = data_size // stride
    if stride == 1 or size == 1:
        return Dimension()
    sets = [list(range(first, data_size, stride)) for first in range(stride)]
    return Dimension(size, coordinates[1] // stride, _data_subgroup(sets, sizes, coordinates))


def _data_subgroup(
    data_sets: list[list[int]], sizes: tuple[int, int, int], coordinates: tuple[int, int, int]
) -> dist.ProcessGroup | None:
    """The group of this rank's set among `data_sets` (data ranks, within its tensor and
    pipeline coordinates); every rank creates every set's group, in the same order."""
    tensor_size, data_size, pipeline_size = sizes
    mine = None
    for pipeline in range(pipeline_size):
        for data_ranks in data_sets:
            for tensor in range(tensor_size):
                ranks = [tensor + tensor_size * (d + data_size * pipeline) for d in data_ranks]
                group = dist.new_group(ranks)
                here = (tensor, pipeline) == (coordinates[0], coordinates[2])
                if here and coordinates[1] in data_ranks:
                    mine = group
    return mine


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
