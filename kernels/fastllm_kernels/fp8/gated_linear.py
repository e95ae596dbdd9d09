"""`gated_linear` with the projection in FP8: the gated activation's kernel writes its output
in fp8 (producers.py) where the recipe allows, and the backward pass recomputes it from
[gate | up], as the bf16 `gated_linear` does."""

from __future__ import annotations

import torch
from torch import Tensor

from fastllm_kernels._dispatch import as_rows, use_triton
from fastllm_kernels.activation import gated_activation_reference, gated_backward, gated_rows
from fastllm_kernels.fp8.amax_history import INPUT
from fastllm_kernels.fp8.linear import (
    backward_products,
    bias_gradient,
    forward_product,
    fp8_linear,
    input_scale_source,
    product_of_rows,
)
from fastllm_kernels.fp8.producers import gated_columns, gated_quantized, producer_quantizes
from fastllm_kernels.fp8.quantize import Fp8Tensor
from fastllm_kernels.recipe import WeightRecipe


def fp8_gated_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str, recipe: WeightRecipe
) -> Tensor:
    """`gated_linear` with the projection in FP8 under `recipe.fp8`."""
    if use_triton(x, weight, bias):
        return _Fp8GatedLinearFunction.apply(x, weight, bias, activation, recipe)
    gate, up = x.chunk(2, dim=-1)
    return fp8_linear(gated_activation_reference(gate, up, activation), weight, bias, recipe)


class _Fp8GatedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, activation, recipe):
        fp8 = recipe.fp8
        x2 = as_rows(x)
        delayed = fp8.scale(INPUT)
        if producer_quantizes(fp8, delayed):
            quantized = gated_quantized(x2, activation, delayed)
            out, amax = product_of_rows(quantized, weight, bias, fp8, x.dtype), None
        else:
            out, amax = forward_product(gated_rows(x2, activation), weight, bias, fp8)
        ctx.save_for_backward(x2, weight, amax)
        ctx.activation, ctx.recipe = activation, recipe
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, weight, amax = ctx.saved_tensors
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        dy2 = as_rows(dy)
        fp8 = ctx.recipe.fp8
        source = input_scale_source(fp8, amax)
        activated: Tensor | Fp8Tensor | None = None
        if need_weight and source is not None:
            activated = gated_columns(x2, ctx.activation, source)
        elif need_weight:
            activated = gated_rows(x2, ctx.activation)
        d_activation, d_weight = backward_products(
            dy2, activated, amax, weight, fp8, ctx.recipe.gradient_sink, need_x
        )
        del activated
        d_bias = bias_gradient(dy2, ctx.bias_dtype) if need_bias else None
        dx = None
        if d_activation is not None:
            d = x2.shape[1] // 2
            dx2 = torch.empty_like(x2)
            gated_backward(
                d_activation, x2[:, :d], x2[:, d:], dx2[:, :d], dx2[:, d:], ctx.activation
            )
            dx = dx2.view(*dy.shape[:-1], 2 * d)
        return dx, d_weight, d_bias, None, None
