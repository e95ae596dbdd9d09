"""`norm_linear` with the projection in FP8: the norm's kernel writes its output in fp8
(producers.py) where the recipe allows, and the backward pass recomputes it from x, as the
bf16 `norm_linear` does."""

from __future__ import annotations

import torch
from torch import Tensor

from fastllm_kernels._dispatch import as_rows, use_triton
from fastllm_kernels.fp8.amax_history import INPUT
from fastllm_kernels.fp8.linear import (
    backward_products,
    bias_gradient,
    forward_product,
    fp8_linear,
    input_scale_source,
    product_of_rows,
)
from fastllm_kernels.fp8.producers import norm_columns, norm_quantized, producer_quantizes
from fastllm_kernels.fp8.quantize import Fp8Tensor
from fastllm_kernels.norm import (
    norm_backward,
    norm_forward,
    norm_reference,
)
from fastllm_kernels.recipe import WeightRecipe


def fp8_norm_linear(
    x: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor | None,
    eps: float,
    rms: bool,
    weight: Tensor,
    bias: Tensor | None,
    recipe: WeightRecipe,
) -> Tensor:
    """`norm_linear` with the projection in FP8 under `recipe.fp8`."""
    if use_triton(x, norm_weight, norm_bias, weight, bias):
        return _Fp8NormLinearFunction.apply(
            x, norm_weight, norm_bias, eps, rms, weight, bias, recipe
        )
    normed = norm_reference(x, norm_weight, norm_bias, eps, rms)
    return fp8_linear(normed, weight, bias, recipe)


class _Fp8NormLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, norm_weight, norm_bias, eps, rms, weight, bias, recipe):
        fp8 = recipe.fp8
        rows = as_rows(x)
        delayed = fp8.scale(INPUT)
        if producer_quantizes(fp8, delayed):
            quantized, mean, rstd = norm_quantized(rows, norm_weight, norm_bias, eps, rms, delayed)
            out, amax = product_of_rows(quantized, weight, bias, fp8, x.dtype), None
        else:
            normed, mean, rstd = norm_forward(rows, norm_weight, norm_bias, eps, rms)
            out, amax = forward_product(normed, weight, bias, fp8)
            del normed
        ctx.save_for_backward(rows, norm_weight, norm_bias, mean, rstd, weight, amax)
        ctx.eps, ctx.rms, ctx.recipe = eps, rms, recipe
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        rows, norm_weight, norm_bias, mean, rstd, weight, amax = ctx.saved_tensors
        grad_rows = as_rows(grad)
        need_x, need_norm_weight, need_norm_bias = ctx.needs_input_grad[:3]
        need_weight, need_bias = ctx.needs_input_grad[5:7]
        need_normed = need_x or need_norm_weight or need_norm_bias
        fp8 = ctx.recipe.fp8
        source = input_scale_source(fp8, amax)
        normed: Tensor | Fp8Tensor | None = None
        if need_weight and source is not None:
            normed = norm_columns(rows, norm_weight, norm_bias, mean, rstd, ctx.rms, source)
        elif need_weight:
            normed = norm_forward(rows, norm_weight, norm_bias, ctx.eps, ctx.rms)[0]
        d_normed, d_weight = backward_products(
            grad_rows, normed, amax, weight, fp8, ctx.recipe.gradient_sink, need_normed
        )
        del normed
        d_bias = bias_gradient(grad_rows, ctx.bias_dtype) if need_bias else None
        dx = d_norm_weight = d_norm_bias = None
        if d_normed is not None:
            bias_dtype = None if norm_bias is None else norm_bias.dtype
            dx, d_norm_weight, d_norm_bias = norm_backward(
                d_normed, rows, norm_weight, mean, rstd, ctx.rms, bias_dtype
            )
            dx = dx.view(*grad.shape[:-1], rows.shape[1])
        return dx, d_norm_weight, d_norm_bias, None, None, d_weight, d_bias, None
