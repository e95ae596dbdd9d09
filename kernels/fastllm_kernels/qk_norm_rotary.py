"""QK-norm and rotary in one pass: the fused qkv projection split into q, k and v, each query
and key head RMS-normalized over its head_dim with a weight shared by the heads (Qwen3's and
Gemma 3's per-head QK-norm), then rotated as rotary.py does, in fp32.

Without the fusion, q and k are each read and written three times (split, norm, rotary) and
the backward pass runs three kernels more; here the forward pass reads qkv once and writes q, k
and v once, and the backward pass reads qkv and dq, dk, dv once and writes dqkv once. The
backward pass recomputes each head's 1/rms from qkv (one sum of squares) instead of storing it.
The weights' gradients sum over every token and head: each program writes its partial sums and
torch adds them up (an fp32 (programs, head_dim) buffer for q and one for k).

A part without a weight (e.g. keys without a norm) is only rotated; cos = sin = None for no
rotation. Norm weights of another form (Gemma's 1 + w) are passed as the weight they act as.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastllm_kernels._dispatch import use_triton
from fastllm_kernels.norm import rms_norm_reference
from fastllm_kernels.qkv_tiles import (
    check_qkv_shapes,
    load_halves,
    part_pointers,
    qkv_launch,
    qkv_tile,
    rotate_halves,
    store_split,
)
from fastllm_kernels.rotary import apply_rotary_reference, split_qkv_rotary_reference


def split_qkv_norm_rotary(
    qkv: Tensor,
    heads: int,
    kv_heads: int,
    cos: Tensor | None,
    sin: Tensor | None,
    query_weight: Tensor | None,
    key_weight: Tensor | None,
    epsilon: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """q (batch, seq, heads, head_dim), k, v (batch, seq, kv_heads, head_dim) from qkv (batch,
    seq, (heads + 2 * kv_heads) * head_dim), of any strides: q through RMSNorm with
    `query_weight` (head_dim,), k with `key_weight`, then both rotated by cos/sin as
    `split_qkv_rotary` does. Differentiable in qkv and both weights."""
    head_dim = check_qkv_shapes(qkv, heads, kv_heads, cos, sin)
    if cos is not None and head_dim % 2:
        raise ValueError(f"rotary needs an even head_dim, got {head_dim}")
    for name, weight in (("query_weight", query_weight), ("key_weight", key_weight)):
        if weight is not None and weight.shape != (head_dim,):
            raise ValueError(f"{name} must be ({head_dim},), got {tuple(weight.shape)}")
    if use_triton(qkv, cos, sin, query_weight, key_weight):
        return _SplitQKVNormRotaryFunction.apply(
            qkv, heads, kv_heads, head_dim, cos, sin, query_weight, key_weight, epsilon
        )
    return split_qkv_norm_rotary_reference(
        qkv, heads, kv_heads, cos, sin, query_weight, key_weight, epsilon
    )


def split_qkv_norm_rotary_reference(
    qkv: Tensor,
    heads: int,
    kv_heads: int,
    cos: Tensor | None,
    sin: Tensor | None,
    query_weight: Tensor | None,
    key_weight: Tensor | None,
    epsilon: float,
) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = split_qkv_rotary_reference(qkv, heads, kv_heads, None, None)
    if query_weight is not None:
        q = rms_norm_reference(q, query_weight, epsilon)
    if key_weight is not None:
        k = rms_norm_reference(k, key_weight, epsilon)
    if cos is not None and sin is not None:
        q, k = apply_rotary_reference(q, cos, sin), apply_rotary_reference(k, cos, sin)
    return q, k, v


class _SplitQKVNormRotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, heads, kv_heads, head_dim, cos, sin, query_weight, key_weight, epsilon):
        batch, seq, _ = qkv.shape
        q = torch.empty((batch, seq, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        k = torch.empty((batch, seq, kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        v = torch.empty((batch, seq, kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        grid, args, constants = _launch(qkv, heads, kv_heads, head_dim, cos, sin, query_weight,
                                        key_weight, epsilon)  # fmt: skip
        _norm_rotary_kernel[grid](qkv, q, k, v, *args, *qkv.stride(), **constants)
        ctx.save_for_backward(qkv, cos, sin, query_weight, key_weight)
        ctx.shape, ctx.epsilon = (heads, kv_heads, head_dim), epsilon
        ctx.set_materialize_grads(False)
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        qkv, cos, sin, query_weight, key_weight = ctx.saved_tensors
        heads, kv_heads, head_dim = ctx.shape
        grads = (dq, dk, dv)
        dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
        grid, args, constants = _launch(qkv, heads, kv_heads, head_dim, cos, sin, query_weight,
                                        key_weight, ctx.epsilon)  # fmt: skip
        programs = grid[0] * grid[1]
        partial = torch.empty((2, programs, head_dim), dtype=torch.float32, device=qkv.device)
        pointers = [dqkv if g is None else g for g in grads]
        strides = [s for g in grads for s in ((0,) * 4 if g is None else g.stride())]
        _norm_rotary_backward_kernel[grid](
            qkv, *pointers, dqkv, partial, *args, *qkv.stride(), *strides,
            HAS_DQ=dq is not None, HAS_DK=dk is not None, HAS_DV=dv is not None, **constants,
        )  # fmt: skip
        d_query = None if query_weight is None else partial[0].sum(0).to(query_weight.dtype)
        d_key = None if key_weight is None else partial[1].sum(0).to(key_weight.dtype)
        return dqkv, None, None, None, None, None, d_query, d_key, None


def _launch(qkv, heads, kv_heads, head_dim, cos, sin, query_weight, key_weight, epsilon):
    """`qkv_launch`'s grid, arguments and constants, then the norms': qkv stands in for an
    absent weight. A program holds a block of heads of one token whole, both halves (for the
    rms) at once: half the rotary kernels' columns."""
    grid, args, constants = qkv_launch(qkv, heads, kv_heads, head_dim, cos, sin, 2048)
    query = qkv if query_weight is None else query_weight.contiguous()
    key = qkv if key_weight is None else key_weight.contiguous()
    norms = {"NORM_Q": query_weight is not None, "NORM_K": key_weight is not None}
    return grid, (*args, query, key, epsilon), {**constants, **norms}


@triton.jit
def _halves(ptrs, stride, half, mask, ROTATE: tl.constexpr):
    """A tile's two halves in fp32 (the second all zeros without rotation: one half is the head)."""
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if ROTATE:
        x2 = tl.load(ptrs + half * stride, mask=mask, other=0.0).to(tl.float32)
    else:
        x2 = tl.zeros_like(x1)
    return x1, x2


@triton.jit
def _weights(
    q_weight_ptr, k_weight_ptr, h, d, half, is_q, is_k,
    NORM_Q: tl.constexpr, NORM_K: tl.constexpr, ROTATE: tl.constexpr,
):  # fmt: skip
    """Each lane's norm weight (both halves) and whether its head is normalized."""
    w1 = tl.zeros(is_q.shape, dtype=tl.float32) + tl.zeros(d.shape, dtype=tl.float32)
    w2 = w1
    normed = h < 0
    if NORM_Q:
        wq1 = tl.load(q_weight_ptr + d, mask=d < half, other=0.0).to(tl.float32)
        w1 = tl.where(is_q, wq1, w1)
        if ROTATE:
            wq2 = tl.load(q_weight_ptr + half + d, mask=d < half, other=0.0).to(tl.float32)
            w2 = tl.where(is_q, wq2, w2)
        normed = normed | is_q
    if NORM_K:
        wk1 = tl.load(k_weight_ptr + d, mask=d < half, other=0.0).to(tl.float32)
        w1 = tl.where(is_k, wk1, w1)
        if ROTATE:
            wk2 = tl.load(k_weight_ptr + half + d, mask=d < half, other=0.0).to(tl.float32)
            w2 = tl.where(is_k, wk2, w2)
        normed = normed | is_k
    return w1, w2, normed


@triton.jit
def _norm_rotary_kernel(
    qkv_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr,
    seq, heads, kv_heads, head_dim, half, cos_stride_b, q_weight_ptr, k_weight_ptr, epsilon,
    qkv_stride_b, qkv_stride_s, qkv_stride_c,
    ROTATE: tl.constexpr, NORM_Q: tl.constexpr, NORM_K: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    token, b, s, h, d, mask, is_q, is_k, is_v = qkv_tile(
        seq, heads, kv_heads, half, BLOCK_H, BLOCK_D
    )
    x_ptrs = qkv_ptr + b * qkv_stride_b + s * qkv_stride_s + (h * head_dim + d) * qkv_stride_c
    x1, x2 = _halves(x_ptrs, qkv_stride_c, half, mask, ROTATE)
    w1, w2, normed = _weights(q_weight_ptr, k_weight_ptr, h, d, half, is_q, is_k, NORM_Q,
                              NORM_K, ROTATE)  # fmt: skip
    squares = tl.sum(x1 * x1 + x2 * x2, axis=1)[:, None]
    rstd = tl.rsqrt(squares / head_dim + epsilon)
    x1 = tl.where(normed, x1 * rstd * w1, x1)
    x2 = tl.where(normed, x2 * rstd * w2, x2)
    q_ptrs = q_ptr + (token * heads + tl.where(is_q, h, 0)) * head_dim + d
    k_ptrs = k_ptr + (token * kv_heads + tl.where(is_k, h - heads, 0)) * head_dim + d
    v_ptrs = v_ptr + (token * kv_heads + tl.where(is_v, h - heads - kv_heads, 0)) * head_dim + d
    if ROTATE:
        y1, y2 = rotate_halves(x1, x2, cos_ptr, sin_ptr, b, s, d, half, cos_stride_b, 1.0, ~is_v)
        store_split(q_ptrs, k_ptrs, v_ptrs, y1, mask, is_q, is_k, is_v)
        store_split(q_ptrs + half, k_ptrs + half, v_ptrs + half, y2, mask, is_q, is_k, is_v)
    else:
        store_split(q_ptrs, k_ptrs, v_ptrs, x1, mask, is_q, is_k, is_v)


@triton.jit
def _norm_rotary_backward_kernel(
    qkv_ptr, dq_ptr, dk_ptr, dv_ptr, dqkv_ptr, partial_ptr,
    cos_ptr, sin_ptr,
    seq, heads, kv_heads, head_dim, half, cos_stride_b, q_weight_ptr, k_weight_ptr, epsilon,
    qkv_stride_b, qkv_stride_s, qkv_stride_c,
    dq_stride_b, dq_stride_s, dq_stride_h, dq_stride_d,
    dk_stride_b, dk_stride_s, dk_stride_h, dk_stride_d,
    dv_stride_b, dv_stride_s, dv_stride_h, dv_stride_d,
    HAS_DQ: tl.constexpr, HAS_DK: tl.constexpr, HAS_DV: tl.constexpr,
    ROTATE: tl.constexpr, NORM_Q: tl.constexpr, NORM_K: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    token, b, s, h, d, mask, is_q, is_k, is_v = qkv_tile(
        seq, heads, kv_heads, half, BLOCK_H, BLOCK_D
    )
    dq_ptrs, dk_ptrs, dv_ptrs = part_pointers(
        dq_ptr, dk_ptr, dv_ptr, b, s, h, d, heads, kv_heads, is_q, is_k, is_v,
        dq_stride_b, dq_stride_s, dq_stride_h, dq_stride_d,
        dk_stride_b, dk_stride_s, dk_stride_h, dk_stride_d,
        dv_stride_b, dv_stride_s, dv_stride_h, dv_stride_d,
    )  # fmt: skip
    g1, g2 = load_halves(
        dq_ptrs, dk_ptrs, dv_ptrs, dq_stride_d, dk_stride_d, dv_stride_d, half,
        mask, is_q, is_k, is_v, HAS_DQ, HAS_DK, HAS_DV, ROTATE,
    )  # fmt: skip
    if ROTATE:
        # The transpose of a rotation by angle is the rotation by -angle.
        g1, g2 = rotate_halves(g1, g2, cos_ptr, sin_ptr, b, s, d, half, cos_stride_b, -1.0, ~is_v)
    # The norm's backward pass: x̂ = x / rms, y = x̂ w, dx = (g w - x̂ mean(g w x̂)) / rms.
    x_ptrs = qkv_ptr + b * qkv_stride_b + s * qkv_stride_s + (h * head_dim + d) * qkv_stride_c
    x1, x2 = _halves(x_ptrs, qkv_stride_c, half, mask, ROTATE)
    w1, w2, normed = _weights(q_weight_ptr, k_weight_ptr, h, d, half, is_q, is_k, NORM_Q,
                              NORM_K, ROTATE)  # fmt: skip
    rstd = tl.rsqrt(tl.sum(x1 * x1 + x2 * x2, axis=1)[:, None] / head_dim + epsilon)
    xhat1, xhat2 = x1 * rstd, x2 * rstd
    gw1, gw2 = g1 * w1, g2 * w2
    mean = tl.sum(gw1 * xhat1 + gw2 * xhat2, axis=1)[:, None] / head_dim
    dx1 = tl.where(normed, (gw1 - xhat1 * mean) * rstd, g1)
    dx2 = tl.where(normed, (gw2 - xhat2 * mean) * rstd, g2)
    out_ptrs = dqkv_ptr + token * (heads + 2 * kv_heads) * head_dim + h * head_dim + d
    tl.store(out_ptrs, dx1.to(dqkv_ptr.dtype.element_ty), mask=mask)
    if ROTATE:
        tl.store(out_ptrs + half, dx2.to(dqkv_ptr.dtype.element_ty), mask=mask)
    # This program's share of each weight's gradient: Σ over its heads of g x̂.
    program = tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
    programs = tl.num_programs(0).to(tl.int64) * tl.num_programs(1)
    _store_share(partial_ptr + program * head_dim, g1, g2, xhat1, xhat2, is_q & mask, half,
                 BLOCK_D, ROTATE)  # fmt: skip
    _store_share(partial_ptr + (programs + program) * head_dim, g1, g2, xhat1, xhat2,
                 is_k & mask, half, BLOCK_D, ROTATE)  # fmt: skip


@triton.jit
def _store_share(row_ptr, g1, g2, xhat1, xhat2, lanes, half, BLOCK_D: tl.constexpr,
                 ROTATE: tl.constexpr):  # fmt: skip
    """Σ over the heads of `lanes` of g x̂, one head_dim row."""
    columns = tl.arange(0, BLOCK_D)
    tl.store(
        row_ptr + columns, tl.sum(tl.where(lanes, g1 * xhat1, 0.0), axis=0), mask=columns < half
    )
    if ROTATE:
        share = tl.sum(tl.where(lanes, g2 * xhat2, 0.0), axis=0)
        tl.store(row_ptr + half + columns, share, mask=columns < half)
