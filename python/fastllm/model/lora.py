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
part of the whole (tensor_partial).

The experts of a mixture (`ExpertLoRA`, experts_1 and experts_2) have one adapter each per
projection, stacked on a first dimension of experts as their weights are: on the rows the
base's grouped matmul takes (each expert's tokens contiguous), one grouped matmul projects
through every expert's A and another through its B. Their fused [gate; up] input has one
adapter of 2 × ffn rows, as PEFT's LoRA of Hugging Face's fused `gate_up_proj` has, so that
the two exchange (checkpoint/peft.py). They split over tensor ranks as the dense ones do, and
over expert ranks with their experts."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fastllm.config.model import LoRAConfig
from fastllm.model.parameters import TensorSplit, describe
from fastllm.parallel.tensor import TensorDimension
from fastllm_kernels.linear import linear
from fastllm_kernels.lora_linear import lora_linear
from fastllm_kernels.moe.grouped_linear import grouped_linear
from fastllm_kernels.recipe import WeightRecipe

SUFFIX = "_lora"
"""The adapters of projection `NAME` are the module `NAME_lora` beside it."""


def is_adapter(parameter: str) -> bool:
    """Whether a parameter name is a LoRA adapter's."""
    return f"{SUFFIX}." in parameter


class Adapter(torch.nn.Module):
    """What every LoRA module has: `a` and `b` (the A and B matrices, trained, everything else
    frozen with `freeze_others`), A drawn from ±1/sqrt(`in_features`) (the whole projection's
    input, before any tensor split), B from zero (model/init.py)."""

    a: torch.nn.Parameter
    b: torch.nn.Parameter

    def __init__(self, config: LoRAConfig, in_features: int) -> None:
        super().__init__()
        self.rank, self.scale, self.dropout = config.rank, config.scale, config.dropout
        self.in_features = in_features

    def _describe(self, row_parallel: bool, split: TensorSplit, **meta: Any) -> None:
        """Row-parallel, `a` split by `split` along the base's input and `b`'s gradient partial
        (the base's reduction sums the update); column-parallel, `a`'s gradient partial and
        `b` split by `split` along the output."""
        a, b = ({"tensor_split": split}, {"tensor_partial": True})
        if not row_parallel:
            a, b = b, a
        describe(self, "a", weight_decay=True, **a, **meta)
        describe(self, "b", weight_decay=True, **b, **meta)

    def _dropped(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.dropout) if self.dropout and self.training else x


class LoRA(Adapter):
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
        super().__init__(config, in_features)
        size = tensor.size
        self.segments = tuple(s // size for s in segments) if not row_parallel else segments
        self.adapted = adapted
        local_in = in_features // size if row_parallel else in_features
        rows = sum(self.segments[i] for i in adapted)
        self.a = torch.nn.Parameter(torch.empty(len(adapted) * self.rank, local_in))
        self.b = torch.nn.Parameter(torch.empty(rows, self.rank))
        adapted_rows = tuple(segments[i] for i in adapted)
        split = TensorSplit(1, (in_features,)) if row_parallel else TensorSplit(0, adapted_rows)
        self._describe(row_parallel, split)

    def project(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, recipe: WeightRecipe | None
    ) -> Tensor:
        """linear(x, weight, bias, recipe), the base projection, plus the update of x. In bf16
        or fp32 (no FP8 recipe), with no dropout and not under torch.compile (whose fusions
        cover it), one op does both and sums x's two gradients in place (lora_linear)."""
        dropout = self.dropout and self.training
        if dropout or torch.compiler.is_compiling() or (recipe is not None and recipe.fp8):
            return self._add_to(linear(x, weight, bias, recipe), x)
        return lora_linear(x, weight, bias, recipe, self.a, self._block_diagonal_b(), self.scale)

    def _add_to(self, out: Tensor, x: Tensor) -> Tensor:
        """out (…, this rank's output features) plus the update of x (…, input features)."""
        low = F.linear(self._dropped(x), self.a)
        # One GEMM adds the scaled update to `out` in its epilogue: no update tensor, and no
        # pass scaling the gradient in the backward (alpha scales the products there too).
        total = torch.addmm(
            out.reshape(-1, out.shape[-1]),
            low.reshape(-1, low.shape[-1]),
            self._block_diagonal_b().t(),
            alpha=self.scale,
        )
        return total.view(out.shape)

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


class ExpertLoRA(Adapter):
    """The adapters of one projection of a mixture's experts, weight (experts, out, in): `a`
    (experts, rank, in) and `b` (experts, out, rank), expert e's update B_e A_e. This rank
    holds the adapters of the `held` experts it holds. Column-parallel (experts_1), `b`'s
    rows split as the weight's `segments` (the whole output's, [gate; up] when gated);
    row-parallel (experts_2), `a`'s columns split as the weight's input."""

    def __init__(
        self,
        config: LoRAConfig,
        held: int,
        in_features: int,
        segments: tuple[int, ...],
        tensor: TensorDimension,
        row_parallel: bool,
    ) -> None:
        super().__init__(config, in_features)
        size = tensor.size
        local_in = in_features // size if row_parallel else in_features
        local_out = sum(segments) if row_parallel else sum(segments) // size
        self.a = torch.nn.Parameter(torch.empty(held, self.rank, local_in))
        self.b = torch.nn.Parameter(torch.empty(held, local_out, self.rank))
        split = TensorSplit(2, (in_features,)) if row_parallel else TensorSplit(1, segments)
        self._describe(row_parallel, split, expert_split=True)

    def add_grouped(self, out: Tensor, x: Tensor, ends: Tensor) -> Tensor:
        """out plus the update of x, both (rows, …) in the expert order of the base's grouped
        matmul (`ends`: each held expert's row range's end)."""
        low = grouped_linear(self._dropped(x), self.a, ends)
        return torch.add(out, grouped_linear(low, self.b, ends), alpha=self.scale)

    def add_expert(self, out: Tensor, x: Tensor, expert: int) -> Tensor:
        """out plus the update of x, rows of held expert `expert` (the looped reference)."""
        low = F.linear(self._dropped(x), self.a[expert])
        return torch.add(out, F.linear(low, self.b[expert]), alpha=self.scale)


def expert_adapter_of(
    config: LoRAConfig | None,
    name: str,
    held: int,
    in_features: int,
    segments: tuple[int, ...],
    tensor: TensorDimension,
    row_parallel: bool = False,
) -> ExpertLoRA | None:
    """The experts' adapters of the projection `name` (experts_1 or experts_2 of
    `LoRAConfig.layers`), or None when it is not adapted."""
    if config is None or name not in config.adapted():
        return None
    return ExpertLoRA(config, held, in_features, segments, tensor, row_parallel)


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
