"""Linear layers whose weight gradient can go straight into an fp32 accumulator.

A training engine that keeps fp32 gradient buffers may give a weight a `gradient_sink`:
`sink(product)` has `product(out, accumulate)` write (or add) the weight's gradient into its
fp32 view of the engine's buffer (a bf16 product through `matmul_into_fp32_`, an FP8 one
through `torch._scaled_mm`). The weight's autograd gradient is then None: the product never
exists in the compute dtype and no separate pass adds it to the buffer (Megatron-LM's gradient
accumulation fusion). Without a sink, or while torch.compile traces, these are plain linear
layers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from fastllm_kernels.fp8.linear import fp8_linear
from fastllm_kernels.fp8.weight import Fp8Weight

GradientProduct = Callable[[Tensor, bool], None]
"""product(out, accumulate): the weight's gradient, computed in fp32, written into out (fp32)
or, `accumulate`, added to it."""
GradientSink = Callable[[GradientProduct], None]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias), handing the weight gradient to the weight's sink if any; in
    FP8 for a weight given an `Fp8Weight` as `weight.fp8` (fp8/linear.py)."""
    fp8: Fp8Weight | None = getattr(weight, "fp8", None)
    if fp8 is not None:
        return fp8_linear(x, weight, bias, fp8)
    if getattr(weight, "gradient_sink", None) is None or torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    return _SinkLinearFunction.apply(x, weight, bias)


def weight_gradient(weight: Tensor, grad_rows: Tensor, input_rows: Tensor) -> Tensor | None:
    """grad_rowsᵀ @ input_rows, the gradient of a (out, in) weight from (rows, out) output
    gradients and (rows, in) inputs; None once handed to the weight's sink."""
    sink: GradientSink | None = getattr(weight, "gradient_sink", None)
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
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_weight, need_bias = ctx.needs_input_grad
        grad_rows = grad.reshape(-1, grad.shape[-1])
        dx = d_weight = d_bias = None
        if need_x:
            dx = grad @ weight
        if need_weight:
            d_weight = weight_gradient(weight, grad_rows, x.reshape(-1, x.shape[-1]))
        if need_bias and ctx.has_bias:
            d_bias = grad_rows.sum(dim=0)
        return dx, d_weight, d_bias
