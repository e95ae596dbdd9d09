"""The sparse layout of a mixture's routing: each (token, slot) pair the router chose gets one
row, every expert's rows contiguous, its range padded to a multiple of `block`.

The layout has a static worst case of tokens × k + experts × block rows, so no shape waits for
the host (MegaBlocks, Fast-LLM's sparse_copy). On the GPU a map is two kernels: a histogram of
the choices per block of entries, then each entry's row from the counts of the blocks before
it (`sparse_rows`, which the router's kernels share, routing.py).
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

EXPERT_TILE = 4096
"""Elements of the (tokens or blocks, experts) tiles that the routing and sparse-map kernels
hold."""
MAP_TILE = 16384
"""Elements of the (entries, experts) tiles of the sparse map: large, since every program of
its second kernel reads all blocks' counts (at 4096, that read took 70 µs on 65,536 entries)."""


class SparseMap(NamedTuple):
    rows: Tensor
    """(tokens, k) int64: the sparse row of each token's k choices."""
    entries: Tensor
    """(num_rows,) int32: the inverse, the (token × k + slot) that each sparse row holds, -1 for
    padding rows and rows past the last expert's range."""
    ends: Tensor
    """(experts,) int32: the end of each expert's padded row range (cumulative)."""
    counts: Tensor
    """(experts,) int64: tokens routed to each expert (its rows before padding)."""
    num_rows: int
    """Rows of the sparse layout: tokens × k + experts × block, whatever the routing."""


def sparse_map(experts: Tensor, num_experts: int, block: int = GROUP_ALIGNMENT) -> SparseMap:
    """The sparse layout of `experts` (tokens, k), each token's chosen experts. Within an
    expert, rows follow token order (and slot order within a token)."""
    if use_triton(experts):
        return _sparse_map_triton(experts.contiguous(), num_experts, block)
    return sparse_map_reference(experts, num_experts, block)


def sparse_map_reference(experts: Tensor, num_experts: int, block: int) -> SparseMap:
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
    num_rows = tokens * k + num_experts * block
    entries = torch.full((num_rows,), -1, dtype=torch.int32, device=flat.device)
    entries[rows] = torch.arange(flat.numel(), dtype=torch.int32, device=flat.device)
    return SparseMap(rows.view(tokens, k), entries, ends.to(torch.int32), counts, num_rows)


def _sparse_map_triton(experts: Tensor, num_experts: int, block: int) -> SparseMap:
    entries_count = experts.numel()
    block_n = max(16, MAP_TILE // triton.next_power_of_2(num_experts))
    blocks = triton.cdiv(entries_count, block_n)
    block_counts = torch.empty(blocks, num_experts, dtype=torch.int32, device=experts.device)
    _histogram_kernel[(blocks,)](
        experts, block_counts, entries_count, E=num_experts,
        E_BLOCK=triton.next_power_of_2(num_experts), BLOCK_N=block_n, num_warps=8,
    )  # fmt: skip
    return sparse_rows(experts, block_counts, block_n, num_experts, block)


def sparse_rows(
    experts: Tensor,
    block_counts: Tensor,
    per_block: int,
    num_experts: int,
    block: int,
    auxiliary: tuple[Tensor, Tensor, Tensor, int, float, float] | None = None,
) -> SparseMap:
    """The sparse map from the experts' counts in each block of `per_block` entries; with
    `auxiliary` = (probability sums and z sums per block, the output, tokens, coefficients),
    also the router's auxiliary loss."""
    tokens, k = experts.shape
    entries_count = tokens * k
    num_rows = entries_count + num_experts * block
    blocks = block_counts.shape[0]
    device = experts.device
    rows = torch.empty(tokens, k, dtype=torch.int64, device=device)
    entries = torch.empty(num_rows, dtype=torch.int32, device=device)
    ends = torch.empty(num_experts, dtype=torch.int32, device=device)
    counts = torch.empty(num_experts, dtype=torch.int64, device=device)
    sums, z_sums, out, n, balance, z = auxiliary or (counts, counts, counts, 1, 0.0, 0.0)
    e_block = triton.next_power_of_2(num_experts)
    _sparse_rows_kernel[(blocks,)](
        experts, block_counts, rows, entries, ends, counts, sums, z_sums, out, n, balance, z,
        entries_count, blocks, num_rows, triton.cdiv(num_rows, blocks), E=num_experts,
        E_BLOCK=e_block, PER_BLOCK=per_block, BLOCK_N=triton.next_power_of_2(per_block),
        ALIGN=block, BLOCKS=max(1, EXPERT_TILE // e_block), AUXILIARY=auxiliary is not None,
        num_warps=8,
    )  # fmt: skip
    return SparseMap(rows, entries, ends, counts, num_rows)


@triton.jit
def _histogram_kernel(
    experts_ptr, block_counts_ptr, n, E: tl.constexpr, E_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr
):
    block = tl.program_id(0)
    entries = block * BLOCK_N + tl.arange(0, BLOCK_N)
    experts = tl.load(experts_ptr + entries, mask=entries < n, other=-1)
    columns = tl.arange(0, E_BLOCK)
    counts = tl.sum((experts[:, None] == columns[None, :]).to(tl.int32), axis=0)
    tl.store(block_counts_ptr + block * E + columns, counts, mask=columns < E)


@triton.jit
def _sparse_rows_kernel(
    experts_ptr, block_counts_ptr, rows_ptr, entries_ptr, ends_ptr, counts_ptr,
    probability_sums_ptr, z_sums_ptr, auxiliary_ptr, tokens, balance, z, n, blocks, num_rows,
    rows_per_block, E: tl.constexpr, E_BLOCK: tl.constexpr, PER_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr, ALIGN: tl.constexpr, BLOCKS: tl.constexpr, AUXILIARY: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    columns = tl.arange(0, E_BLOCK)
    expert_mask = columns < E
    before = tl.zeros([E_BLOCK], dtype=tl.int32)  # this expert's entries in earlier blocks
    counts = tl.zeros([E_BLOCK], dtype=tl.int32)
    for start in range(0, blocks, BLOCKS):
        others = start + tl.arange(0, BLOCKS)
        mask = (others < blocks)[:, None] & expert_mask[None, :]
        tile = tl.load(
            block_counts_ptr + others[:, None] * E + columns[None, :], mask=mask, other=0
        )
        counts += tl.sum(tile, axis=0)
        before += tl.sum(tl.where((others < block)[:, None], tile, 0), axis=0)
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    if block == 0:
        tl.store(ends_ptr + columns, ends, mask=expert_mask)
        tl.store(counts_ptr + columns, counts.to(tl.int64), mask=expert_mask)
        if AUXILIARY:  # the router's losses, from every block's sums
            sums = tl.zeros([E_BLOCK], dtype=tl.float32)
            z_total = tl.zeros([BLOCKS], dtype=tl.float32)
            for start in range(0, blocks, BLOCKS):
                others = start + tl.arange(0, BLOCKS)
                mask = (others < blocks)[:, None] & expert_mask[None, :]
                offsets = others[:, None] * E + columns[None, :]
                sums += tl.sum(tl.load(probability_sums_ptr + offsets, mask=mask, other=0.0), 0)
                z_total += tl.load(z_sums_ptr + others, mask=others < blocks, other=0.0)
            t = tokens.to(tl.float32)
            balance_loss = E * tl.sum(counts.to(tl.float32) * sums, axis=0) / (t * t)
            tl.store(auxiliary_ptr, balance * balance_loss + z * tl.sum(z_total, axis=0) / t)
    # This block's entries: their expert's start, the entries of that expert in earlier blocks,
    # and those before them in this block.
    local = tl.arange(0, BLOCK_N)
    entries = block * PER_BLOCK + local
    valid = (local < PER_BLOCK) & (entries < n)
    experts = tl.load(experts_ptr + entries, mask=valid, other=-1)
    picked = (experts[:, None] == columns[None, :]).to(tl.int32)
    earlier = tl.cumsum(picked, axis=0) - picked
    offset = (starts + before)[None, :] + earlier
    rows = tl.sum(tl.where(picked != 0, offset, 0), axis=1)
    tl.store(rows_ptr + entries, rows.to(tl.int64), mask=valid)
    tl.store(entries_ptr + rows, entries.to(tl.int32), mask=valid)
    # -1 for the padding rows and those past the last range, in this block's share of the rows.
    limits = tl.where(expert_mask, ends, num_rows)
    filled = tl.where(expert_mask, starts + counts, num_rows)
    for start in range(block * rows_per_block, (block + 1) * rows_per_block, BLOCK_N):
        sparse_rows = start + tl.arange(0, BLOCK_N)
        inside = (sparse_rows < num_rows) & (sparse_rows < (block + 1) * rows_per_block)
        expert = tl.sum((sparse_rows[:, None] >= limits[None, :]).to(tl.int32), axis=1)
        here = (expert[:, None] == columns[None, :]) & expert_mask[None, :]
        used = tl.sum(tl.where(here & (sparse_rows[:, None] < filled[None, :]), 1, 0), axis=1)
        tl.store(entries_ptr + sparse_rows, -1, mask=inside & (used == 0))
