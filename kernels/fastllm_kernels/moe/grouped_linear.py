"""The experts' projections of a dropless mixture of experts: a grouped matmul over rows in
expert order (sparse_map.py's layout), each expert's row range times its weight.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fastllm_kernels._dispatch import use_triton
from fastllm_kernels.accumulate import accumulate_
from fastllm_kernels.moe.grouped_matmul import (
    grouped_rows,
    grouped_weight_gradient_,
    tma_loadable,
)
from fastllm_kernels.recipe import GradientSink, WeightRecipe


def grouped_linear(
    x: Tensor, weight: Tensor, ends: Tensor, recipe: WeightRecipe | None = None
) -> Tensor:
    """x (rows, in) in expert order, weight (experts, out, in): the rows of expert e's range
    (ends[e - 1]:ends[e]) times weight[e]ᵀ; rows past ends[-1] are unspecified.
    Differentiable in x and weight, the weight's gradient handed to the gradient sink of its
    `recipe` if that has one (recipe.py; no FP8 here). The row products run in
    torch._grouped_mm for bf16 on CUDA, else in grouped_matmul's kernels; the weight gradient,
    for a sink, in ours (fp32, into the buffer), else as the row products. The reference (a
    loop that waits for the host) is left for tensors TMA cannot load and for torch.compile's
    tracing of CUDA tensors other than bf16. torch.compile traces torch._grouped_mm on the CPU
    too: the reference's loop would break the graph at each call, and dynamo would recompile
    the code after the break for every shape of weight (LoRA's A and B add two per projection)
    until its recompile limit left the rest uncompiled."""
    if torch.compiler.is_compiling():
        if _cutlass(x, weight) or x.device.type == "cpu":
            return torch._grouped_mm(x, weight.transpose(1, 2), offs=ends)
        return grouped_linear_reference(x, weight, ends)
    if use_triton(x, weight) and tma_loadable(x, weight):
        return _GroupedLinearFunction.apply(x, weight, ends, recipe)
    return grouped_linear_reference(x, weight, ends)


def _cutlass(x: Tensor, weight: Tensor) -> bool:
    return x.is_cuda and x.dtype == weight.dtype == torch.bfloat16


def _weight_gradient_into_(
    out: Tensor, grad: Tensor, x: Tensor, ends: Tensor, accumulate: bool
) -> None:
    """A grouped weight gradient written (or added) into its fp32 buffer `out`. Our kernel
    writes it there. To add it, for bf16 on CUDA with many rows an expert, CUTLASS's bf16
    product and a pass that adds it: on the H200 at 2,048 rows an expert (Mixtral's geometry)
    our kernel's adding was 17% slower on the second projection (4.47 against 3.81 ms) and cost
    training 2.8% (bench/results/h200-987f9b2). With fewer rows the pass, 10 bytes a parameter,
    outweighs the product: at 1,024 rows (the probe's fine-grained geometry) our adding was
    faster on both projections (1.31 against 1.50 ms, 0.73 against 0.83). Moonlight cut to 6
    blocks (384 rows an expert, 8 micro-batches a step, H100) spent 80 ms of a 555 ms step in
    the pass; with our kernel adding, the step's kernels took 506 ms against 521
    (bench/results/h100-3186317, h100-7272fbd)."""
    if accumulate and _cutlass(x, grad) and grad.shape[0] > _ADDING_ROWS * out.shape[0]:
        accumulate_(out, torch._grouped_mm(grad.T, x, offs=ends))
    else:
        grouped_weight_gradient_(out, grad, x, ends, accumulate)


_ADDING_ROWS = 1024
"""Rows an expert (on average) up to which our kernel adds a weight gradient itself."""


class _GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, ends, recipe):
        ctx.save_for_backward(x, weight, ends)
        ctx.recipe = recipe
        if _cutlass(x, weight):
            return torch._grouped_mm(x, weight.transpose(1, 2), offs=ends)
        return grouped_rows(x, weight, ends, b_transposed=True)

    @staticmethod
    def backward(ctx, grad):
        x, weight, ends = ctx.saved_tensors
        need_x, need_weight = ctx.needs_input_grad[:2]
        grad = grad.contiguous()
        grad_x = grad_weight = None
        if need_x:
            if _cutlass(x, weight):
                grad_x = torch._grouped_mm(grad, weight, offs=ends)
            else:
                grad_x = grouped_rows(grad, weight, ends, b_transposed=False)
        if need_weight:
            sink: GradientSink | None = None if ctx.recipe is None else ctx.recipe.gradient_sink
            if sink is not None:
                sink(lambda out, accumulate: _weight_gradient_into_(out, grad, x, ends, accumulate))
            elif _cutlass(x, weight):
                grad_weight = torch._grouped_mm(grad.T, x, offs=ends)
            else:
                grad_weight = torch.empty_like(weight)
                grouped_weight_gradient_(grad_weight, grad, x, ends, accumulate=False)
        return grad_x, grad_weight, None, None


def grouped_linear_reference(x: Tensor, weight: Tensor, ends: Tensor) -> Tensor:
    """One matmul per expert; its row ranges come to the host (a sync)."""
    pieces, start = [], 0
    for expert, end in enumerate(ends.tolist()):
        pieces.append(x[start:end] @ weight[expert].T)
        start = end
    pieces.append(x.new_zeros(x.shape[0] - start, weight.shape[1]))
    return torch.cat(pieces)
