"""The kernels that produce an FP8 projection's input (the norm, the gated activation) writing
it in fp8: the forward pass's rows and the backward pass's transposed columns.

With rowwise scaling the norm (or the gated activation) holds each output row whole in
registers, so it writes the row in fp8 with its scale directly: the bf16 activation is never
written nor read again (4 bytes per element saved, of 7). So does tensorwise with delayed
scaling, its scale known before the pass (from the amax history), the output's amax recorded
by the same pass. Current tensorwise scaling needs the amax of the whole output before the
first element can be cast, so there the producer writes bf16 and `quantize` follows
(`producer_quantizes`). The backward pass recomputes the producer's output from the input it
keeps anyway, for the weight gradient; tensorwise, in tiles that are written transposed in
fp8 with the forward's scale, the operand the weight gradient takes (rowwise, each column's
scale needs the whole column first: the output is recomputed in bf16 and quantized after).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastllm_kernels._dispatch import row_block
from fastllm_kernels.fp8.quantize import E4M3, FP8_MAX, DelayedScale, Fp8Tensor
from fastllm_kernels.fp8.weight import Fp8Weight
from fastllm_kernels.row_helpers import (
    activation_and_derivative,
    normalized_row,
    power_of_two_multiplier,
    store_transposed,
    tensor_multiplier,
)


def producer_quantizes(fp8: Fp8Weight, delayed: DelayedScale | None) -> bool:
    """Whether the producer quantizes: its scale known per row, or from an amax history."""
    return not fp8.recipe.tensorwise or (delayed is not None and delayed.history is not None)


def _scale_arguments(delayed: DelayedScale | None, n_rows: int, device: torch.device):
    """(scale, history, n_amax, record) of the producer kernels: one scale per row (rowwise),
    or one for the tensor from `delayed`'s history."""
    if delayed is None:
        scale = torch.empty((n_rows, 1), dtype=torch.float32, device=device)
        return scale, scale, 1, None
    assert delayed.history is not None
    scale = torch.empty((), dtype=torch.float32, device=device)
    return scale, delayed.history, delayed.history.numel(), delayed.record


def norm_quantized(
    rows: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    eps: float,
    is_rms: bool,
    delayed: DelayedScale | None,
) -> tuple[Fp8Tensor, Tensor, Tensor]:
    """norm(rows) in e4m3 with one scale per row (or `delayed`'s), and the rows' means and
    reciprocal stds."""
    n_rows, n_cols = rows.shape
    block, num_warps = row_block(n_cols)
    q = torch.empty((n_rows, n_cols), dtype=E4M3, device=rows.device)
    scale, history, n_amax, record = _scale_arguments(delayed, n_rows, rows.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=rows.device)
    mean = rstd if is_rms else torch.empty_like(rstd)  # never written for RMSNorm
    _norm_quantize_kernel[(n_rows,)](
        rows, rows.stride(0), q, scale, weight, bias if bias is not None else weight, mean, rstd,
        history, n_amax, record if record is not None else scale, n_cols, eps, IS_RMS=is_rms,
        HAS_BIAS=bias is not None, TENSOR=delayed is not None, RECORD=record is not None,
        AMAX_BLOCK=triton.next_power_of_2(n_amax), FP8_MAX=FP8_MAX[E4M3], BLOCK=block,
        num_warps=num_warps,
    )  # fmt: skip
    return Fp8Tensor(q, scale), mean, rstd


def gated_quantized(x2: Tensor, activation: str, delayed: DelayedScale | None) -> Fp8Tensor:
    """act(gate) * up of [gate | up] rows in e4m3 with one scale per row (or `delayed`'s)."""
    n_rows, d = x2.shape[0], x2.shape[1] // 2
    block, num_warps = row_block(d)
    q = torch.empty((n_rows, d), dtype=E4M3, device=x2.device)
    scale, history, n_amax, record = _scale_arguments(delayed, n_rows, x2.device)
    _gated_quantize_kernel[(n_rows,)](
        x2, x2.stride(0), q, scale, history, n_amax, record if record is not None else scale, d,
        ACTIVATION=activation, TENSOR=delayed is not None, RECORD=record is not None,
        AMAX_BLOCK=triton.next_power_of_2(n_amax), FP8_MAX=FP8_MAX[E4M3], BLOCK=block,
        num_warps=num_warps,
    )  # fmt: skip
    return Fp8Tensor(q, scale)


_TILE_ROWS, _TILE_COLS = 64, 128


def norm_columns(
    rows: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    is_rms: bool,
    source: Tensor,
) -> Fp8Tensor:
    """norm(rows)ᵀ in e4m3, recomputed from the rows and their statistics, with the one scale
    of `source` (an amax, or an amax history)."""
    n_rows, n_cols = rows.shape
    qt = torch.empty((n_cols, n_rows), dtype=E4M3, device=rows.device)
    scale = torch.empty((), dtype=torch.float32, device=rows.device)
    grid = (triton.cdiv(n_rows, _TILE_ROWS), triton.cdiv(n_cols, _TILE_COLS))
    _columns_kernel[grid](
        rows, rows.stride(0), n_rows, n_cols, qt, scale, source, source.numel(),
        weight, bias if bias is not None else weight, mean, rstd,
        GATED=False, IS_RMS=is_rms, HAS_BIAS=bias is not None, ACTIVATION="",
        AMAX_BLOCK=triton.next_power_of_2(source.numel()), FP8_MAX=FP8_MAX[E4M3],
        BM=_TILE_ROWS, BK=_TILE_COLS,
    )  # fmt: skip
    return Fp8Tensor(qt, scale)


def gated_columns(x2: Tensor, activation: str, source: Tensor) -> Fp8Tensor:
    """(act(gate) * up)ᵀ of [gate | up] rows in e4m3, with the one scale of `source`."""
    n_rows, d = x2.shape[0], x2.shape[1] // 2
    qt = torch.empty((d, n_rows), dtype=E4M3, device=x2.device)
    scale = torch.empty((), dtype=torch.float32, device=x2.device)
    grid = (triton.cdiv(n_rows, _TILE_ROWS), triton.cdiv(d, _TILE_COLS))
    _columns_kernel[grid](
        x2, x2.stride(0), n_rows, d, qt, scale, source, source.numel(), x2, x2, x2, x2,
        GATED=True, IS_RMS=False, HAS_BIAS=False, ACTIVATION=activation,
        AMAX_BLOCK=triton.next_power_of_2(source.numel()), FP8_MAX=FP8_MAX[E4M3],
        BM=_TILE_ROWS, BK=_TILE_COLS,
    )  # fmt: skip
    return Fp8Tensor(qt, scale)


@triton.jit
def _columns_kernel(
    x_ptr, x_row_stride, n_rows, n_cols, qt_ptr, scale_ptr, amax_ptr, n_amax,
    w_ptr, b_ptr, mean_ptr, rstd_ptr,
    GATED: tl.constexpr, IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr, AMAX_BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """A tile of the producer's output (the norm from the rows' mean and rstd, or the gated
    activation of [gate | up]) written transposed in fp8 under one tensor scale."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    row_mask, col_mask = rows < n_rows, cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    offsets = rows[:, None].to(tl.int64) * x_row_stride + cols[None, :]
    if GATED:
        g = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + offsets + n_cols, mask=mask, other=0.0).to(tl.float32)
        a, _ = activation_and_derivative(g, ACTIVATION)
        y = a * u
    else:
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if not IS_RMS:
            x -= tl.load(mean_ptr + rows, mask=row_mask, other=0.0)[:, None]
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = x * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y = tl.where(mask, y, 0.0)
    multiplier = tensor_multiplier(amax_ptr, n_amax, AMAX_BLOCK, FP8_MAX)
    y = tl.minimum(tl.maximum(y, -FP8_MAX / multiplier), FP8_MAX / multiplier)
    if pid_m == 0 and pid_k == 0:
        tl.store(scale_ptr, tl.math.div_rn(1.0, multiplier))
    qt = (y * multiplier).to(qt_ptr.dtype.element_ty)
    store_transposed(qt_ptr, qt, rows, cols, n_rows, row_mask, col_mask)


@triton.jit
def _store_quantized(
    y, q_row_ptr, scale_ptr, history_ptr, n_amax, record_ptr, row, cols, mask,
    TENSOR: tl.constexpr, RECORD: tl.constexpr, AMAX_BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    """A row (zero where masked) in fp8: scaled by its own amax, or (TENSOR) by the history's,
    saturating, its amax recorded (RECORD)."""
    if TENSOR:
        multiplier = tensor_multiplier(history_ptr, n_amax, AMAX_BLOCK, FP8_MAX)
        if RECORD:
            tl.atomic_max(record_ptr, tl.max(tl.abs(y), axis=0))
        y = tl.minimum(tl.maximum(y, -FP8_MAX / multiplier), FP8_MAX / multiplier)
        if row == 0:
            tl.store(scale_ptr, tl.math.div_rn(1.0, multiplier))
    else:
        # |y| * multiplier <= FP8_MAX exactly (a power of two scales without rounding).
        multiplier = power_of_two_multiplier(tl.max(tl.abs(y), axis=0), FP8_MAX)
        tl.store(scale_ptr + row, tl.math.div_rn(1.0, multiplier))
    tl.store(q_row_ptr + cols, (y * multiplier).to(q_row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_quantize_kernel(
    x_ptr, x_row_stride, q_ptr, scale_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr,
    history_ptr, n_amax, record_ptr, n_cols, eps,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, TENSOR: tl.constexpr, RECORD: tl.constexpr,
    AMAX_BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """norm.py's forward kernel, its output row quantized in registers."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = normalized_row(
        x_ptr, x_row_stride, w_ptr, b_ptr, mean_ptr, rstd_ptr, row, cols, mask, n_cols, eps,
        IS_RMS, HAS_BIAS,
    )  # fmt: skip
    y = tl.where(mask, y, 0.0)
    _store_quantized(
        y, q_ptr + row * n_cols, scale_ptr, history_ptr, n_amax, record_ptr, row, cols, mask,
        TENSOR, RECORD, AMAX_BLOCK, FP8_MAX,
    )  # fmt: skip


@triton.jit
def _gated_quantize_kernel(
    x_ptr, x_row_stride, q_ptr, scale_ptr, history_ptr, n_amax, record_ptr, d,
    ACTIVATION: tl.constexpr, TENSOR: tl.constexpr, RECORD: tl.constexpr,
    AMAX_BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    g = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * x_row_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    a, _ = activation_and_derivative(g, ACTIVATION)
    y = a * u  # zero where masked: act(0) * 0
    _store_quantized(
        y, q_ptr + row * d, scale_ptr, history_ptr, n_amax, record_ptr, row, cols, mask,
        TENSOR, RECORD, AMAX_BLOCK, FP8_MAX,
    )  # fmt: skip
