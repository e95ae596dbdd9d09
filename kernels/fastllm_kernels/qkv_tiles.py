"""Shared pieces of the kernels over a fused qkv projection (rotary.py's split and
qk_norm_rotary.py's): the shape checks, and the @triton.jit helpers that give a program its token
and block of q, k and v heads, rotate a tile's two halves, and store or load each lane in its
part."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


def check_qkv_shapes(
    qkv: Tensor, heads: int, kv_heads: int, cos: Tensor | None, sin: Tensor | None
) -> int:
    """Checks the shapes and returns head_dim."""
    if qkv.dim() != 3 or qkv.shape[-1] % (heads + 2 * kv_heads):
        raise ValueError(
            f"qkv {tuple(qkv.shape)} is not (batch, seq, {heads + 2 * kv_heads} heads)"
        )
    batch, seq, width = qkv.shape
    head_dim = width // (heads + 2 * kv_heads)
    if (cos is None) != (sin is None):
        raise ValueError("cos and sin must both be given or both be None")
    if cos is not None and sin is not None:
        if head_dim % 2 or cos.shape != sin.shape:
            raise ValueError(f"bad rotary shapes: qkv {tuple(qkv.shape)}, cos {tuple(cos.shape)}")
        check_angles(batch, seq, head_dim, cos)
    return head_dim


def check_angles(batch: int, seq: int, head_dim: int, cos: Tensor) -> None:
    if cos.shape not in ((seq, head_dim // 2), (batch, seq, head_dim // 2)):
        raise ValueError(
            f"cos/sin must be ({seq}, {head_dim // 2}) or ({batch}, {seq}, {head_dim // 2})"
        )


def qkv_launch(
    x: Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    cos: Tensor | None,
    sin: Tensor | None,
    tile_elements: int = 4096,
) -> tuple[tuple[int, int], tuple, dict]:
    """Grid, shared arguments and constants of the qkv kernels (x: qkv or its gradient, which
    stands in for absent angles): a program takes a block of heads of one token, each as two
    halves that rotate together, at most `tile_elements` of a half's columns at once; without
    rotation a head is one "half" (head_dim may then be odd)."""
    rotate = cos is not None and sin is not None
    half = head_dim // 2 if rotate else head_dim
    block_d = triton.next_power_of_2(half)
    all_heads = heads + 2 * kv_heads
    block_h = min(triton.next_power_of_2(all_heads), max(1, tile_elements // block_d))
    grid = (x.shape[0] * x.shape[1], triton.cdiv(all_heads, block_h))
    if rotate:
        cos, sin = cos.contiguous(), sin.contiguous()
        cos_stride_b = cos.stride(0) if cos.dim() == 3 else 0
    else:
        cos, sin, cos_stride_b = x, x, 0
    args = (cos, sin, x.shape[1], heads, kv_heads, head_dim, half, cos_stride_b)
    constants = {"ROTATE": rotate, "BLOCK_H": block_h, "BLOCK_D": block_d, "num_warps": 4}
    return grid, args, constants


@triton.jit
def qkv_tile(seq, heads, kv_heads, half, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's token (b, s), heads h (of q, k, v in turn) and columns d within a half."""
    token = tl.program_id(0).to(tl.int64)
    h, d, mask, is_q, is_k, is_v = qkv_lanes(heads, kv_heads, half, BLOCK_H, BLOCK_D)
    return token, token // seq, token % seq, h, d, mask, is_q, is_k, is_v


@triton.jit
def qkv_lanes(heads, kv_heads, half, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's block of heads h (of q, k, v in turn), columns d within a half, and
    which lanes are in range and in which part."""
    h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads + 2 * kv_heads) & (d < half)
    is_q = h < heads
    is_v = h >= heads + kv_heads
    return h, d, mask, is_q, ~is_q & ~is_v, is_v


@triton.jit
def split_rows(
    qkv_ptrs, q_ptr, k_ptr, v_ptr, row, cos_ptr, sin_ptr, b, s, h, d, heads, kv_heads,
    head_dim, half, cos_stride_b, qkv_stride_c, mask, is_q, is_k, is_v, ROTATE: tl.constexpr,
):  # fmt: skip
    """The lanes of qkv at `qkv_ptrs` (token (b, s)), q and k rotated, into row `row` of the
    contiguous q, k and v (lanes of the other two parts point at head 0, masked off)."""
    q_ptrs = q_ptr + (row * heads + tl.where(is_q, h, 0)) * head_dim + d
    k_ptrs = k_ptr + (row * kv_heads + tl.where(is_k, h - heads, 0)) * head_dim + d
    v_ptrs = v_ptr + (row * kv_heads + tl.where(is_v, h - heads - kv_heads, 0)) * head_dim + d
    x1 = tl.load(qkv_ptrs, mask=mask)
    if ROTATE:
        x2 = tl.load(qkv_ptrs + half * qkv_stride_c, mask=mask)
        y1, y2 = rotate_halves(x1, x2, cos_ptr, sin_ptr, b, s, d, half, cos_stride_b, 1.0, ~is_v)
        store_split(q_ptrs, k_ptrs, v_ptrs, y1, mask, is_q, is_k, is_v)
        store_split(q_ptrs + half, k_ptrs + half, v_ptrs + half, y2, mask, is_q, is_k, is_v)
    else:
        store_split(q_ptrs, k_ptrs, v_ptrs, x1, mask, is_q, is_k, is_v)


@triton.jit
def rotate_halves(x1, x2, cos_ptr, sin_ptr, b, s, d, half, cos_stride_b, sign, rotate):
    """(x1, x2) rotated by sign * angle in fp32 where `rotate` (q and k), kept elsewhere (v)."""
    angle_offset = b * cos_stride_b + s * half + d
    cos = tl.load(cos_ptr + angle_offset, mask=d < half, other=0.0).to(tl.float32)
    sin = sign * tl.load(sin_ptr + angle_offset, mask=d < half, other=0.0).to(tl.float32)
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    return tl.where(rotate, x1 * cos - x2 * sin, x1), tl.where(rotate, x2 * cos + x1 * sin, x2)


@triton.jit
def store_split(q_ptrs, k_ptrs, v_ptrs, x, mask, is_q, is_k, is_v):
    x = x.to(q_ptrs.dtype.element_ty)
    tl.store(q_ptrs, x, mask=mask & is_q)
    tl.store(k_ptrs, x, mask=mask & is_k)
    tl.store(v_ptrs, x, mask=mask & is_v)


@triton.jit
def strided(ptr, b, s, h, d, stride_b, stride_s, stride_h, stride_d):
    return ptr + b * stride_b + s * stride_s + h * stride_h + d * stride_d


@triton.jit
def load_halves(
    dq_ptrs, dk_ptrs, dv_ptrs, dq_stride_d, dk_stride_d, dv_stride_d, half,
    mask, is_q, is_k, is_v,
    HAS_Q: tl.constexpr, HAS_K: tl.constexpr, HAS_V: tl.constexpr, ROTATE: tl.constexpr,
):  # fmt: skip
    """`load_split` of a head's two halves, in fp32 (without rotation a head is one "half":
    the second is zeros)."""
    g1 = load_split(dq_ptrs, dk_ptrs, dv_ptrs, mask, is_q, is_k, is_v, HAS_Q, HAS_K, HAS_V)
    g1 = g1.to(tl.float32)
    g2 = tl.zeros_like(g1)
    if ROTATE:
        g2 = load_split(
            dq_ptrs + half * dq_stride_d, dk_ptrs + half * dk_stride_d, dv_ptrs + half * dv_stride_d,
            mask, is_q, is_k, is_v, HAS_Q, HAS_K, HAS_V,
        ).to(tl.float32)  # fmt: skip
    return g1, g2


@triton.jit
def part_pointers(
    dq_ptr, dk_ptr, dv_ptr, b, s, h, d, heads, kv_heads, is_q, is_k, is_v,
    dq_stride_b, dq_stride_s, dq_stride_h, dq_stride_d,
    dk_stride_b, dk_stride_s, dk_stride_h, dk_stride_d,
    dv_stride_b, dv_stride_s, dv_stride_h, dv_stride_d,
):  # fmt: skip
    """Pointers to the lanes of (b, s) in q, k and v shaped tensors of any strides (the
    gradients); lanes of the other two parts point at head 0."""
    dq_ptrs = strided(
        dq_ptr, b, s, tl.where(is_q, h, 0), d, dq_stride_b, dq_stride_s, dq_stride_h, dq_stride_d
    )
    dk_h = tl.where(is_k, h - heads, 0)
    dk_ptrs = strided(dk_ptr, b, s, dk_h, d, dk_stride_b, dk_stride_s, dk_stride_h, dk_stride_d)
    dv_h = tl.where(is_v, h - heads - kv_heads, 0)
    dv_ptrs = strided(dv_ptr, b, s, dv_h, d, dv_stride_b, dv_stride_s, dv_stride_h, dv_stride_d)
    return dq_ptrs, dk_ptrs, dv_ptrs


@triton.jit
def load_split(
    q_ptrs, k_ptrs, v_ptrs, mask, is_q, is_k, is_v,
    HAS_Q: tl.constexpr, HAS_K: tl.constexpr, HAS_V: tl.constexpr,
):  # fmt: skip
    """The gradient of each lane's part; zeros for a part whose gradient is absent."""
    x = tl.zeros(mask.shape, dtype=q_ptrs.dtype.element_ty)
    if HAS_Q:
        x = tl.where(is_q, tl.load(q_ptrs, mask=mask & is_q, other=0.0), x)
    if HAS_K:
        x = tl.where(is_k, tl.load(k_ptrs, mask=mask & is_k, other=0.0), x)
    if HAS_V:
        x = tl.where(is_v, tl.load(v_ptrs, mask=mask & is_v, other=0.0), x)
    return x
