"""LoRA adapters (`model.base_model.peft: {type: lora}`): the low-rank update of one projection,
added to the projection's output and never merged into its weight.

A projection may be fused from several of Hugging Face's (q/k/v, gate/up): its output is a
concatenation of segments, and each adapted segment has an adapter of its own, as PEFT gives
each of q_proj, k_proj and v_proj one. `a` stacks the adapted segments' A matrices (rank rows
each) and `b` their B matrices (their output rows each), so the exchange with PEFT is a
concatenation (checkpoint/peft.py). One matmul projects the input through every A; the B's
form a block-diagonal matrix (zero columns for segments without an adapter) so that a second
matmul adds every update to the base output in place.

Under tensor parallelism an adapter is split with its projection: a column-parallel one
(q/k/v, the MLP's input) splits B with the output rows, each rank holding A whole; a
row-parallel one (attention output, the MLP's output) splits A with the input columns, each
rank holding B whole. The row-parallel update is then a partial sum like the base output's,
summed by the same `leave`. In both cases the replicated matrix's gradient on each rank is a
part of the whole (tensor_partial)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fastllm.config.model import LoRAConfig
from fastllm.model.parameters import TensorSplit, describe
from fastllm.parallel.tensor import TensorDimension

SUFFIX = "_lora"
"""The adapters of projection `NAME` are the module `NAME_lora` beside it."""


def is_adapter(parameter: str) -> bool:
    """Whether a parameter name is a LoRA adapter's."""
    return f"{SUFFIX}." in parameter


class LoRA(torch.nn.Module):
    """The adapters of one projection of `segments` (the whole projection's output segments,
    before any tensor split), of which those at `adapted` indices have one."""

    def __init__(
        self,
        config: LoRAConfig,
        in_features: int,
        segments: tuple[int, ...],
        adapted: tuple[int, ...],
        tensor: TensorDimension,
        row_parallel: bool,
    ) -> None:
        super().__init__()
        self.rank, self.scale, self.dropout = config.rank, config.scale, config.dropout
        size = tensor.size
        self.segments = tuple(s // size for s in segments) if not row_parallel else segments
        self.adapted = adapted
        local_in = in_features // size if row_parallel else in_features
        rows = sum(self.segments[i] for i in adapted)
        self.a = torch.nn.Parameter(torch.empty(len(adapted) * self.rank, local_in))
        self.b = torch.nn.Parameter(torch.empty(rows, self.rank))
        self.in_features = in_features
        if row_parallel:
            describe(self, "a", weight_decay=True, tensor_split=TensorSplit(1, (in_features,)))
            describe(self, "b", weight_decay=True, tensor_partial=True)
        else:
            adapted_rows = tuple(segments[i] for i in adapted)
            describe(self, "a", weight_decay=True, tensor_partial=True)
            describe(self, "b", weight_decay=True, tensor_split=TensorSplit(0, adapted_rows))

    def add_to(self, out: Tensor, x: Tensor) -> Tensor:
        """out (…, this rank's output features) plus the update of x (…, input features)."""
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        low = F.linear(x, self.a)
        update = F.linear(low, self._block_diagonal_b())
        return torch.add(out, update, alpha=self.scale)

    def _block_diagonal_b(self) -> Tensor:
        """(output features, adapters × rank): each adapted segment's B in its rows and its own
        rank columns, zero elsewhere."""
        blocks, start = [], 0
        adapted = set(self.adapted)
        for index, rows in enumerate(self.segments):
            if index in adapted:
                blocks.append(self.b[start : start + rows])
                start += rows
            else:
                blocks.append(self.b.new_zeros(rows, 0))
        if len(blocks) == 1:
            return blocks[0]
        return torch.block_diag(*blocks)


def adapter_of(
    config: LoRAConfig | None,
    names: tuple[str, ...],
    in_features: int,
    segments: tuple[int, ...],
    tensor: TensorDimension,
    row_parallel: bool = False,
) -> LoRA | None:
    """The adapters of a projection whose output segments are the sub-layers `names` (of
    `LoRAConfig.layers`), or None when none of them is adapted."""
    if config is None:
        return None
    wanted = set(config.adapted())
    adapted = tuple(i for i, name in enumerate(names) if name in wanted)
    if not adapted:
        return None
    return LoRA(config, in_features, segments, adapted, tensor, row_parallel)
