"""Linear layers computing in FP8: the three products of a linear layer through `torch._scaled_mm`.

A training engine opts a weight in by giving its recipe an `Fp8Weight` (recipe.py, weight.py);
`linear`, `norm_linear` and `gated_linear` then compute through here. The forward product and
the input gradient come out in the compute dtype, the weight gradient in fp32 straight into
the engine's gradient buffer when the recipe has a gradient sink; the forward product
accumulates in the faster mode of the fp8 tensor cores, the two gradient products in full
precision (torchao's choice). On CPU the products multiply the dequantized fp32 operands: the
same rounding of the operands as on the GPU, so the CPU tests cover the recipes' logic.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fastllm_kernels._dispatch import as_rows
from fastllm_kernels.fp8.amax_history import GRADIENT, INPUT
from fastllm_kernels.fp8.quantize import E4M3, Fp8Tensor, quantize, requested
from fastllm_kernels.fp8.weight import Fp8Weight
from fastllm_kernels.recipe import GradientSink, WeightRecipe

_ALIGNMENT = 16
"""`_scaled_mm` wants every dimension of its operands a multiple of 16."""


def scaled_matmul(
    a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype, fast: bool, out: Tensor | None = None
) -> Tensor:
    """a (M, K) @ b (N, K)ᵀ with their scales, in `out_dtype` (into `out` when given):
    `torch._scaled_mm` on CUDA (b's transpose is the column-major operand it takes), the
    dequantized fp32 product elsewhere. `fast`: the tensor cores' faster, less precise
    accumulation."""
    (m, k), (n, k_b) = a.data.shape, b.data.shape
    if k != k_b:
        raise ValueError(f"scaled_matmul: shapes {tuple(a.data.shape)} and {tuple(b.data.shape)}")
    if not a.data.is_cuda:
        product = ((a.data.float() * a.scale) @ (b.data.float() * b.scale).t()).to(out_dtype)
        return product if out is None else out.copy_(product)
    if m % _ALIGNMENT or n % _ALIGNMENT or k % _ALIGNMENT:
        raise ValueError(
            f"FP8 products need every dimension a multiple of {_ALIGNMENT}: got "
            f"({m} x {k}) @ ({k} x {n}); the token count of a micro-batch counts too"
        )
    return torch._scaled_mm(
        a.data,
        b.data.t(),
        scale_a=a.scale,
        scale_b=b.scale.t(),
        out_dtype=out_dtype,
        use_fast_accum=fast,
        **({} if out is None else {"out": out}),
    )


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, recipe: WeightRecipe) -> Tensor:
    """F.linear(x, weight, bias) with all three products in FP8 under `recipe.fp8`."""
    return _Fp8LinearFunction.apply(x, weight, bias, recipe)


def forward_product(
    rows: Tensor, weight: Tensor, bias: Tensor | None, fp8: Fp8Weight
) -> tuple[Tensor, Tensor | None]:
    """rows @ weightᵀ + bias in the rows' dtype, and (tensorwise, current scaling) the rows'
    amax, which the weight gradient's quantization of the same rows reuses."""
    x = quantize(rows, E4M3, tensorwise=fp8.recipe.tensorwise, delayed=fp8.scale(INPUT))
    return product_of_rows(requested(x.rows), weight, bias, fp8, rows.dtype), x.amax


def product_of_rows(
    x: Fp8Tensor, weight: Tensor, bias: Tensor | None, fp8: Fp8Weight, dtype: torch.dtype
) -> Tensor:
    """The forward product of rows already in fp8."""
    out = scaled_matmul(x, fp8.rows(weight), dtype, fast=True)
    return out if bias is None else out.add_(bias)


def backward_products(
    grad_rows: Tensor,
    input_rows: Tensor | Fp8Tensor | None,
    input_amax: Tensor | None,
    weight: Tensor,
    fp8: Fp8Weight,
    sink: GradientSink | None,
    need_input: bool,
) -> tuple[Tensor | None, Tensor | None]:
    """The input gradient (when `need_input`) and the weight gradient (when `input_rows`, the
    forward product's input, recomputed or kept, is given, or its columns already in fp8;
    None once handed to `sink`) from the output gradient rows. The input rows are scaled as
    in the forward product: from `input_amax`, or from the same amax history."""
    need_weight = input_rows is not None
    if not (need_input or need_weight):
        return None, None
    tensorwise = fp8.recipe.tensorwise
    grad = quantize(
        grad_rows,
        fp8.recipe.gradient_dtype,
        tensorwise=tensorwise,
        rows=need_input,
        columns=need_weight,
        delayed=fp8.scale(GRADIENT),
    )
    d_input = d_weight = None
    if need_input:
        w = fp8.columns(weight)
        d_input = scaled_matmul(requested(grad.rows), w, grad_rows.dtype, fast=False)
    if isinstance(input_rows, Fp8Tensor):
        d_weight = weight_gradient(weight, requested(grad.columns), input_rows, sink)
    elif input_rows is not None:
        delayed = fp8.scale(INPUT, record=False) if input_amax is None else None
        x = quantize(
            input_rows, E4M3, tensorwise=tensorwise, rows=False, columns=True, amax=input_amax,
            delayed=delayed,
        )  # fmt: skip
        d_weight = weight_gradient(weight, requested(grad.columns), requested(x.columns), sink)
    return d_input, d_weight


def input_scale_source(fp8: Fp8Weight, input_amax: Tensor | None) -> Tensor | None:
    """What the backward pass scales a tensorwise layer's input columns from, as in its forward
    product: the input's amax (current scaling) or the amax history (delayed); None: rowwise."""
    if not fp8.recipe.tensorwise:
        return None
    if input_amax is not None:
        return input_amax
    delayed = fp8.scale(INPUT, record=False)
    assert delayed is not None and delayed.history is not None
    return delayed.history


def weight_gradient(
    weight: Tensor, grad: Fp8Tensor, x: Fp8Tensor, sink: GradientSink | None
) -> Tensor | None:
    """gradᵀ x (both transposed already): into the weight's gradient `sink` in fp32 (no copy of
    it in the compute dtype), else returned in the weight's dtype."""
    if sink is None:
        return scaled_matmul(grad, x, weight.dtype, fast=False)

    def product(out: Tensor, accumulate: bool) -> None:
        if accumulate:
            out.add_(scaled_matmul(grad, x, torch.float32, fast=False))
        else:
            scaled_matmul(grad, x, torch.float32, fast=False, out=out)

    sink(product)
    return None


def bias_gradient(grad_rows: Tensor, bias_dtype: torch.dtype) -> Tensor:
    return grad_rows.sum(dim=0, dtype=torch.float32).to(bias_dtype)


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe):
        rows = as_rows(x)
        out, amax = forward_product(rows, weight, bias, recipe.fp8)
        # The input is only the weight gradient's operand: none kept for a frozen weight.
        ctx.save_for_backward(rows if ctx.needs_input_grad[1] else None, weight, amax)
        ctx.recipe, ctx.bias_dtype = recipe, None if bias is None else bias.dtype
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        rows, weight, amax = ctx.saved_tensors
        need_x, _, need_bias, _ = ctx.needs_input_grad
        grad_rows = as_rows(grad)
        recipe = ctx.recipe
        dx, d_weight = backward_products(
            grad_rows, rows, amax, weight, recipe.fp8, recipe.gradient_sink, need_x
        )
        d_bias = bias_gradient(grad_rows, ctx.bias_dtype) if need_bias else None
        if dx is not None:
            dx = dx.view(*grad.shape[:-1], weight.shape[1])
        return dx, d_weight, d_bias, None
