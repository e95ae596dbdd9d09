"""A projection and its LoRA update as one op: linear(x, W, bias) + scale · (x Aᵀ) Bᵀ.

Composed from two ops, autograd gives x two gradients (through W and through A), writes each
and sums them in a third pass; here the adapter's part is added into the base's in the same
GEMM (cuBLAS's beta = 1). The update is added to the base output in place too, and W's
gradient, when W trains, goes through its recipe's sink as `linear`'s does. FP8 recipes keep
the composed form (model/lora.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fastllm_kernels.linear import weight_gradient
from fastllm_kernels.recipe import WeightRecipe


def lora_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    recipe: WeightRecipe | None,
    a: Tensor,
    b: Tensor,
    scale: float,
) -> Tensor:
    """x (…, in) through weight (out, in) and bias, plus scale · (x aᵀ) bᵀ with a (r, in) and
    b (out, r); differentiable in x, weight, bias, a and b."""
    return _LoRALinearFunction.apply(x, weight, bias, recipe, a, b, scale)


class _LoRALinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe, a, b, scale):
        rows = x.reshape(-1, x.shape[-1])
        low = rows @ a.t()
        out = F.linear(rows, weight, bias)
        out.addmm_(low, b.t(), alpha=scale)
        ctx.save_for_backward(x, weight, a, b, low)
        ctx.has_bias, ctx.recipe, ctx.scale = bias is not None, recipe, scale
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x, weight, a, b, low = ctx.saved_tensors
        need_x, need_weight, need_bias, _, need_a, need_b, _ = ctx.needs_input_grad
        rows = x.reshape(-1, x.shape[-1])
        grad_rows = grad.reshape(-1, grad.shape[-1])
        grad_low = (grad_rows @ b).mul_(ctx.scale)  # (rows, r): small
        dx = d_weight = d_bias = d_a = d_b = None
        if need_x:
            dx = grad_rows @ weight
            dx.addmm_(grad_low, a)
            dx = dx.view(x.shape)
        if need_weight:
            d_weight = weight_gradient(grad_rows, rows, ctx.recipe)
        if need_bias and ctx.has_bias:
            d_bias = grad_rows.sum(dim=0)
        if need_a:
            d_a = grad_low.t() @ rows
        if need_b:
            d_b = (grad_rows.t() @ low).mul_(ctx.scale)
        return dx, d_weight, d_bias, None, d_a, d_b, None
