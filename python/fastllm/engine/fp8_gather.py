"""ZeRO-3 with FP8 linear layers: a stage's FP8 weights are gathered in FP8, half the bytes of
their bf16 copies.

Once the weights change (an optimizer step, a restore), each rank quantizes its shard's pieces
of the FP8 weights itself, with the scales of the whole weights: their amaxes (per tensor, or
per row and per column for rowwise) are the maxima over every rank's pieces, one all-reduce
over the data group for all stages. Under delayed scaling a weight scales from its WEIGHT
history and records the whole weight's amax, as `Fp8Weight.rows` does. A stage is then gathered
as its FP8 image (every rank's shard image, a byte per element) and its other parameters
(norms, biases) packed; each FP8 weight computes from its view of the image
(`Fp8Weight.gathered`): the values its own quantization of the whole weight would give. Its
bf16 copy is not gathered (the stage's bf16 buffer is still allocated, for the other
parameters' views: the saving is in bytes moved, not in memory). Rowwise also gathers a
column-scaled image, the input gradient's operand. A stage without FP8 weights, or one needed
whole in bf16 (exports), is gathered in bf16 as before. A frozen group's weights never change
once loaded: its images are made at its first gather and after a restore only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastllm.engine.buffers import GroupBuffers
from fastllm_kernels.fp8.amax_history import WEIGHT
from fastllm_kernels.fp8.quantize import E4M3, FP8_MAX, Fp8Tensor, multiplier_reference
from fastllm_kernels.fp8.weight import Fp8Weight

_FP8_MAX = FP8_MAX[E4M3]


@dataclass
class _Weight:
    """An FP8 weight of a stage, and where its whole-weight amaxes sit in the all-reduced
    vector: one (tensorwise), or its rows' then its columns' (rowwise)."""

    fp8: Fp8Weight
    shape: tuple[int, int]
    amax_offset: int
    scale: Tensor | None = None
    """Tensorwise: the weight's scale (); rowwise: its rows' (out, 1)."""
    column_scale: Tensor | None = None
    """Rowwise: its columns' scale (in, 1)."""

    @property
    def amaxes(self) -> int:
        return 1 if self.fp8.recipe.tensorwise else self.shape[0] + self.shape[1]


@dataclass
class _Stage:
    weights: dict[int, _Weight]
    """By parameter index."""
    pieces: list[tuple[int, int, int, int, int]]
    """This rank's pieces of the FP8 weights: (index, start and end in the weight, in the shard)."""
    packed: list[list[tuple[int, int, int]]]
    """Per data rank: its other pieces as (start in the stage buffer, length, start in its
    packed buffer)."""
    packed_size: int
    """The longest rank's packed pieces (each rank's packed buffer is padded to it)."""
    rows: Tensor
    """This rank's shard image (uint8 storage of e4m3 values), rows-scaled."""
    columns: Tensor | None
    """Rowwise: its column-scaled image."""


class Fp8Gather:
    """The FP8 images of one group's ZeRO-3 stages (made by its WeightGatherer)."""

    def __init__(self, buffers: GroupBuffers) -> None:
        self.buffers = buffers
        self.stages: dict[int, _Stage] = {}
        self.amax_size = 0
        for stage in buffers.owned:
            plan = self._plan(stage)
            if plan is not None:
                self.stages[stage] = plan
        self.stale = True
        """The shards changed since they were last quantized."""
        self.images: dict[int, tuple[Tensor, Tensor | None, Tensor]] = {}
        """Gathered (or in flight) stages: rows image, columns image, packed other pieces."""

    def _plan(self, stage: int) -> _Stage | None:
        buffers = self.buffers
        weights: dict[int, _Weight] = {}
        for index, parameter in buffers.stages[stage].views.items():
            recipe = buffers.metas[buffers.names[index]].recipe
            fp8 = None if recipe is None else recipe.fp8
            if fp8 is None:
                continue
            out, inputs = parameter.shape
            weights[index] = _Weight(fp8, (out, inputs), self.amax_size)
            self.amax_size += weights[index].amaxes
        if not weights:
            return None
        packed: list[list[tuple[int, int, int]]] = []
        pieces: list[tuple[int, int, int, int, int]] = []
        for rank in range(buffers.data.size):
            start, _ = buffers.layout.shard_range(stage, rank)
            cursor, runs = 0, []
            for index, p0, p1, s0, s1 in buffers.layout.shard_parameters(stage, rank):
                if index in weights:
                    if rank == buffers.data.rank:
                        pieces.append((index, p0, p1, s0, s1))
                    continue
                runs.append((start + s0, s1 - s0, cursor))
                cursor += s1 - s0
            packed.append(runs)
        size = buffers.weight_shards[stage].numel()
        rowwise = not next(iter(weights.values())).fp8.recipe.tensorwise
        device = buffers.device

        def image() -> Tensor:
            return torch.zeros(size, dtype=torch.uint8, device=device)

        return _Stage(
            weights=weights,
            pieces=pieces,
            packed=packed,
            packed_size=max(max((run[2] + run[1] for run in runs), default=0) for runs in packed),
            rows=image(),
            columns=image() if rowwise else None,
        )

    @torch.no_grad()
    def quantize(self) -> None:
        """This rank's pieces of every FP8 weight, with the whole weights' scales."""
        self.stale = False
        buffers = self.buffers
        amax = torch.zeros(self.amax_size, dtype=torch.float32, device=buffers.device)
        for stage, plan in self.stages.items():
            shard = buffers.weight_shards[stage]
            for index, p0, p1, s0, s1 in plan.pieces:
                weight = plan.weights[index]
                values = shard[s0:s1].float().abs()
                at = weight.amax_offset
                if weight.fp8.recipe.tensorwise:
                    torch.maximum(amax[at], values.max(), out=amax[at])
                    continue
                out = weight.shape[0]
                for o, r, c, n_rows, n_cols in _blocks(p0, p1, weight.shape[1]):
                    block = values[o : o + n_rows * n_cols].view(n_rows, n_cols)
                    rows, columns = amax[at + r : at + r + n_rows], amax[at + out + c :][:n_cols]
                    torch.maximum(rows, block.amax(1), out=rows)
                    torch.maximum(columns, block.amax(0), out=columns)
        if buffers.data.size > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=buffers.data.group)
        for stage, plan in self.stages.items():
            multipliers = {i: self._multipliers(w, amax) for i, w in plan.weights.items()}
            shard = buffers.weight_shards[stage]
            for index, p0, p1, s0, s1 in plan.pieces:
                weight, (row_m, column_m, saturate) = plan.weights[index], multipliers[index]
                x = shard[s0:s1].float()
                if weight.fp8.recipe.tensorwise:
                    _cast(x * row_m, saturate, plan.rows[s0:s1])
                    continue
                assert plan.columns is not None and column_m is not None
                for o, r, c, n_rows, n_cols in _blocks(p0, p1, weight.shape[1]):
                    block = x[o : o + n_rows * n_cols].view(n_rows, n_cols)
                    at = slice(s0 + o, s0 + o + n_rows * n_cols)
                    _cast((block * row_m[r : r + n_rows, None]).view(-1), False, plan.rows[at])
                    scaled = block * column_m[None, c : c + n_cols]
                    _cast(scaled.view(-1), False, plan.columns[at])

    def _multipliers(self, weight: _Weight, amax: Tensor) -> tuple[Tensor, Tensor | None, bool]:
        """The rows' (or tensor's) and the columns' multipliers, and whether values past the
        range saturate (delayed scaling); sets the weight's scales, records its amax."""
        at = weight.amax_offset
        if not weight.fp8.recipe.tensorwise:
            out, inputs = weight.shape
            row_m = multiplier_reference(amax[at : at + out], _FP8_MAX)
            column_m = multiplier_reference(amax[at + out : at + out + inputs], _FP8_MAX)
            weight.scale, weight.column_scale = (1 / row_m)[:, None], (1 / column_m)[:, None]
            return row_m, column_m, False
        delayed = weight.fp8.scale(WEIGHT)
        whole = amax[at]
        if delayed is not None and delayed.record is not None:
            torch.maximum(delayed.record, whole, out=delayed.record)
        primed = delayed is not None and delayed.history is not None
        source = delayed.history.amax() if primed else whole  # type: ignore[union-attr]
        multiplier = multiplier_reference(source, _FP8_MAX)
        weight.scale = 1 / multiplier
        return multiplier, None, primed

    def gather(self, stage: int) -> list[Any]:
        """Start gathering `stage`'s images and its other parameters' packed pieces."""
        if self.stale:
            self.quantize()
        buffers, plan = self.buffers, self.stages[stage]
        group, data = buffers.data.group, buffers.data
        size = plan.rows.numel() * data.size
        device = buffers.device
        rows = torch.empty(size, dtype=torch.uint8, device=device)
        works = [dist.all_gather_into_tensor(rows, plan.rows, group=group, async_op=True)]
        columns = None
        if plan.columns is not None:
            columns = torch.empty(size, dtype=torch.uint8, device=device)
            works.append(
                dist.all_gather_into_tensor(columns, plan.columns, group=group, async_op=True)
            )
        mine = torch.zeros(plan.packed_size, dtype=buffers.compute_dtype, device=device)
        shard_start, _ = buffers.layout.shard_range(stage, data.rank)
        shard = buffers.weight_shards[stage]
        for start, length, cursor in plan.packed[data.rank]:
            offset = start - shard_start
            mine[cursor : cursor + length] = shard[offset : offset + length]
        packed = torch.empty(plan.packed_size * data.size, dtype=mine.dtype, device=device)
        if plan.packed_size:
            works.append(dist.all_gather_into_tensor(packed, mine, group=group, async_op=True))
        self.images[stage] = (rows, columns, packed)
        return works

    def finish(self, stage: int, buffer: Tensor) -> None:
        """Once `stage`'s gathers are done: its other parameters into the bf16 buffer, and each
        FP8 weight's views of the images."""
        plan = self.stages[stage]
        rows, columns, packed = self.images[stage]
        for rank, runs in enumerate(plan.packed):
            base = rank * plan.packed_size
            for start, length, cursor in runs:
                buffer[start : start + length] = packed[base + cursor : base + cursor + length]
        for index, weight in plan.weights.items():
            assert weight.scale is not None
            view = self.buffers.view(rows.view(E4M3), index)
            weight.fp8.gathered = Fp8Tensor(view, weight.scale)
            if columns is not None:
                assert weight.column_scale is not None
                view = self.buffers.view(columns.view(E4M3), index)
                weight.fp8.gathered_columns = Fp8Tensor(view, weight.column_scale)

    def release(self, stage: int) -> None:
        self.images.pop(stage, None)
        for weight in self.stages[stage].weights.values():
            weight.fp8.gathered = weight.fp8.gathered_columns = None


def _blocks(p0: int, p1: int, inputs: int) -> list[tuple[int, int, int, int, int]]:
    """Elements p0 … p1 - 1 of a row-major (out, inputs) weight as rectangles: (offset from
    p0, first row, first column, rows, columns): a partial first row, the whole rows, a
    partial last row (each there only when not empty)."""
    blocks, position = [], p0
    while position < p1:
        row, column = divmod(position, inputs)
        if column or p1 - position < inputs:  # a partial row
            length = min(inputs - column, p1 - position)
            blocks.append((position - p0, row, column, 1, length))
        else:
            rows = (p1 - position) // inputs
            blocks.append((position - p0, row, 0, rows, inputs))
            length = rows * inputs
        position += length
    return blocks


def _cast(scaled: Tensor, saturate: bool, out: Tensor) -> None:
    """Scaled values into an e4m3 image (uint8 storage); saturating past the range (delayed
    scaling: the history's amax may be below the weight's)."""
    if saturate:
        scaled = scaled.clamp(-_FP8_MAX, _FP8_MAX)
    out.view(E4M3).copy_(scaled.to(E4M3))
