"""linear(norm(x)) that keeps x, not norm(x), for the backward pass.

In a pre-norm transformer block the normalized activations (hidden size per token, twice per
layer) are stored only because the projection after the norm needs them for its weight
gradient. Here the backward pass recomputes them from x, which the norm's own backward needs
anyway: one more elementwise pass over x per norm, and two hidden-size activations per token per
layer less memory (2.6 GiB for llama-3b at micro-batch 2 × 4096 tokens). The projection
follows the weight's recipe (recipe.py): in FP8, or its gradient into the recipe's sink
through `weight_gradient`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fastllm_kernels._dispatch import as_rows, use_triton
from fastllm_kernels.fp8.norm_linear import fp8_norm_linear
from fastllm_kernels.linear import linear, weight_gradient
from fastllm_kernels.norm import (
    norm_backward,
    norm_forward,
    norm_reference,
)
from fastllm_kernels.recipe import WeightRecipe


def norm_linear(
    x: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor | None,
    eps: float,
    rms: bool,
    weight: Tensor,
    bias: Tensor | None = None,
    recipe: WeightRecipe | None = None,
) -> Tensor:
    """linear(norm(x), weight, bias) under the weight's `recipe`; the norm is RMSNorm (`rms`)
    or LayerNorm (norm_bias may then be None), over the last dimension as `rms_norm` /
    `layer_norm` compute it; the projection in FP8 when the recipe has an `Fp8Weight`
    (fp8/norm_linear.py)."""
    if rms and norm_bias is not None:
        raise ValueError("RMSNorm takes no bias")
    if recipe is not None and recipe.fp8 is not None:
        return fp8_norm_linear(x, norm_weight, norm_bias, eps, rms, weight, bias, recipe)
    if use_triton(x, norm_weight, norm_bias, weight, bias):
        return _NormLinearFunction.apply(x, norm_weight, norm_bias, eps, rms, weight, bias, recipe)
    return norm_linear_reference(x, norm_weight, norm_bias, eps, rms, weight, bias, recipe)


def norm_linear_reference(
    x: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor | None,
    eps: float,
    rms: bool,
    weight: Tensor,
    bias: Tensor | None = None,
    recipe: WeightRecipe | None = None,
) -> Tensor:
    normed = norm_reference(x, norm_weight, norm_bias, eps, rms)
    return linear(normed, weight, bias, recipe)


class _NormLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, norm_weight, norm_bias, eps, rms, weight, bias, recipe):
        rows = as_rows(x)
        normed, mean, rstd = norm_forward(rows, norm_weight, norm_bias, eps, rms)
        # The output is a tensor of its own, not a view made here: rotary may turn part of
        # it in place (latent attention's queries).
        out = F.linear(normed.view(*x.shape[:-1], normed.shape[-1]), weight, bias)
        ctx.save_for_backward(rows, norm_weight, norm_bias, mean, rstd, weight)
        ctx.eps, ctx.rms, ctx.has_bias, ctx.recipe = eps, rms, bias is not None, recipe
        return out

    @staticmethod
    def backward(ctx, grad):
        rows, norm_weight, norm_bias, mean, rstd, weight = ctx.saved_tensors
        grad_rows = as_rows(grad)
        need_x, need_norm_weight, need_norm_bias = ctx.needs_input_grad[:3]
        need_weight, need_bias = ctx.needs_input_grad[5:7]
        d_weight = d_bias = dx = d_norm_weight = d_norm_bias = normed = None
        if need_bias and ctx.has_bias:
            d_bias = grad_rows.sum(dim=0)
        if need_x or need_norm_weight or need_norm_bias:
            bias_dtype = None if norm_bias is None else norm_bias.dtype
            d_normed = grad_rows @ weight
            # The same pass recomputes the norm's output for the weight gradient, over the
            # gradient it has just read: x is read once for both.
            normed = d_normed if need_weight else None
            dx, d_norm_weight, d_norm_bias = norm_backward(
                d_normed, rows, norm_weight, mean, rstd, ctx.rms, bias_dtype, normed, norm_bias
            )
            dx = dx.view(*grad.shape[:-1], rows.shape[1])
        elif need_weight:
            normed = norm_forward(rows, norm_weight, norm_bias, ctx.eps, ctx.rms)[0]
        if need_weight:
            d_weight = weight_gradient(grad_rows, normed, ctx.recipe)
        return dx, d_norm_weight, d_norm_bias, None, None, d_weight, d_bias, None
