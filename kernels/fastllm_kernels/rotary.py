"""Rotary position embedding, Hugging Face's "rotate_half" convention, computed in fp32.

The pair rotated together is (x[..., i], x[..., i + head_dim // 2]):
    out[i]       = x[i] * cos[i] - x[i + d/2] * sin[i]
    out[i + d/2] = x[i + d/2] * cos[i] + x[i] * sin[i]
`apply_rotary`'s Triton path rotates x in place (x may be a strided view, e.g. q inside a fused qkv
output) and returns it, so callers must use the return value and not rely on x being unchanged.

`split_qkv_rotary` takes the fused qkv projection whole and returns new q, k, v with q and k
rotated. Slicing qkv and rotating the slices in place instead costs, in autograd's view and
in-place bookkeeping (CopySlices), zero-filled, copied and summed full-size gradient buffers;
here the backward pass writes dqkv once, from dq, dk and dv of any strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastllm_kernels._dispatch import use_triton
from fastllm_kernels.qkv_tiles import (
    check_angles,
    check_qkv_shapes,
    load_halves,
    part_pointers,
    qkv_launch,
    qkv_tile,
    rotate_halves,
    split_rows,
)


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


def split_qkv_rotary(
    qkv: Tensor, heads: int, kv_heads: int, cos: Tensor | None, sin: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Split qkv (batch, seq, (heads + 2 * kv_heads) * head_dim), of any strides, into
    q (batch, seq, heads, head_dim) and k, v (batch, seq, kv_heads, head_dim), rotating q and k
    as apply_rotary does; cos = sin = None for no rotation. The Triton path returns new
    contiguous tensors; gradients flow to qkv only."""
    head_dim = check_qkv_shapes(qkv, heads, kv_heads, cos, sin)
    if use_triton(qkv, cos, sin):
        return _SplitQKVRotaryFunction.apply(qkv, heads, kv_heads, head_dim, cos, sin)
    return split_qkv_rotary_reference(qkv, heads, kv_heads, cos, sin)


def split_qkv_rotary_reference(
    qkv: Tensor, heads: int, kv_heads: int, cos: Tensor | None, sin: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """v (and q, k without rotation) are views of qkv here, not copies."""
    batch, seq, width = qkv.shape
    heads_of_qkv = qkv.view(batch, seq, heads + 2 * kv_heads, width // (heads + 2 * kv_heads))
    q, k, v = heads_of_qkv.split([heads, kv_heads, kv_heads], dim=2)
    if cos is not None and sin is not None:
        q, k = apply_rotary_reference(q, cos, sin), apply_rotary_reference(k, cos, sin)
    return q, k, v


def _broadcastable(angles: Tensor) -> Tensor:
    """(seq, d/2) or (batch, seq, d/2) → (batch or 1, seq, 1, d/2) fp32."""
    return angles.float().reshape(-1, *angles.shape[-2:]).unsqueeze(2)


def _check_shapes(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    batch, seq, _, head_dim = x.shape
    if head_dim % 2 or cos.shape != sin.shape:
        raise ValueError(f"bad rotary shapes: x {tuple(x.shape)}, cos {tuple(cos.shape)}")
    check_angles(batch, seq, head_dim, cos)


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


class _SplitQKVRotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, heads, kv_heads, head_dim, cos, sin):
        batch, seq, _ = qkv.shape
        q = torch.empty((batch, seq, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        k = torch.empty((batch, seq, kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        v = torch.empty((batch, seq, kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        grid, args, constants = qkv_launch(qkv, heads, kv_heads, head_dim, cos, sin)
        _split_qkv_rotary_kernel[grid](qkv, q, k, v, *args, *qkv.stride(), **constants)
        ctx.save_for_backward(cos, sin)
        ctx.heads, ctx.kv_heads, ctx.head_dim = heads, kv_heads, head_dim
        # Unused outputs get None gradients rather than zero-filled ones: the backward kernel
        # writes their zeros into dqkv itself.
        ctx.set_materialize_grads(False)
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        grads = (dq, dk, dv)
        some = next(g for g in grads if g is not None)
        batch, seq = some.shape[:2]
        width = (ctx.heads + 2 * ctx.kv_heads) * ctx.head_dim
        dqkv = torch.empty((batch, seq, width), dtype=some.dtype, device=some.device)
        grid, args, constants = qkv_launch(dqkv, ctx.heads, ctx.kv_heads, ctx.head_dim, cos, sin)
        # A missing gradient is read as zeros; dqkv stands in for its pointer, never dereferenced.
        pointers = [dqkv if g is None else g for g in grads]
        strides = [s for g in grads for s in ((0,) * 4 if g is None else g.stride())]
        _split_qkv_rotary_backward_kernel[grid](
            *pointers, dqkv, *args, *strides,
            HAS_DQ=dq is not None, HAS_DK=dk is not None, HAS_DV=dv is not None, **constants,
        )  # fmt: skip
        return dqkv, None, None, None, None, None


@triton.jit
def _split_qkv_rotary_kernel(
    qkv_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, seq, heads, kv_heads, head_dim, half,
    cos_stride_b, qkv_stride_b, qkv_stride_s, qkv_stride_c,
    ROTATE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    token, b, s, h, d, mask, is_q, is_k, is_v = qkv_tile(
        seq, heads, kv_heads, half, BLOCK_H, BLOCK_D
    )
    x_ptrs = qkv_ptr + b * qkv_stride_b + s * qkv_stride_s + (h * head_dim + d) * qkv_stride_c
    split_rows(
        x_ptrs, q_ptr, k_ptr, v_ptr, token, cos_ptr, sin_ptr, b, s, h, d, heads, kv_heads,
        head_dim, half, cos_stride_b, qkv_stride_c, mask, is_q, is_k, is_v, ROTATE,
    )  # fmt: skip


@triton.jit
def _split_qkv_rotary_backward_kernel(
    dq_ptr, dk_ptr, dv_ptr, dqkv_ptr, cos_ptr, sin_ptr, seq, heads, kv_heads, head_dim, half,
    cos_stride_b, dq_stride_b, dq_stride_s, dq_stride_h, dq_stride_d,
    dk_stride_b, dk_stride_s, dk_stride_h, dk_stride_d,
    dv_stride_b, dv_stride_s, dv_stride_h, dv_stride_d,
    HAS_DQ: tl.constexpr, HAS_DK: tl.constexpr, HAS_DV: tl.constexpr,
    ROTATE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    token, b, s, h, d, mask, is_q, is_k, is_v = qkv_tile(
        seq, heads, kv_heads, half, BLOCK_H, BLOCK_D
    )
    # Gradients come with any strides (attention kernels return (batch, heads, seq)-major
    # ones); lanes of the other two parts point at head 0 (masked off).
    dq_ptrs, dk_ptrs, dv_ptrs = part_pointers(
        dq_ptr, dk_ptr, dv_ptr, b, s, h, d, heads, kv_heads, is_q, is_k, is_v,
        dq_stride_b, dq_stride_s, dq_stride_h, dq_stride_d,
        dk_stride_b, dk_stride_s, dk_stride_h, dk_stride_d,
        dv_stride_b, dv_stride_s, dv_stride_h, dv_stride_d,
    )  # fmt: skip
    out_ptrs = dqkv_ptr + token * (heads + 2 * kv_heads) * head_dim + h * head_dim + d
    g1, g2 = load_halves(
        dq_ptrs, dk_ptrs, dv_ptrs, dq_stride_d, dk_stride_d, dv_stride_d, half,
        mask, is_q, is_k, is_v, HAS_DQ, HAS_DK, HAS_DV, ROTATE,
    )  # fmt: skip
    if ROTATE:
        # The transpose of a rotation by angle is the rotation by -angle.
        y1, y2 = rotate_halves(g1, g2, cos_ptr, sin_ptr, b, s, d, half, cos_stride_b, -1.0, ~is_v)
        tl.store(out_ptrs, y1.to(dqkv_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptrs + half, y2.to(dqkv_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptrs, g1.to(dqkv_ptr.dtype.element_ty), mask=mask)
