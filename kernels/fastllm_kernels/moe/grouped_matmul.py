"""Grouped matmuls of the experts' projections over rows sorted by expert (sparse_map.py's
layout: expert e owns rows ends[e - 1]:ends[e]), in Triton with TMA loads.

`torch._grouped_mm` (CUTLASS) is faster for the row products on the H200 (fine-grained
layer 1 forward 0.87 against 0.91 ms, input gradient 0.87 against 0.91; Mixtral's layer 1
forward 6.08 against 8.19:
bench/results/h200-987f9b2/grouped_gemm_probe.json), so `grouped_linear` uses it for bf16 on
CUDA and these kernels elsewhere (fp32 and fp16, the CPU interpreter), where the alternative
was a loop over experts that waits for the host. The weight gradient is ours when the weight
has a gradient sink (recipe.py) and its buffer is to be written: summed in
fp32 straight into the engine's fp32 buffer, it is faster than `torch._grouped_mm`'s bf16
product and the pass that copies it there (fine-grained layer 1: 1.07 against 1.63 ms,
Mixtral's 6.58 against 8.67).

Row tiles never straddle two experts: tile t of the launch is found in-kernel from `ends` (a
cumulative sum of each expert's tile count), so the grid has a static worst case of
cdiv(rows, BLOCK_M) + experts row tiles; the ones past the last expert zero the rows after its
range (torch._grouped_mm leaves them as they were).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

Settings = tuple[int, int, int, int, int]
"""(BLOCK_M or BLOCK_R, BLOCK_N, BLOCK_K, warps, stages) of a launch."""


def _row_settings(dtype: torch.dtype, device: torch.device) -> Settings:
    """For bf16, the H200's best of the tiles bench/grouped_gemm_probe.py tried."""
    if device.type != "cuda":
        return 32, 32, 32, 4, 1
    if dtype.itemsize == 2:
        return 128, 256, 64, 8, 3
    return 64, 128, 32, 4, 3


def _weight_settings(dtype: torch.dtype, device: torch.device) -> Settings:
    if device.type != "cuda":
        return 32, 32, 32, 4, 1
    if dtype.itemsize == 2:
        return 32, 128, 128, 4, 4
    return 32, 64, 64, 4, 3


def _upcast() -> bool:
    """The interpreter's bf16 tl.dot is wrong: it multiplies in fp32 there."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def tma_loadable(x: Tensor, weight: Tensor) -> bool:
    """Whether these kernels can take x (rows, in) and weight (experts, out, in): TMA needs
    contiguous operands with 16-byte aligned base addresses and rows, those of the (rows, out)
    output gradient too."""
    widths = (x.shape[-1], weight.shape[-1], weight.shape[-2])
    return (
        all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (x, weight))
        and all(width * x.element_size() % 16 == 0 for width in widths)
        and x.dtype == weight.dtype
    )


def grouped_rows(
    a: Tensor, b: Tensor, ends: Tensor, b_transposed: bool, settings: Settings | None = None
) -> Tensor:
    """out[r] = a[r] @ b[e]ᵀ (b_transposed: b (experts, N, K), the forward pass) or a[r] @ b[e]
    (b (experts, K, N), the input gradient) for the rows r of expert e; rows past ends[-1]
    zero. a and b as `tma_loadable` takes them; `settings` for a tile sweep."""
    rows, k = a.shape
    experts = b.shape[0]
    n = b.shape[1] if b_transposed else b.shape[2]
    out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    settings = settings or _row_settings(a.dtype, a.device)
    block_m, block_n, block_k, warps, stages = settings
    a_desc = TensorDescriptor.from_tensor(a, [block_m, block_k])
    flat = b.view(experts * b.shape[1], b.shape[2])
    b_desc = TensorDescriptor.from_tensor(
        flat, [block_n, block_k] if b_transposed else [block_k, block_n]
    )
    grid = ((triton.cdiv(rows, block_m) + experts) * triton.cdiv(n, block_n),)
    _rows_kernel[grid](
        a_desc, b_desc, out, ends, rows, n, k, b.shape[1],
        E=experts, E_BLOCK=triton.next_power_of_2(experts),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, B_TRANSPOSED=b_transposed,
        UPCAST=_upcast(), IEEE=a.dtype == torch.float32, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def grouped_weight_gradient_(
    out: Tensor,
    grad: Tensor,
    x: Tensor,
    ends: Tensor,
    accumulate: bool,
    settings: Settings | None = None,
) -> None:
    """out[e] = grad[rows of e]ᵀ @ x[rows of e], or out[e] += it, summed in fp32: out (experts,
    N, K) (fp32 for a gradient sink, or the weight's dtype), grad (rows, N) and x (rows, K) as
    `tma_loadable` takes them. An expert without rows gets zeros."""
    experts, n, k = out.shape
    settings = settings or _weight_settings(grad.dtype, grad.device)
    block_r, block_n, block_k, warps, stages = settings
    g_desc = TensorDescriptor.from_tensor(grad, [block_r, block_n])
    x_desc = TensorDescriptor.from_tensor(x, [block_r, block_k])
    grid = (experts * triton.cdiv(n, block_n) * triton.cdiv(k, block_k),)
    _weight_gradient_kernel[grid](
        g_desc, x_desc, grad, x, out, ends, n, k,
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=block_r, ACCUMULATE=accumulate,
        UPCAST=_upcast(), IEEE=grad.dtype == torch.float32, num_warps=warps, num_stages=stages,
    )  # fmt: skip


@triton.jit
def _tile(ends_ptr, t, E: tl.constexpr, E_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, first row, end of the expert's rows) of row tile t; past the last expert's
    tiles (-1, first row past its range, end of its range)."""
    experts = tl.arange(0, E_BLOCK)
    inside = experts < E
    ends = tl.load(ends_ptr + experts, mask=inside, other=0)
    starts = tl.load(ends_ptr + experts - 1, mask=inside & (experts > 0), other=0)
    tiles = tl.where(inside, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    passed = tl.cumsum(tiles, 0)
    expert = tl.sum((passed <= t).to(tl.int32), 0)
    here = experts == expert
    start = tl.sum(tl.where(here, starts, 0), 0)
    end = tl.sum(tl.where(here, ends, 0), 0)
    first_tile = tl.sum(tl.where(here, passed - tiles, 0), 0)
    # Past the last expert: the rows after its range, zeroed by the tiles left over.
    last = tl.max(ends, 0)
    routed = expert < E
    row = tl.where(
        routed, start + (t - first_tile) * BLOCK_M, last + (t - tl.sum(tiles, 0)) * BLOCK_M
    )
    return tl.where(routed, expert, -1), row, tl.where(routed, end, last)


@triton.jit
def _product(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _rows_kernel(
    a_desc, b_desc, out_ptr, ends_ptr, ROWS, N, K, B_ROWS,
    E: tl.constexpr, E_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, B_TRANSPOSED: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    # Column tiles vary fastest: the programs in flight share a few row tiles and experts.
    n_tiles = tl.cdiv(N, BLOCK_N)
    t = tl.program_id(0) // n_tiles
    n = tl.program_id(0) % n_tiles
    expert, row, end = _tile(ends_ptr, t, E, E_BLOCK, BLOCK_M)
    rows = row + tl.arange(0, BLOCK_M)
    columns = n * BLOCK_N + tl.arange(0, BLOCK_N)
    offsets = rows[:, None].to(tl.int64) * N + columns[None, :]
    if expert < 0:
        zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + offsets, zeros, mask=(rows < ROWS)[:, None] & (columns < N)[None, :])
        return
    # Rows of the tile past `end` belong to the next expert: computed, never stored. Columns
    # past K are zero in a (TMA fills them), so whatever b holds there adds nothing.
    b_row = expert * B_ROWS
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = a_desc.load([row, k])
        if B_TRANSPOSED:
            b = b_desc.load([b_row + n * BLOCK_N, k]).T
        else:
            b = b_desc.load([b_row + k, n * BLOCK_N])
        acc = _product(a, b, acc, UPCAST, IEEE)
    tl.store(
        out_ptr + offsets,
        acc.to(out_ptr.dtype.element_ty),
        mask=(rows < end)[:, None] & (columns < N)[None, :],
    )


@triton.jit
def _weight_gradient_kernel(
    g_desc, x_desc, g_ptr, x_ptr, out_ptr, ends_ptr, N, K,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    ACCUMULATE: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # An expert's programs are consecutive: they share its rows of g and x in L2.
    n_tiles = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    expert = tl.program_id(0) // (n_tiles * k_tiles)
    n = tl.program_id(0) % (n_tiles * k_tiles) // k_tiles
    kb = tl.program_id(0) % k_tiles
    end = tl.load(ends_ptr + expert)
    start = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0)
    columns_n = n * BLOCK_N + tl.arange(0, BLOCK_N)
    columns_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    offsets = expert.to(tl.int64) * N * K + columns_n[:, None] * K + columns_k[None, :]
    mask = (columns_n < N)[:, None] & (columns_k < K)[None, :]
    # Read before the products, in flight while the first blocks load.
    if ACCUMULATE:
        acc = tl.load(out_ptr + offsets, mask=mask).to(tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    whole = start + (end - start) // BLOCK_R * BLOCK_R
    for row in range(start, whole, BLOCK_R):
        g = g_desc.load([row, n * BLOCK_N])
        x = x_desc.load([row, kb * BLOCK_K])
        acc = _product(g.T, x, acc, UPCAST, IEEE)
    if whole < end:
        # The last rows: a whole block would reach into the next expert's.
        rows = whole + tl.arange(0, BLOCK_R)
        inside = (rows < end)[:, None]
        rows = rows[:, None].to(tl.int64)
        g = tl.load(
            g_ptr + rows * N + columns_n[None, :], mask=inside & (columns_n < N)[None, :], other=0.0
        )
        x = tl.load(
            x_ptr + rows * K + columns_k[None, :], mask=inside & (columns_k < K)[None, :], other=0.0
        )
        acc = _product(g.T, x, acc, UPCAST, IEEE)
    tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
