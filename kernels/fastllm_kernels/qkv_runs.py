"""The fused q/k/v projection split, q and k rotated, straight into the runs of shared-prefix
attention's dense form (branch_attention.py): what `split_qkv_rotary` and the dense form's
gathers of q, k and v do, in one pass.

The forward takes one slot at a time: it reads the flat position the slot holds (a prefix
position in each run that gathers it, a run's last position again in its padding) and writes
q, k and v there. The backward takes one position at a time: the gradient of its q from its
own slot, those of its k and v from its own slot and its prefix copies', rotated back into
dqkv, with no atomics. The queries of a prefix copy get no gradient from their slots: their
outputs are unused, so the attention's backward gives them exact zeros.

Apart, the split and the gathers took 9.9 ms of a 246 ms DPO step of llama-1b: each of q, k
and v written, read and written again forward, their gradients likewise backward. Here they
take 6.2 ms of a 240 ms step (H100, bench/results/h100-61c7e74)."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastllm_kernels._dispatch import use_triton
from fastllm_kernels.branch_attention import DenseRuns, gather_runs
from fastllm_kernels.qkv_tiles import (
    check_qkv_shapes,
    load_halves,
    part_pointers,
    qkv_lanes,
    qkv_launch,
    qkv_tile,
    rotate_halves,
    split_rows,
)
from fastllm_kernels.rotary import split_qkv_rotary_reference


def split_qkv_rotary_into_runs(
    qkv: Tensor,
    heads: int,
    kv_heads: int,
    cos: Tensor | None,
    sin: Tensor | None,
    runs: DenseRuns,
) -> tuple[Tensor, Tensor, Tensor]:
    """qkv (batch, seq, (heads + 2 * kv_heads) * head_dim), of any strides → q (runs, length,
    heads, head_dim), k and v (runs, length, kv_heads, head_dim): `split_qkv_rotary`'s
    outputs, each position in its slots of `runs` (a plan of these batch × seq positions).
    Gradients flow to qkv only."""
    head_dim = check_qkv_shapes(qkv, heads, kv_heads, cos, sin)
    if use_triton(qkv, cos, sin):
        return _SplitIntoRunsFunction.apply(qkv, heads, kv_heads, head_dim, cos, sin, runs)
    return split_qkv_rotary_into_runs_reference(qkv, heads, kv_heads, cos, sin, runs)


def split_qkv_rotary_into_runs_reference(
    qkv: Tensor,
    heads: int,
    kv_heads: int,
    cos: Tensor | None,
    sin: Tensor | None,
    runs: DenseRuns,
) -> tuple[Tensor, Tensor, Tensor]:
    """The split, then the dense form's gathers (branch_attention.py)."""
    q, k, v = split_qkv_rotary_reference(qkv, heads, kv_heads, cos, sin)
    return gather_runs(q, k, v, runs)


class _SplitIntoRunsFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        qkv: Tensor,
        heads: int,
        kv_heads: int,
        head_dim: int,
        cos: Tensor | None,
        sin: Tensor | None,
        runs: DenseRuns,
    ) -> tuple[Tensor, Tensor, Tensor]:
        slots = runs.runs * runs.length
        options = {"dtype": qkv.dtype, "device": qkv.device}
        q = torch.empty((runs.runs, runs.length, heads, head_dim), **options)
        k = torch.empty((runs.runs, runs.length, kv_heads, head_dim), **options)
        v = torch.empty((runs.runs, runs.length, kv_heads, head_dim), **options)
        grid, args, constants = qkv_launch(qkv, heads, kv_heads, head_dim, cos, sin)
        _split_into_runs_kernel[(slots, grid[1])](
            qkv, q, k, v, runs.slots.index, *args, *qkv.stride(), **constants
        )
        ctx.save_for_backward(cos, sin)
        ctx.heads, ctx.kv_heads, ctx.head_dim, ctx.runs = heads, kv_heads, head_dim, runs
        ctx.shape = qkv.shape
        ctx.set_materialize_grads(False)  # an unused output's gradient is read as zeros
        return q, k, v

    @staticmethod
    def backward(ctx: Any, dq: Tensor | None, dk: Tensor | None, dv: Tensor | None):
        cos, sin = ctx.saved_tensors
        runs: DenseRuns = ctx.runs
        grads = (dq, dk, dv)
        some = next(g for g in grads if g is not None)
        dqkv = torch.empty(ctx.shape, dtype=some.dtype, device=some.device)
        grid, args, constants = qkv_launch(dqkv, ctx.heads, ctx.kv_heads, ctx.head_dim, cos, sin)
        pointers = [dqkv if g is None else g for g in grads]  # never read where absent
        strides = [s for g in grads for s in ((0,) * 4 if g is None else g.stride())]
        rounds = len(runs.slots.copies)
        copies = runs.copy_slots if rounds else runs.slots.own  # a pointer never read
        _split_into_runs_backward_kernel[grid](
            *pointers, dqkv, runs.slots.own, copies, rounds, runs.length,
            *args, *strides,
            HAS_DQ=dq is not None, HAS_DK=dk is not None, HAS_DV=dv is not None, **constants,
        )  # fmt: skip
        return dqkv, None, None, None, None, None, None


@triton.jit
def _split_into_runs_kernel(
    qkv_ptr, q_ptr, k_ptr, v_ptr, index_ptr, cos_ptr, sin_ptr, seq, heads, kv_heads, head_dim,
    half, cos_stride_b, qkv_stride_b, qkv_stride_s, qkv_stride_c,
    ROTATE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(0).to(tl.int64)
    position = tl.load(index_ptr + slot)
    b = position // seq
    s = position % seq
    h, d, mask, is_q, is_k, is_v = qkv_lanes(heads, kv_heads, half, BLOCK_H, BLOCK_D)
    x_ptrs = qkv_ptr + b * qkv_stride_b + s * qkv_stride_s + (h * head_dim + d) * qkv_stride_c
    split_rows(
        x_ptrs, q_ptr, k_ptr, v_ptr, slot, cos_ptr, sin_ptr, b, s, h, d, heads, kv_heads,
        head_dim, half, cos_stride_b, qkv_stride_c, mask, is_q, is_k, is_v, ROTATE,
    )  # fmt: skip


@triton.jit
def _slot_pointers(
    dq_ptr, dk_ptr, dv_ptr, slot, length, h, d, heads, kv_heads, is_q, is_k, is_v,
    dq_stride_r, dq_stride_i, dq_stride_h, dq_stride_d,
    dk_stride_r, dk_stride_i, dk_stride_h, dk_stride_d,
    dv_stride_r, dv_stride_i, dv_stride_h, dv_stride_d,
):  # fmt: skip
    """Pointers to the gradients' lanes at `slot`: run slot // length, place slot % length."""
    return part_pointers(
        dq_ptr, dk_ptr, dv_ptr, slot // length, slot % length, h, d, heads, kv_heads,
        is_q, is_k, is_v,
        dq_stride_r, dq_stride_i, dq_stride_h, dq_stride_d,
        dk_stride_r, dk_stride_i, dk_stride_h, dk_stride_d,
        dv_stride_r, dv_stride_i, dv_stride_h, dv_stride_d,
    )  # fmt: skip


@triton.jit
def _split_into_runs_backward_kernel(
    dq_ptr, dk_ptr, dv_ptr, dqkv_ptr, own_ptr, copies_ptr, rounds, length,
    cos_ptr, sin_ptr, seq, heads, kv_heads, head_dim, half, cos_stride_b,
    dq_stride_r, dq_stride_i, dq_stride_h, dq_stride_d,
    dk_stride_r, dk_stride_i, dk_stride_h, dk_stride_d,
    dv_stride_r, dv_stride_i, dv_stride_h, dv_stride_d,
    HAS_DQ: tl.constexpr, HAS_DK: tl.constexpr, HAS_DV: tl.constexpr,
    ROTATE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    position, b, s, h, d, mask, is_q, is_k, is_v = qkv_tile(
        seq, heads, kv_heads, half, BLOCK_H, BLOCK_D
    )
    positions = tl.num_programs(0).to(tl.int64)
    own = tl.load(own_ptr + position)
    dq_ptrs, dk_ptrs, dv_ptrs = _slot_pointers(
        dq_ptr, dk_ptr, dv_ptr, own, length, h, d, heads, kv_heads, is_q, is_k, is_v,
        dq_stride_r, dq_stride_i, dq_stride_h, dq_stride_d,
        dk_stride_r, dk_stride_i, dk_stride_h, dk_stride_d,
        dv_stride_r, dv_stride_i, dv_stride_h, dv_stride_d,
    )  # fmt: skip
    g1, g2 = load_halves(
        dq_ptrs, dk_ptrs, dv_ptrs, dq_stride_d, dk_stride_d, dv_stride_d, half,
        mask, is_q, is_k, is_v, HAS_DQ, HAS_DK, HAS_DV, ROTATE,
    )  # fmt: skip
    # The keys' and values' prefix copies, a round each (-1: none that round); not the
    # queries' (zero).
    for copy_round in range(rounds):
        copy = tl.load(copies_ptr + copy_round * positions + position)
        # (h * 0 +: a block, since Triton's interpreter takes no mask of a scalar and a block)
        taken = mask & ~is_q & (h * 0 + copy >= 0)
        dq_ptrs, dk_ptrs, dv_ptrs = _slot_pointers(
            dq_ptr, dk_ptr, dv_ptr, tl.maximum(copy, 0), length, h, d, heads, kv_heads,
            is_q, is_k, is_v,
            dq_stride_r, dq_stride_i, dq_stride_h, dq_stride_d,
            dk_stride_r, dk_stride_i, dk_stride_h, dk_stride_d,
            dv_stride_r, dv_stride_i, dv_stride_h, dv_stride_d,
        )  # fmt: skip
        c1, c2 = load_halves(
            dq_ptrs, dk_ptrs, dv_ptrs, dq_stride_d, dk_stride_d, dv_stride_d, half,
            taken, is_q, is_k, is_v, False, HAS_DK, HAS_DV, ROTATE,
        )  # fmt: skip
        g1 += c1
        g2 += c2
    out_ptrs = dqkv_ptr + position * (heads + 2 * kv_heads) * head_dim + h * head_dim + d
    if ROTATE:
        # The transpose of a rotation by angle is the rotation by -angle.
        y1, y2 = rotate_halves(g1, g2, cos_ptr, sin_ptr, b, s, d, half, cos_stride_b, -1.0, ~is_v)
        tl.store(out_ptrs, y1.to(dqkv_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptrs + half, y2.to(dqkv_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptrs, g1.to(dqkv_ptr.dtype.element_ty), mask=mask)
