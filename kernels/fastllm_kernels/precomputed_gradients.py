"""Autograd for head losses whose hidden and weight gradients are formed with the loss.

The chunked head losses (preference.py, distillation.py, and their vocab-parallel forms) fold
each chunk's logit gradient into the hidden and weight gradients as soon as it exists, so the
logits are never kept for a backward pass; backward only scales the gradients by grad_output,
as `linear_cross_entropy` does. What the gradients are is the caller's `compute`; this module
only carries them through autograd (and hands the weight's to its gradient sink, if any).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fastllm_kernels.recipe import WeightRecipe

Compute = Callable[[bool, bool], tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]]
"""compute(need_hidden_grad, need_weight_grad) → (loss, a non-differentiable extra output or
None, the hidden's gradient or None, the weight's gradient in fp32 or None)."""


def with_precomputed_gradients(
    hidden: Tensor, weight: Tensor, compute: Compute, recipe: WeightRecipe | None = None
) -> tuple[Tensor, Tensor | None]:
    """(loss, extra) of `compute`, differentiable in hidden and weight through the gradients it
    returns. Without grad mode, or when neither input requires grad, no gradient is formed."""
    need_hidden = torch.is_grad_enabled() and hidden.requires_grad
    need_weight = torch.is_grad_enabled() and weight.requires_grad
    if not (need_hidden or need_weight):
        loss, extra, _, _ = compute(False, False)
        return loss, extra
    return _PrecomputedGradients.apply(hidden, weight, compute, need_hidden, need_weight, recipe)


class _PrecomputedGradients(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        compute: Compute,
        need_hidden: bool,
        need_weight: bool,
        recipe: WeightRecipe | None,
    ) -> tuple[Tensor, Tensor | None]:
        loss, extra, grad_hidden, grad_weight = compute(need_hidden, need_weight)
        ctx.sink = None if recipe is None else recipe.gradient_sink
        if grad_weight is not None and ctx.sink is None:
            grad_weight = grad_weight.to(weight.dtype)
        ctx.save_for_backward(grad_hidden, grad_weight)
        if extra is not None:
            ctx.mark_non_differentiable(extra)
        return loss, extra

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor, _grad_extra: Any) -> tuple[Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(grad_output.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_output.to(grad_weight.dtype))
            if ctx.sink is not None:
                # Already fp32: the sink's buffer takes it as it is.
                fp32 = grad_weight
                ctx.sink(lambda out, accumulate: out.add_(fp32) if accumulate else out.copy_(fp32))
                grad_weight = None
        return grad_hidden, grad_weight, None, None, None, None
