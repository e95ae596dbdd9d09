"""Gated activations act(gate) * up (SwiGLU, GeGLU, ReGLU, squared-ReLU GLU), computed in fp32.

`gated_activation_fused(x)` takes the fused projection output whose last dimension is the
concatenation [gate | up]: gate = x[..., :d], up = x[..., d:]. One kernel does the forward
and one the backward (both input gradients at once); `gated_rows` and `gated_backward` launch
them for the ops that fuse the activation with the projection after it (gated_linear.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastllm_kernels._dispatch import as_rows, use_triton
from fastllm_kernels.row_helpers import activation_and_derivative

ACTIVATIONS = ("silu", "gelu", "relu", "squared_relu")
"""Supported names; "gelu" is the tanh approximation (torch's approximate="tanh")."""


def gated_activation(gate: Tensor, up: Tensor, activation: str = "silu") -> Tensor:
    """act(gate) * up, differentiable in gate and up."""
    check_gated(activation, gate.shape == up.shape, gate, up)
    if use_triton(gate, up):
        return _GatedFunction.apply(gate, up, activation)
    return gated_activation_reference(gate, up, activation)


def gated_activation_fused(x: Tensor, activation: str = "silu") -> Tensor:
    """act(x[..., :d]) * x[..., d:] for x whose last dimension is 2d, laid out as [gate | up]."""
    check_gated(activation, x.shape[-1] % 2 == 0, x)
    if use_triton(x):
        return _FusedGatedFunction.apply(x, activation)
    gate, up = x.chunk(2, dim=-1)
    return gated_activation_reference(gate, up, activation)


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


def check_gated(activation: str, shapes_ok: bool, *tensors: Tensor) -> None:
    """ValueError for an unknown activation, or when the caller's shape check failed."""
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
        gated_backward(as_rows(dy), gate2, up2, d_gate, d_up, ctx.activation)
        return d_gate.view(dy.shape), d_up.view(dy.shape), None


class _FusedGatedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, activation):
        x2 = as_rows(x)
        out = gated_rows(x2, activation)
        ctx.save_for_backward(x2)
        ctx.activation = activation
        return out.view(*x.shape[:-1], out.shape[1])

    @staticmethod
    def backward(ctx, dy):
        (x2,) = ctx.saved_tensors
        d = x2.shape[1] // 2
        dx = torch.empty_like(x2)
        gated_backward(as_rows(dy), x2[:, :d], x2[:, d:], dx[:, :d], dx[:, d:], ctx.activation)
        return dx.view(*dy.shape[:-1], 2 * d), None


def gated_rows(x2: Tensor, activation: str) -> Tensor:
    """act(gate) * up of [gate | up] rows x2 (unit column stride), by the forward kernel."""
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


def gated_backward(
    dy, gate, up, d_gate, d_up, activation: str, activated: Tensor | None = None
) -> None:
    """d_gate and d_up from dy (all rows of unit column stride), by the backward kernel; with
    `activated` (which may be dy itself, each element overwritten after it is read),
    act(gate) * up too."""
    n_rows, n_cols = gate.shape
    grid = (n_rows, triton.cdiv(n_cols, _BLOCK))
    out = activated if activated is not None else dy
    _gated_backward_kernel[grid](
        dy, dy.stride(0), gate, gate.stride(0), up, up.stride(0),
        d_gate, d_gate.stride(0), d_up, d_up.stride(0), out, out.stride(0), n_cols,
        ACTIVATION=activation, WRITE_ACTIVATED=activated is not None, BLOCK=_BLOCK, num_warps=4,
    )  # fmt: skip


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
    a, _ = activation_and_derivative(g, ACTIVATION)
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
    a, da = activation_and_derivative(g, ACTIVATION)
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
