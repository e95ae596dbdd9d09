"""linear(act(gate) * up): the second projection of a gated MLP, recomputing the activation.

The activation output (d per token) is not stored for the backward pass but recomputed there
from x, which the activation's own backward needs anyway: a gated MLP then keeps a third less
activation memory for one extra elementwise pass. The projection follows the weight's recipe
(recipe.py): in FP8, or its gradient into the recipe's sink through `weight_gradient`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fastllm_kernels._dispatch import as_rows, use_triton
from fastllm_kernels.activation import (
    check_gated,
    gated_activation_reference,
    gated_backward,
    gated_rows,
)
from fastllm_kernels.fp8.gated_linear import fp8_gated_linear
from fastllm_kernels.linear import weight_gradient
from fastllm_kernels.recipe import WeightRecipe


def gated_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    activation: str = "silu",
    recipe: WeightRecipe | None = None,
) -> Tensor:
    """linear(act(x[..., :d]) * x[..., d:], weight, bias) under the weight's `recipe`; in FP8
    when the recipe has an `Fp8Weight` (fp8/gated_linear.py)."""
    check_gated(activation, x.shape[-1] % 2 == 0 and weight.shape[-1] * 2 == x.shape[-1], x, weight)
    if recipe is not None and recipe.fp8 is not None:
        return fp8_gated_linear(x, weight, bias, activation, recipe)
    if use_triton(x, weight, bias):
        return _GatedLinearFunction.apply(x, weight, bias, activation, recipe)
    return gated_linear_reference(x, weight, bias, activation)


def gated_linear_reference(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str
) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.linear(
        gated_activation_reference(gate, up, activation), weight, bias
    )


class _GatedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, activation, recipe):
        x2 = as_rows(x)
        out = torch.nn.functional.linear(gated_rows(x2, activation), weight, bias)
        ctx.save_for_backward(x2, weight)
        ctx.activation, ctx.has_bias, ctx.recipe = activation, bias is not None, recipe
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        dy2 = as_rows(dy)
        d_weight = d_bias = dx = None
        if need_bias and ctx.has_bias:
            d_bias = dy2.sum(dim=0, dtype=torch.float32).to(dy.dtype)
        activated = None
        if need_x:
            d = x2.shape[1] // 2
            d_activation = dy2 @ weight
            dx2 = torch.empty_like(x2)
            # The same pass recomputes the activation for the weight gradient, over the
            # gradient it has just read: gate and up are read once for both.
            activated = d_activation if need_weight else None
            gated_backward(
                d_activation, x2[:, :d], x2[:, d:], dx2[:, :d], dx2[:, d:], ctx.activation,
                activated,
            )  # fmt: skip
            dx = dx2.view(*dy.shape[:-1], 2 * d)
        elif need_weight:
            activated = gated_rows(x2, ctx.activation)
        if need_weight:
            d_weight = weight_gradient(dy2, activated, ctx.recipe)
        return dx, d_weight, d_bias, None, None
