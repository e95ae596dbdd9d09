"""The permutations of a dropless mixture of experts: `dispatch` copies each token to its k rows
of the sparse layout (sparse_map.py), `combine` sums each token's rows back, scaled by its
routing weights (Fast-LLM's sparse_copy).

In `dispatch`'s output the padding rows (and the rows past the last expert's range) are zero,
so a projection without bias keeps them zero and they add nothing to a weight gradient; rows
past the last expert's range of a grouped matmul's output are never read back and may hold
anything. On the GPU each permutation is one kernel, which writes every row of its output,
so nothing is zero-filled first. Each op's backward pass is the other's kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastllm_kernels._dispatch import use_triton
from fastllm_kernels.moe.sparse_map import SparseMap


def dispatch(x: Tensor, sparse: SparseMap) -> Tensor:
    """(tokens, hidden) → (num_rows, hidden): each token copied to its k sparse rows, every
    other row zero; differentiable in x."""
    if use_triton(x, sparse.rows):
        return _DispatchFunction.apply(x, sparse.rows, sparse.entries)
    return dispatch_reference(x, sparse)


def combine(y: Tensor, sparse: SparseMap, weights: Tensor) -> Tensor:
    """(num_rows, hidden) → (tokens, hidden): each token's k sparse rows of y summed, scaled
    by its (tokens, k) routing `weights`; differentiable in y and weights."""
    if use_triton(y, sparse.rows, weights):
        return _CombineFunction.apply(y, sparse.rows, sparse.entries, weights)
    return combine_reference(y, sparse, weights)


def dispatch_reference(x: Tensor, sparse: SparseMap) -> Tensor:
    k = sparse.rows.shape[1]
    out = x.new_zeros(sparse.num_rows, x.shape[1])
    return out.index_copy(0, sparse.rows.reshape(-1), x.repeat_interleave(k, dim=0))


def combine_reference(y: Tensor, sparse: SparseMap, weights: Tensor) -> Tensor:
    picked = y[sparse.rows].float()  # (tokens, k, hidden)
    return (picked * weights.float().unsqueeze(-1)).sum(dim=1).to(y.dtype)


def _gather_settings(hidden: int, k: int) -> tuple[int, int]:
    """(K_BLOCK, BLOCK): a (k, columns) tile of at most 8192 elements (on the H200, 8 × 1024
    bf16 at 4 warps gathered at about the speed of a copy, twice as fast as 8 × 512)."""
    k_block = triton.next_power_of_2(k)
    return k_block, min(triton.next_power_of_2(hidden), max(16, 8192 // k_block))


def _row_settings(hidden: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_H): a (rows, columns) tile of 4096 elements at most, 16 × 256 where the
    rows are long enough (on the H200 faster than 4 × 1024 or 8 × 512)."""
    block_h = min(triton.next_power_of_2(hidden), 256)
    return max(1, 4096 // block_h), block_h


def _rows_from_tokens(
    x: Tensor,
    entries: Tensor,
    k: int,
    weights: Tensor | None = None,
    dot_with: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """out[r] = x[entries[r] // k] (× weights.flat[entries[r]]), zero where entries[r] < 0;
    with `dot_with` (and weights), also ⟨x[t], dot_with[rows[t, j]]⟩ per entry t × k + j,
    summed in fp32, in the weights' dtype."""
    tokens, hidden = x.shape
    num_rows = entries.shape[0]
    out = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device)
    dots = None
    if dot_with is not None:
        assert weights is not None
        dots = torch.empty(tokens, k, dtype=weights.dtype, device=x.device)
    block_r, block_h = _row_settings(hidden)
    # Each program one tile (more in flight for these memory-bound copies), or, to sum its
    # rows' dot products, the whole of its rows.
    column_blocks = 1 if dot_with is not None else triton.cdiv(hidden, block_h)
    _rows_kernel[(triton.cdiv(num_rows, block_r), column_blocks)](
        x, entries, weights if weights is not None else x, out,
        dot_with if dot_with is not None else x, dots if dots is not None else x,
        num_rows, hidden, K=k, BLOCK_R=block_r, BLOCK_H=block_h,
        SCALE=weights is not None, DOT=dot_with is not None,
    )  # fmt: skip
    return out, dots


def _gather(y: Tensor, rows: Tensor, weights: Tensor | None = None) -> Tensor:
    """out[t] = Σ_j y[rows[t, j]] (× weights[t, j]), summed in fp32."""
    tokens, k = rows.shape
    hidden = y.shape[1]
    out = torch.empty(tokens, hidden, dtype=y.dtype, device=y.device)
    k_block, block = _gather_settings(hidden, k)
    _gather_kernel[(tokens, triton.cdiv(hidden, block))](
        y,
        rows,
        weights if weights is not None else y,
        out,
        hidden,
        K=k,
        K_BLOCK=k_block,
        BLOCK=block,
        SCALE=weights is not None,
    )
    return out


class _DispatchFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows, entries):
        ctx.save_for_backward(rows)
        return _rows_from_tokens(x.contiguous(), entries, rows.shape[1])[0]

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        return _gather(grad.contiguous(), rows), None, None


class _CombineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, rows, entries, weights):
        y, rows, weights = y.contiguous(), rows.contiguous(), weights.contiguous()
        ctx.save_for_backward(y, rows, entries, weights)
        return _gather(y, rows, weights)

    @staticmethod
    def backward(ctx, grad):
        y, rows, entries, weights = ctx.saved_tensors
        need_weights = ctx.needs_input_grad[3]
        grad_y, dots = _rows_from_tokens(
            grad.contiguous(), entries, rows.shape[1], weights, y if need_weights else None
        )
        return grad_y, None, None, dots


@triton.jit
def _rows_kernel(
    x_ptr, entries_ptr, weights_ptr, out_ptr, dot_ptr, dots_ptr, num_rows, hidden,
    K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, SCALE: tl.constexpr,
    DOT: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    inside = rows < num_rows
    entries = tl.load(entries_ptr + rows, mask=inside, other=-1).to(tl.int64)
    used = entries >= 0
    tokens = tl.where(used, entries // K, 0)
    if SCALE:
        weights = tl.load(weights_ptr + entries, mask=used, other=0.0).to(tl.float32)
    dots = tl.zeros([BLOCK_R], dtype=tl.float32)
    for start in range(tl.program_id(1) * BLOCK_H, hidden, tl.num_programs(1) * BLOCK_H):
        columns = start + tl.arange(0, BLOCK_H)
        column_mask = columns < hidden
        mask = used[:, None] & column_mask[None, :]
        x = tl.load(x_ptr + tokens[:, None] * hidden + columns[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        offsets = rows[:, None] * hidden + columns[None, :]
        if DOT:
            other = tl.load(dot_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            dots += tl.sum(x * other, axis=1)
        if SCALE:
            x = x * weights[:, None]
        tl.store(
            out_ptr + offsets,
            x.to(out_ptr.dtype.element_ty),
            mask=inside[:, None] & column_mask[None, :],
        )
    if DOT:
        tl.store(dots_ptr + entries, dots.to(dots_ptr.dtype.element_ty), mask=used)


@triton.jit
def _gather_kernel(
    y_ptr,
    rows_ptr,
    weights_ptr,
    out_ptr,
    hidden,
    K: tl.constexpr,
    K_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    SCALE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, K_BLOCK)
    slot_mask = slots < K
    rows = tl.load(rows_ptr + token * K + slots, mask=slot_mask, other=0).to(tl.int64)
    if SCALE:
        weights = tl.load(weights_ptr + token * K + slots, mask=slot_mask, other=0.0)
        weights = weights.to(tl.float32)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    column_mask = columns < hidden
    offsets = rows[:, None] * hidden + columns[None, :]
    mask = slot_mask[:, None] & column_mask[None, :]
    tile = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if SCALE:
        tile = tile * weights[:, None]
    out = tl.sum(tile, axis=0)
    tl.store(out_ptr + token * hidden + columns, out.to(out_ptr.dtype.element_ty), mask=column_mask)
