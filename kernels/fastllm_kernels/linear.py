"""Linear layers whose weight gradient can go straight into an fp32 accumulator.

`linear` decides from the weight's recipe (recipe.py): in FP8 (fp8/linear.py), into the
weight's gradient sink, or, without either or while torch.compile traces, a plain linear
layer. `weight_gradient` is the weight-gradient product of every bf16 projection op, handing it
to the sink.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fastllm_kernels.fp8.linear import fp8_linear
from fastllm_kernels.recipe import GradientSink, WeightRecipe


def linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, recipe: WeightRecipe | None = None
) -> Tensor:
    """F.linear(x, weight, bias) under the weight's `recipe`: in FP8 when it has an
    `Fp8Weight`, the weight gradient handed to its sink when it has one."""
    if recipe is not None and recipe.fp8 is not None:
        return fp8_linear(x, weight, bias, recipe)
    if recipe is None or recipe.gradient_sink is None or torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    return _SinkLinearFunction.apply(x, weight, bias, recipe)


def weight_gradient(
    grad_rows: Tensor, input_rows: Tensor, recipe: WeightRecipe | None
) -> Tensor | None:
    """grad_rowsᵀ @ input_rows, the gradient of a (out, in) weight from (rows, out) output
    gradients and (rows, in) inputs; None once handed to the recipe's gradient sink."""
    sink: GradientSink | None = None if recipe is None else recipe.gradient_sink
    if sink is None or torch.compiler.is_compiling():
        return grad_rows.T @ input_rows
    a = grad_rows.T
    sink(lambda out, accumulate: matmul_into_fp32_(out, a, input_rows, accumulate))
    return None


def matmul_into_fp32_(out: Tensor, a: Tensor, b: Tensor, accumulate: bool) -> None:
    """out = a @ b, or out += a @ b, with out fp32 and the product computed in fp32: one cuBLAS
    call (fp32 output and accumulation from bf16/fp16 operands) on CUDA."""
    if a.dtype == torch.float32:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif out.is_cuda:
        if accumulate:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        else:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
    elif accumulate:  # CPU: no mixed-dtype matmul
        out.addmm_(a.float(), b.float())
    else:
        torch.mm(a.float(), b.float(), out=out)


class _SinkLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.recipe = bias is not None, recipe
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_weight, need_bias, _ = ctx.needs_input_grad
        grad_rows = grad.reshape(-1, grad.shape[-1])
        dx = d_weight = d_bias = None
        if need_x:
            dx = grad @ weight
        if need_weight:
            d_weight = weight_gradient(grad_rows, x.reshape(-1, x.shape[-1]), ctx.recipe)
        if need_bias and ctx.has_bias:
            d_bias = grad_rows.sum(dim=0)
        return dx, d_weight, d_bias, None
