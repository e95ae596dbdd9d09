"""Dropless mixture of experts: the sparse map of a router's choices, the permutation of tokens
into expert order and back, and the grouped matmul of the experts' projections.

Each (token, slot) pair the router chose gets one row of a sparse layout in which every
expert's rows are contiguous, its range padded to a multiple of `block`. The layout has a
static worst case of tokens × k + experts × block rows, so no shape waits for the host
(MegaBlocks, Fast-LLM's sparse_copy). In `dispatch`'s output the padding rows are zero, so a
projection without bias keeps them zero and they add nothing to a weight gradient; rows past
the last expert's range are never read back and may hold anything.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastllm_kernels._dispatch import use_triton

GROUP_ALIGNMENT = 16
"""Default padding of each expert's rows: keeps every group of torch._grouped_mm 16-row
aligned (torchtitan aligns bf16 groups to 8 or 16) at a cost of at most 15 rows per expert."""


class SparseMap(NamedTuple):
    rows: Tensor
    """(tokens, k) int64: the sparse row of each token's k choices."""
    ends: Tensor
    """(experts,) int32: the end of each expert's padded row range (cumulative)."""
    counts: Tensor
    """(experts,) int64: tokens routed to each expert (its rows before padding)."""
    num_rows: int
    """Rows of the sparse layout: tokens × k + experts × block, whatever the routing."""


def sparse_map(experts: Tensor, num_experts: int, block: int = GROUP_ALIGNMENT) -> SparseMap:
    """The sparse layout of `experts` (tokens, k), each token's chosen experts. Within an
    expert, rows follow token order (and slot order within a token)."""
    tokens, k = experts.shape
    flat = experts.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync on its max
    padded = (counts + block - 1) // block * block
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    sorted_experts = flat[order]
    rank = (
        torch.arange(flat.numel(), device=flat.device) - (counts.cumsum(0) - counts)[sorted_experts]
    )
    rows = torch.empty_like(flat)
    rows[order] = (ends - padded)[sorted_experts] + rank
    return SparseMap(
        rows.view(tokens, k), ends.to(torch.int32), counts, tokens * k + num_experts * block
    )


def dispatch(x: Tensor, rows: Tensor, num_rows: int) -> Tensor:
    """(tokens, hidden) → (num_rows, hidden): each token copied to its k sparse `rows`, every
    other row zero; differentiable in x."""
    if use_triton(x, rows):
        return _DispatchFunction.apply(x, rows, num_rows)
    return dispatch_reference(x, rows, num_rows)


def combine(y: Tensor, rows: Tensor, weights: Tensor) -> Tensor:
    """(num_rows, hidden) → (tokens, hidden): each token's k sparse `rows` of y summed, scaled
    by its (tokens, k) routing `weights`; differentiable in y and weights."""
    if use_triton(y, rows, weights):
        return _CombineFunction.apply(y, rows, weights)
    return combine_reference(y, rows, weights)


def dispatch_reference(x: Tensor, rows: Tensor, num_rows: int) -> Tensor:
    k = rows.shape[1]
    out = x.new_zeros(num_rows, x.shape[1])
    return out.index_copy(0, rows.reshape(-1), x.repeat_interleave(k, dim=0))


def combine_reference(y: Tensor, rows: Tensor, weights: Tensor) -> Tensor:
    picked = y[rows].float()  # (tokens, k, hidden)
    return (picked * weights.float().unsqueeze(-1)).sum(dim=1).to(y.dtype)


def grouped_linear(x: Tensor, weight: Tensor, ends: Tensor) -> Tensor:
    """x (rows, in) in expert order, weight (experts, out, in): the rows of expert e's range
    (ends[e - 1]:ends[e]) times weight[e]ᵀ; rows past ends[-1] are unspecified.
    Differentiable in x and weight: torch._grouped_mm (CUDA, bf16), else the reference."""
    if x.is_cuda and x.dtype == torch.bfloat16:
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=ends)
    return grouped_linear_reference(x, weight, ends)


def grouped_linear_reference(x: Tensor, weight: Tensor, ends: Tensor) -> Tensor:
    """One matmul per expert; its row ranges come to the host (a sync)."""
    pieces, start = [], 0
    for expert, end in enumerate(ends.tolist()):
        pieces.append(x[start:end] @ weight[expert].T)
        start = end
    pieces.append(x.new_zeros(x.shape[0] - start, weight.shape[1]))
    return torch.cat(pieces)


def _launch_settings(hidden: int, k: int) -> tuple[int, int]:
    """(K_BLOCK, BLOCK): a (k, columns) tile of at most 4096 elements."""
    k_block = triton.next_power_of_2(k)
    return k_block, min(triton.next_power_of_2(hidden), max(16, 4096 // k_block))


def _scatter(
    x: Tensor,
    rows: Tensor,
    num_rows: int,
    weights: Tensor | None = None,
    dot_with: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """out[rows[t, j]] = x[t] (× weights[t, j]), other rows zero; with `dot_with`, also
    ⟨x[t], dot_with[rows[t, j]]⟩ per (t, j), in fp32."""
    tokens, hidden = x.shape
    k = rows.shape[1]
    out = x.new_zeros(num_rows, hidden)
    dots = (
        torch.empty(tokens, k, dtype=torch.float32, device=x.device)
        if dot_with is not None
        else None
    )
    k_block, block = _launch_settings(hidden, k)
    _scatter_kernel[(tokens,)](
        x,
        rows,
        weights if weights is not None else x,
        out,
        dot_with if dot_with is not None else x,
        dots if dots is not None else x,
        hidden,
        K=k,
        K_BLOCK=k_block,
        BLOCK=block,
        SCALE=weights is not None,
        DOT=dot_with is not None,
    )
    return out, dots


def _gather(y: Tensor, rows: Tensor, weights: Tensor | None = None) -> Tensor:
    """out[t] = Σ_j y[rows[t, j]] (× weights[t, j]), summed in fp32."""
    tokens, k = rows.shape
    hidden = y.shape[1]
    out = torch.empty(tokens, hidden, dtype=y.dtype, device=y.device)
    k_block, block = _launch_settings(hidden, k)
    _gather_kernel[(tokens,)](
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
    def forward(ctx, x, rows, num_rows):
        ctx.save_for_backward(rows)
        return _scatter(x.contiguous(), rows.contiguous(), num_rows)[0]

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        return _gather(grad.contiguous(), rows), None, None


class _CombineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, rows, weights):
        y, rows, weights = y.contiguous(), rows.contiguous(), weights.contiguous()
        ctx.save_for_backward(y, rows, weights)
        return _gather(y, rows, weights)

    @staticmethod
    def backward(ctx, grad):
        y, rows, weights = ctx.saved_tensors
        need_weights = ctx.needs_input_grad[2]
        grad_y, dots = _scatter(
            grad.contiguous(), rows, y.shape[0], weights, y if need_weights else None
        )
        return grad_y, None, None if dots is None else dots.to(weights.dtype)


@triton.jit
def _scatter_kernel(
    x_ptr,
    rows_ptr,
    weights_ptr,
    out_ptr,
    dot_ptr,
    dots_ptr,
    hidden,
    K: tl.constexpr,
    K_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    SCALE: tl.constexpr,
    DOT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, K_BLOCK)
    slot_mask = slots < K
    rows = tl.load(rows_ptr + token * K + slots, mask=slot_mask, other=0).to(tl.int64)
    if SCALE:
        weights = tl.load(weights_ptr + token * K + slots, mask=slot_mask, other=0.0)
        weights = weights.to(tl.float32)
    dots = tl.zeros([K_BLOCK], dtype=tl.float32)
    for start in range(0, hidden, BLOCK):
        columns = start + tl.arange(0, BLOCK)
        column_mask = columns < hidden
        x = tl.load(x_ptr + token * hidden + columns, mask=column_mask, other=0.0).to(tl.float32)
        tile = tl.broadcast_to(x[None, :], (K_BLOCK, BLOCK))
        if SCALE:
            tile = tile * weights[:, None]
        offsets = rows[:, None] * hidden + columns[None, :]
        mask = slot_mask[:, None] & column_mask[None, :]
        if DOT:
            other = tl.load(dot_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            dots += tl.sum(x[None, :] * other, axis=1)
        tl.store(out_ptr + offsets, tile.to(out_ptr.dtype.element_ty), mask=mask)
    if DOT:
        tl.store(dots_ptr + token * K + slots, dots, mask=slot_mask)


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
    for start in range(0, hidden, BLOCK):
        columns = start + tl.arange(0, BLOCK)
        column_mask = columns < hidden
        offsets = rows[:, None] * hidden + columns[None, :]
        mask = slot_mask[:, None] & column_mask[None, :]
        tile = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if SCALE:
            tile = tile * weights[:, None]
        out = tl.sum(tile, axis=0)
        tl.store(
            out_ptr + token * hidden + columns, out.to(out_ptr.dtype.element_ty), mask=column_mask
        )
