"""Gated activations act(gate) * up (SwiGLU, GeGLU, ReGLU, squared-ReLU GLU), computed in fp32.

`gated_activation_fused(x)` takes the fused projection output whose last dimension is the
concatenation [gate | up]: gate = x[..., :d], up = x[..., d:]. One kernel does the forward
and one the backward (both input gradients at once). `gated_linear` adds the MLP's second
projection and recomputes the activation in the backward pass instead of storing it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastllm_kernels._dispatch import as_rows, use_triton
from fastllm_kernels.linear import weight_gradient

ACTIVATIONS = ("silu", "gelu", "relu", "squared_relu")
"""Supported names; "gelu" is the tanh approximation (torch's approximate="tanh")."""


def gated_activation(gate: Tensor, up: Tensor, activation: str = "silu") -> Tensor:
    """act(gate) * up, differentiable in gate and up."""
    _check(activation, gate.shape == up.shape, gate, up)
    if use_triton(gate, up):
        return _GatedFunction.apply(gate, up, activation)
    return gated_activation_reference(gate, up, activation)


def gated_activation_fused(x: Tensor, activation: str = "silu") -> Tensor:
    """act(x[..., :d]) * x[..., d:] for x whose last dimension is 2d, laid out as [gate | up]."""
    _check(activation, x.shape[-1] % 2 == 0, x)
    if use_triton(x):
        return _FusedGatedFunction.apply(x, activation)
    gate, up = x.chunk(2, dim=-1)
    return gated_activation_reference(gate, up, activation)


def gated_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str = "silu"
) -> Tensor:
    """linear(act(x[..., :d]) * x[..., d:], weight, bias): the second projection of a gated MLP.

    The activation output (d per token) is not stored for the backward pass but recomputed
    there from x, which the activation's own backward needs anyway: a gated MLP then keeps a
    third less activation memory for one extra elementwise pass. In FP8 for a weight given
    `weight.fp8` (fp8_fused.py)."""
    _check(activation, x.shape[-1] % 2 == 0 and weight.shape[-1] * 2 == x.shape[-1], x, weight)
    fp8 = getattr(weight, "fp8", None)
    if fp8 is not None:
        from fastllm_kernels.fp8_fused import fp8_gated_linear  # it imports this module

        return fp8_gated_linear(x, weight, bias, activation, fp8)
    if use_triton(x, weight, bias):
        return _GatedLinearFunction.apply(x, weight, bias, activation)
    return gated_linear_reference(x, weight, bias, activation)


def gated_linear_reference(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str
) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.linear(
        gated_activation_reference(gate, up, activation), weight, bias
    )


def gated_activation_reference(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    g = gate.float()
    if activation == "silu":
        a = torch.nn.functional.silu(g)
    elif activation == "gelu":
        a = torch.nn.functional.gelu(g, approximate="tanh")
    elif activation == "relu":
        a = torch.relu(g)
    else:
        a = torch.relu(g).square()
    return (a * up.float()).to(gate.dtype)


def _check(activation: str, shapes_ok: bool, *tensors: Tensor) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")
    if not shapes_ok:
        raise ValueError(f"bad gated activation shapes: {[tuple(t.shape) for t in tensors]}")


class _GatedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, activation):
        gate2, up2 = as_rows(gate), as_rows(up)
        out = torch.empty(gate2.shape, dtype=gate.dtype, device=gate.device)
        _launch_forward(gate2, up2, out, activation)
        ctx.save_for_backward(gate2, up2)
        ctx.activation = activation
        return out.view(gate.shape)

    @staticmethod
    def backward(ctx, dy):
        gate2, up2 = ctx.saved_tensors
        d_gate = torch.empty(gate2.shape, dtype=gate2.dtype, device=gate2.device)
        d_up = torch.empty(up2.shape, dtype=up2.dtype, device=up2.device)
        _launch_backward(as_rows(dy), gate2, up2, d_gate, d_up, ctx.activation)
        return d_gate.view(dy.shape), d_up.view(dy.shape), None


class _FusedGatedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, activation):
        x2 = as_rows(x)
        out = _gated_rows(x2, activation)
        ctx.save_for_backward(x2)
        ctx.activation = activation
        return out.view(*x.shape[:-1], out.shape[1])

    @staticmethod
    def backward(ctx, dy):
        (x2,) = ctx.saved_tensors
        d = x2.shape[1] // 2
        dx = torch.empty_like(x2)
        _launch_backward(as_rows(dy), x2[:, :d], x2[:, d:], dx[:, :d], dx[:, d:], ctx.activation)
        return dx.view(*dy.shape[:-1], 2 * d), None


class _GatedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, activation):
        x2 = as_rows(x)
        out = torch.nn.functional.linear(_gated_rows(x2, activation), weight, bias)
        ctx.save_for_backward(x2, weight)
        ctx.activation, ctx.has_bias = activation, bias is not None
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
            _launch_backward(
                d_activation, x2[:, :d], x2[:, d:], dx2[:, :d], dx2[:, d:], ctx.activation,
                activated,
            )  # fmt: skip
            dx = dx2.view(*dy.shape[:-1], 2 * d)
        elif need_weight:
            activated = _gated_rows(x2, ctx.activation)
        if need_weight:
            d_weight = weight_gradient(weight, dy2, activated)
        return dx, d_weight, d_bias, None


def _gated_rows(x2: Tensor, activation: str) -> Tensor:
    d = x2.shape[1] // 2
    out = torch.empty((x2.shape[0], d), dtype=x2.dtype, device=x2.device)
    _launch_forward(x2[:, :d], x2[:, d:], out, activation)
    return out


_BLOCK = 1024


def _launch_forward(gate: Tensor, up: Tensor, out: Tensor, activation: str) -> None:
    n_rows, n_cols = gate.shape
    grid = (n_rows, triton.cdiv(n_cols, _BLOCK))
    _gated_forward_kernel[grid](
        gate, gate.stride(0), up, up.stride(0), out, n_cols,
        ACTIVATION=activation, BLOCK=_BLOCK, num_warps=4,
    )  # fmt: skip


def _launch_backward(
    dy, gate, up, d_gate, d_up, activation: str, activated: Tensor | None = None
) -> None:
    """d_gate and d_up from dy; with `activated` (which may be dy itself, each element
    overwritten after it is read), act(gate) * up too."""
    n_rows, n_cols = gate.shape
    grid = (n_rows, triton.cdiv(n_cols, _BLOCK))
    out = activated if activated is not None else dy
    _gated_backward_kernel[grid](
        dy, dy.stride(0), gate, gate.stride(0), up, up.stride(0),
        d_gate, d_gate.stride(0), d_up, d_up.stride(0), out, out.stride(0), n_cols,
        ACTIVATION=activation, WRITE_ACTIVATED=activated is not None, BLOCK=_BLOCK, num_warps=4,
    )  # fmt: skip


@triton.jit
def _activation_and_derivative(g, ACTIVATION: tl.constexpr):
    """act(g) and act'(g) in fp32."""
    if ACTIVATION == "silu":
        s = tl.sigmoid(g)
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
    elif ACTIVATION == "gelu":
        # 0.5·g·(1 + tanh(k·(g + 0.044715·g³))), k = sqrt(2/π); tanh(u) = 2·sigmoid(2u) - 1.
        k = 0.7978845608028654
        t = 2.0 * tl.sigmoid(2.0 * k * (g + 0.044715 * g * g * g)) - 1.0
        a = 0.5 * g * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * g * g)
    elif ACTIVATION == "relu":
        a = tl.maximum(g, 0.0)
        da = tl.where(g > 0.0, 1.0, 0.0)
    else:  # squared_relu
        r = tl.maximum(g, 0.0)
        a = r * r
        da = 2.0 * r
    return a, da


@triton.jit
def _gated_forward_kernel(
    gate_ptr, gate_row_stride, up_ptr, up_row_stride, out_ptr, n_cols,
    ACTIVATION: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    a, _ = _activation_and_derivative(g, ACTIVATION)
    tl.store(out_ptr + row * n_cols + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_backward_kernel(
    dy_ptr, dy_row_stride, gate_ptr, gate_row_stride, up_ptr, up_row_stride,
    d_gate_ptr, d_gate_row_stride, d_up_ptr, d_up_row_stride, out_ptr, out_row_stride, n_cols,
    ACTIVATION: tl.constexpr, WRITE_ACTIVATED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    a, da = _activation_and_derivative(g, ACTIVATION)
    d_gate = dy * u * da
    tl.store(
        d_gate_ptr + row * d_gate_row_stride + cols,
        d_gate.to(d_gate_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        d_up_ptr + row * d_up_row_stride + cols, (dy * a).to(d_up_ptr.dtype.element_ty), mask=mask
    )
    if WRITE_ACTIVATED:  # as _gated_forward_kernel computes it
        tl.store(
            out_ptr + row * out_row_stride + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask
        )
