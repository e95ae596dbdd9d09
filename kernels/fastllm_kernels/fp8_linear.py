"""Linear layers computing in FP8: the three products of a linear layer through `torch._scaled_mm`.

A training engine opts a weight in by setting `weight.fp8 = Fp8Weight(recipe)`; `linear`,
`norm_linear` and `gated_linear` then compute through here. The recipes:

- tensorwise: one scale per tensor; activations and weights in e4m3, gradients in e5m2
  (its wider range, as Transformer Engine and torchao's tensorwise recipe do).
- rowwise: one scale per row of each operand along the contracted dimension, everything in
  e4m3 (torchao's rowwise; `_scaled_mm` takes rowwise scales only for e4m3 operands).

Scaling is current: each tensor's scale comes from its own amax, so there is no state to
checkpoint. Products come out in the compute dtype; the forward product accumulates in the
faster mode of the fp8 tensor cores, the two gradient products in full precision (torchao's
choice). On CPU the products multiply the dequantized fp32 operands: the same rounding of the
operands as on the GPU, so the CPU tests cover the recipes' logic.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from fastllm_kernels._dispatch import as_rows
from fastllm_kernels.fp8 import Fp8Tensor, Quantized, quantize


class Fp8Recipe(NamedTuple):
    tensorwise: bool
    """One scale per tensor (else one per row of each operand)."""
    gradient_dtype: torch.dtype
    """The format of the output gradients."""


RECIPES = {
    "tensorwise": Fp8Recipe(True, torch.float8_e5m2),
    "rowwise": Fp8Recipe(False, torch.float8_e4m3fn),
}
E4M3 = torch.float8_e4m3fn
_ALIGNMENT = 16
"""`_scaled_mm` wants every dimension of its operands a multiple of 16."""


class Fp8Weight:
    """How a linear layer's weight computes in FP8 (set as `weight.fp8`).

    Its row-quantized copy, the forward product's operand, is made at the first use after the
    weight changed and kept: once per optimizer step, not once per micro-batch. A change is
    seen through the weight's version counter, which in-place torch ops bump; whatever writes
    the weight behind autograd's back (a fused optimizer kernel) must bump it too
    (`torch.autograd.graph.increment_version`). The transposed copy that the input gradient
    needs is made in each backward pass and dropped after it: kept too, it would hold another
    byte per parameter for the whole step (5% more memory for llama-1b)."""

    def __init__(self, recipe: str) -> None:
        if recipe not in RECIPES:
            raise ValueError(f"unknown FP8 recipe {recipe!r}; expected one of {tuple(RECIPES)}")
        self.name, self.recipe = recipe, RECIPES[recipe]
        self._key: tuple[int, int] | None = None
        self._rows: Quantized | None = None

    def rows(self, weight: Tensor) -> Quantized:
        """The weight (out, in) in e4m3, scaled per row or for the tensor (its amax kept)."""
        key = (weight.data_ptr(), weight._version)
        if self._rows is None or key != self._key:
            self._rows = quantize(weight.detach(), E4M3, tensorwise=self.recipe.tensorwise)
            self._key = key
        return self._rows

    def columns(self, weight: Tensor) -> Fp8Tensor:
        """The weight transposed (in, out) in e4m3, scaled per column or for the tensor."""
        amax = self.rows(weight).amax  # tensorwise: the same scale as the rows'
        quantized = quantize(
            weight.detach(), E4M3, tensorwise=self.recipe.tensorwise, rows=False, columns=True,
            amax=amax,
        )  # fmt: skip
        return _part(quantized.columns)


def scaled_matmul(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype, fast: bool) -> Tensor:
    """a (M, K) @ b (N, K)ᵀ with their scales, in `out_dtype`: `torch._scaled_mm` on CUDA (b's
    transpose is the column-major operand it takes), the dequantized fp32 product elsewhere.
    `fast`: the tensor cores' faster, less precise accumulation."""
    (m, k), (n, k_b) = a.data.shape, b.data.shape
    if k != k_b:
        raise ValueError(f"scaled_matmul: shapes {tuple(a.data.shape)} and {tuple(b.data.shape)}")
    if not a.data.is_cuda:
        return ((a.data.float() * a.scale) @ (b.data.float() * b.scale).t()).to(out_dtype)
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
    )


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, fp8: Fp8Weight) -> Tensor:
    """F.linear(x, weight, bias) with all three products in FP8 under `fp8`'s recipe."""
    return _Fp8LinearFunction.apply(x, weight, bias, fp8)


def forward_product(
    rows: Tensor, weight: Tensor, bias: Tensor | None, fp8: Fp8Weight
) -> tuple[Tensor, Tensor | None]:
    """rows @ weightᵀ + bias in the rows' dtype, and (tensorwise) the rows' amax, which the
    weight gradient's quantization of the same rows reuses."""
    x = quantize(rows, E4M3, tensorwise=fp8.recipe.tensorwise)
    return product_of_rows(_part(x.rows), weight, bias, fp8, rows.dtype), x.amax


def product_of_rows(
    x: Fp8Tensor, weight: Tensor, bias: Tensor | None, fp8: Fp8Weight, dtype: torch.dtype
) -> Tensor:
    """The forward product of rows already in fp8."""
    out = scaled_matmul(x, _part(fp8.rows(weight).rows), dtype, fast=True)
    return out if bias is None else out.add_(bias)


def backward_products(
    grad_rows: Tensor,
    input_rows: Tensor | None,
    input_amax: Tensor | None,
    weight: Tensor,
    fp8: Fp8Weight,
    need_input: bool,
) -> tuple[Tensor | None, Tensor | None]:
    """The input gradient (when `need_input`) and the weight gradient (when `input_rows`, the
    forward product's input, recomputed or kept, is given) from the output gradient rows."""
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
    )
    d_input = d_weight = None
    if need_input:
        w = fp8.columns(weight)
        d_input = scaled_matmul(_part(grad.rows), w, grad_rows.dtype, fast=False)
    if input_rows is not None:
        x = quantize(
            input_rows, E4M3, tensorwise=tensorwise, rows=False, columns=True, amax=input_amax
        )
        d_weight = scaled_matmul(_part(grad.columns), _part(x.columns), weight.dtype, fast=False)
    return d_input, d_weight


def _part(t: Fp8Tensor | None) -> Fp8Tensor:
    """A layout `quantize` was asked for (so not None)."""
    assert t is not None
    return t


def bias_gradient(grad_rows: Tensor, bias_dtype: torch.dtype) -> Tensor:
    return grad_rows.sum(dim=0, dtype=torch.float32).to(bias_dtype)


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, fp8):
        rows = as_rows(x)
        out, amax = forward_product(rows, weight, bias, fp8)
        ctx.save_for_backward(rows, weight, amax)
        ctx.fp8, ctx.bias_dtype = fp8, None if bias is None else bias.dtype
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        rows, weight, amax = ctx.saved_tensors
        need_x, need_weight, need_bias, _ = ctx.needs_input_grad
        grad_rows = as_rows(grad)
        dx, d_weight = backward_products(
            grad_rows, rows if need_weight else None, amax, weight, ctx.fp8, need_x
        )
        d_bias = bias_gradient(grad_rows, ctx.bias_dtype) if need_bias else None
        if dx is not None:
            dx = dx.view(*grad.shape[:-1], rows.shape[1])
        return dx, d_weight, d_bias, None
