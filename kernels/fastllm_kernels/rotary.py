"""Rotary position embedding, Hugging Face's "rotate_half" convention, computed in fp32.

The pair rotated together is (x[..., i], x[..., i + head_dim // 2]):
    out[i]       = x[i] * cos[i] - x[i + d/2] * sin[i]
    out[i + d/2] = x[i + d/2] * cos[i] + x[i] * sin[i]
The Triton path rotates x in place (x may be a strided view, e.g. q inside a fused qkv output) and
returns it, so callers must use the return value and not rely on x being unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastllm_kernels._dispatch import use_triton


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (batch, seq, heads, head_dim) by angles whose cos/sin are (seq, head_dim // 2), or
    (batch, seq, head_dim // 2) for packed documents whose positions restart; cos/sin in fp32."""
    _check_shapes(x, cos, sin)
    if use_triton(x, cos, sin):
        if x.stride(-1) != 1 or (x.is_leaf and x.requires_grad):
            x = x.clone(memory_format=torch.contiguous_format)  # a leaf cannot change in place
        return _RotaryFunction.apply(x, cos, sin)
    return apply_rotary_reference(x, cos, sin)


def apply_rotary_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    cos, sin = _broadcastable(cos), _broadcastable(sin)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _broadcastable(angles: Tensor) -> Tensor:
    """(seq, d/2) or (batch, seq, d/2) → (batch or 1, seq, 1, d/2) fp32."""
    return angles.float().reshape(-1, *angles.shape[-2:]).unsqueeze(2)


def _check_shapes(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    batch, seq, _, head_dim = x.shape
    if head_dim % 2 or cos.shape != sin.shape:
        raise ValueError(f"bad rotary shapes: x {tuple(x.shape)}, cos {tuple(cos.shape)}")
    if cos.shape not in ((seq, head_dim // 2), (batch, seq, head_dim // 2)):
        raise ValueError(
            f"cos/sin must be ({seq}, {head_dim // 2}) or ({batch}, {seq}, {head_dim // 2})"
        )


class _RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        _rotate(x, x, cos, sin, sign=1.0)
        ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin)
        return x

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        # The gradient is rotated by -angle into a new tensor, not in place: autograd may hand the
        # same gradient tensor to other consumers (an addition passes it on to both operands).
        dx = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        _rotate(grad if grad.stride(-1) == 1 else grad.contiguous(), dx, cos, sin, sign=-1.0)
        return dx, None, None


def _rotate(x: Tensor, out: Tensor, cos: Tensor, sin: Tensor, sign: float) -> None:
    batch, seq, heads, head_dim = x.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    half = head_dim // 2
    block_d = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(heads), max(1, 4096 // block_d))
    cos_batch_stride = cos.stride(0) if cos.dim() == 3 else 0
    grid = (batch * seq, triton.cdiv(heads, block_h))
    _rotary_kernel[grid](
        x, out, cos, sin, seq, heads, half, *x.stride()[:3], *out.stride()[:3],
        cos_batch_stride, sign, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip


@triton.jit
def _rotary_kernel(
    x_ptr, out_ptr, cos_ptr, sin_ptr, seq, heads, half,
    x_stride_b, x_stride_s, x_stride_h, out_stride_b, out_stride_s, out_stride_h,
    cos_stride_b, sign, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    b = token // seq
    s = token % seq
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    d_mask = d < half
    angle_offset = b * cos_stride_b + s * half + d
    cos = tl.load(cos_ptr + angle_offset, mask=d_mask, other=0.0).to(tl.float32)
    sin = sign * tl.load(sin_ptr + angle_offset, mask=d_mask, other=0.0).to(tl.float32)
    mask = (h < heads) & d_mask
    x1_ptr = x_ptr + b * x_stride_b + s * x_stride_s + h * x_stride_h + d
    x1 = tl.load(x1_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptr + half, mask=mask, other=0.0).to(tl.float32)
    out1_ptr = out_ptr + b * out_stride_b + s * out_stride_s + h * out_stride_h + d
    tl.store(out1_ptr, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out1_ptr + half, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)
