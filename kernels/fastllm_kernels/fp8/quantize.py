"""Quantization to FP8 (float8_e4m3fn, float8_e5m2): amax, scale and cast in one or two passes.

A quantized operand is its fp8 values, row-major, and the fp32 scale that dequantizes them
(x ≈ data * scale), as `torch._scaled_mm` takes it: one per row (rowwise scaling) or one for
the tensor (tensorwise). A matrix product contracts over the rows' last dimension, so an
operand that a product contracts over its first dimension is quantized per column and written
transposed (`columns`). Scales are powers of two: dequantizing is exact and the quantized value
is the same whether x is divided by the scale or multiplied by its inverse (torchao's rowwise
recipe rounds them so too).

Tensorwise scaling is current (the scale from the tensor's own amax, one pass to find it and
one to cast) or delayed (`DelayedScale`: the scale from the largest amax of the last steps, as
Transformer Engine's delayed scaling; one pass that casts, saturating what now exceeds the
range, and records the tensor's amax for the steps to come).

Triton: a row that fits in registers is quantized in one pass (read 2 bytes, write 1 per
element); anything else takes two tiled passes, the first reducing the amaxes with atomics,
the second writing every layout asked for from one read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastllm_kernels._dispatch import row_block, use_triton
from fastllm_kernels.row_helpers import power_of_two_multiplier, store_transposed, tensor_multiplier

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
"""The largest finite value of each FP8 format."""
E4M3 = torch.float8_e4m3fn
"""The format of activations and weights under every recipe."""
_AMAX_FLOOR = 1e-12
"""An all-zero tensor still gets a finite scale."""


class Fp8Tensor(NamedTuple):
    data: Tensor
    """(rows, cols) fp8, row-major."""
    scale: Tensor
    """fp32, (rows, 1) per row or () for the whole tensor: data * scale ≈ the values."""


class DelayedScale(NamedTuple):
    history: Tensor | None
    """fp32 (length,): earlier steps' amaxes; the scale comes from their max. None before the
    first step ended: that quantization scales currently, and records."""
    record: Tensor | None
    """fp32 (): this tensor's amax is maxed into it (None: not recorded)."""


class Quantized(NamedTuple):
    rows: Fp8Tensor | None
    """x itself, (R, C)."""
    columns: Fp8Tensor | None
    """xᵀ, (C, R): each of x's columns quantized (and scaled) as one row."""
    amax: Tensor | None
    """Tensorwise: the amax of x, which a later quantization of the same values can reuse."""


def quantize(
    x: Tensor,
    dtype: torch.dtype,
    *,
    tensorwise: bool,
    rows: bool = True,
    columns: bool = False,
    amax: Tensor | None = None,
    delayed: DelayedScale | None = None,
) -> Quantized:
    """x (2-D, unit column stride) in fp8 `dtype`: as `rows` and/or transposed as `columns`,
    scaled per row / column, or by one scale (`tensorwise`: from `amax` when given, from the
    history of `delayed` when it has one)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize takes 2-D rows with unit column stride, got {x.shape}")
    if not (rows or columns):
        raise ValueError("quantize: ask for rows, columns or both")
    if dtype not in FP8_MAX:
        raise ValueError(f"not an FP8 dtype: {dtype}")
    if delayed is not None and not tensorwise:
        raise ValueError("delayed scaling is tensorwise")
    # Not under the interpreter: its conversion to fp8 does not round to nearest even (ties
    # go away from zero, some e5m2 values land a binade off), and the CPU tests need the
    # recipes' true rounding. The Triton kernels are tested on the GPU.
    if use_triton(x) and x.is_cuda:
        quantized = _quantize_triton(x, dtype, tensorwise, rows, columns, amax, delayed)
    else:
        quantized = quantize_reference(
            x, dtype, tensorwise=tensorwise, rows=rows, columns=columns, amax=amax,
            delayed=delayed,
        )  # fmt: skip
    if delayed is not None and delayed.history is None and delayed.record is not None:
        torch.maximum(delayed.record, quantized.amax, out=delayed.record)
    return quantized


def quantize_reference(
    x: Tensor,
    dtype: torch.dtype,
    *,
    tensorwise: bool,
    rows: bool = True,
    columns: bool = False,
    amax: Tensor | None = None,
    delayed: DelayedScale | None = None,
) -> Quantized:
    fp8_max = FP8_MAX[dtype]
    x32 = x.float()
    if delayed is not None and delayed.history is not None:
        multiplier = multiplier_reference(delayed.history.amax(), fp8_max)
        data = (x32 * multiplier).clamp(-fp8_max, fp8_max).to(dtype)
        if delayed.record is not None:
            torch.maximum(delayed.record, x32.abs().amax(), out=delayed.record)
        row_part = Fp8Tensor(data, 1.0 / multiplier) if rows else None
        column_part = Fp8Tensor(data.t().contiguous(), 1.0 / multiplier) if columns else None
        return Quantized(row_part, column_part, None)
    if tensorwise:
        amax = x32.abs().amax() if amax is None else amax.float().reshape(())
        multiplier = multiplier_reference(amax, fp8_max)
        scale = 1.0 / multiplier
        data = (x32 * multiplier).to(dtype)
        row_part = Fp8Tensor(data, scale) if rows else None
        column_part = Fp8Tensor(data.t().contiguous(), scale) if columns else None
        return Quantized(row_part, column_part, amax)
    row_part = column_part = None
    if rows:
        multiplier = multiplier_reference(x32.abs().amax(1, keepdim=True), fp8_max)
        row_part = Fp8Tensor((x32 * multiplier).to(dtype), 1.0 / multiplier)
    if columns:
        multiplier = multiplier_reference(x32.abs().amax(0, keepdim=True), fp8_max)
        data = (x32 * multiplier).to(dtype).t().contiguous()
        column_part = Fp8Tensor(data, (1.0 / multiplier).t().contiguous())
    return Quantized(row_part, column_part, None)


def requested(t: Fp8Tensor | None) -> Fp8Tensor:
    """A layout of `Quantized` that `quantize` was asked for (so not None)."""
    assert t is not None
    return t


def dequantize(t: Fp8Tensor) -> Tensor:
    """The fp32 values t stands for."""
    return t.data.float() * t.scale


def multiplier_reference(amax: Tensor, fp8_max: float) -> Tensor:
    """The largest power of two m with amax * m <= fp8_max (the exponent bits of the ratio)."""
    ratio = fp8_max / amax.clamp(min=_AMAX_FLOOR)
    return (ratio.view(torch.int32) & 0x7F800000).view(torch.float32)


_TILE_ROWS, _TILE_COLS = 64, 128


def _quantize_triton(
    x: Tensor,
    dtype: torch.dtype,
    tensorwise: bool,
    rows: bool,
    columns: bool,
    amax: Tensor | None,
    delayed: DelayedScale | None,
) -> Quantized:
    n_rows, n_cols = x.shape
    fp8_max = FP8_MAX[dtype]
    device = x.device
    q = torch.empty((n_rows, n_cols), dtype=dtype, device=device) if rows else None
    qt = torch.empty((n_cols, n_rows), dtype=dtype, device=device) if columns else None
    if tensorwise:
        row_scale = torch.empty((), dtype=torch.float32, device=device)
        col_scale = row_scale
    else:
        row_scale = torch.empty((n_rows, 1), dtype=torch.float32, device=device)
        col_scale = torch.empty((n_cols, 1), dtype=torch.float32, device=device)
    if rows and not columns and not tensorwise and n_cols <= 16384:
        assert q is not None
        block, num_warps = row_block(n_cols)
        _quantize_rows_kernel[(n_rows,)](
            x, x.stride(0), q, row_scale, n_cols, FP8_MAX=fp8_max, BLOCK=block,
            num_warps=num_warps,
        )  # fmt: skip
        return Quantized(Fp8Tensor(q, row_scale), None, None)
    grid = (triton.cdiv(n_rows, _TILE_ROWS), triton.cdiv(n_cols, _TILE_COLS))
    history = None if delayed is None else delayed.history
    record = None if history is None else delayed.record
    if history is not None:
        row_amax = col_amax = history
    elif tensorwise:
        if amax is None:
            amax = torch.zeros((), dtype=torch.float32, device=device)
            _amax_kernel[grid](
                x, x.stride(0), n_rows, n_cols, amax, amax,
                ROWS=False, COLS=False, TENSOR=True, BM=_TILE_ROWS, BK=_TILE_COLS,
            )  # fmt: skip
        row_amax = col_amax = amax
    else:
        row_amax = torch.zeros(n_rows if rows else 1, dtype=torch.float32, device=device)
        col_amax = torch.zeros(n_cols if columns else 1, dtype=torch.float32, device=device)
        _amax_kernel[grid](
            x, x.stride(0), n_rows, n_cols, row_amax, col_amax,
            ROWS=rows, COLS=columns, TENSOR=False, BM=_TILE_ROWS, BK=_TILE_COLS,
        )  # fmt: skip
    n_amax = 1 if history is None else history.numel()
    _cast_kernel[grid](
        x, x.stride(0), n_rows, n_cols, row_amax, col_amax, n_amax,
        record if record is not None else row_scale,
        q if q is not None else x, row_scale, qt if qt is not None else x, col_scale,
        ROWS=rows, COLS=columns, TENSOR=tensorwise, RECORD=record is not None,
        AMAX_BLOCK=triton.next_power_of_2(n_amax), FP8_MAX=fp8_max,
        BM=_TILE_ROWS, BK=_TILE_COLS,
    )  # fmt: skip
    return Quantized(
        Fp8Tensor(q, row_scale) if q is not None else None,
        Fp8Tensor(qt, col_scale) if qt is not None else None,
        amax if tensorwise and history is None else None,
    )


@triton.jit
def _quantize_rows_kernel(
    x_ptr, x_row_stride, q_ptr, scale_ptr, n_cols, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    multiplier = power_of_two_multiplier(tl.max(tl.abs(x), axis=0), FP8_MAX)
    # |x| * multiplier <= FP8_MAX exactly (a power of two scales without rounding): no clamp.
    tl.store(q_ptr + row * n_cols + cols, (x * multiplier).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, tl.math.div_rn(1.0, multiplier))


@triton.jit
def _amax_kernel(
    x_ptr, x_row_stride, n_rows, n_cols, row_amax_ptr, col_amax_ptr,
    ROWS: tl.constexpr, COLS: tl.constexpr, TENSOR: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """max |x| of each row / column (or of the tile, TENSOR, into row_amax_ptr[0]) over this
    tile, combined across tiles by atomic max (non-negative floats order as their bits do)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    row_mask, col_mask = rows < n_rows, cols < n_cols
    offsets = rows[:, None].to(tl.int64) * x_row_stride + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    a = tl.abs(tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32))
    if TENSOR:
        tl.atomic_max(row_amax_ptr, tl.max(tl.max(a, axis=1), axis=0))
    if ROWS:
        tl.atomic_max(row_amax_ptr + rows, tl.max(a, axis=1), mask=row_mask)
    if COLS:
        tl.atomic_max(col_amax_ptr + cols, tl.max(a, axis=0), mask=col_mask)


@triton.jit
def _cast_kernel(
    x_ptr, x_row_stride, n_rows, n_cols, row_amax_ptr, col_amax_ptr, n_amax, record_ptr,
    q_ptr, row_scale_ptr, qt_ptr, col_scale_ptr,
    ROWS: tl.constexpr, COLS: tl.constexpr, TENSOR: tl.constexpr, RECORD: tl.constexpr,
    AMAX_BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """The tile in fp8: row-major into q (ROWS) and transposed into qt (COLS), each with its
    scales (the first tile of a row / column writes them). TENSOR: one scale, from the max of
    the n_amax values at row_amax_ptr; values past the range saturate (delayed scaling), and
    RECORD maxes the tile's amax into record_ptr."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    row_mask, col_mask = rows < n_rows, cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    offsets = rows[:, None].to(tl.int64) * x_row_stride + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if TENSOR:
        multiplier = tensor_multiplier(row_amax_ptr, n_amax, AMAX_BLOCK, FP8_MAX)
        row_multiplier = tl.full((BM,), 1.0, tl.float32) * multiplier
        col_multiplier = tl.full((BK,), 1.0, tl.float32) * multiplier
        if pid_m == 0 and pid_k == 0:
            tl.store(row_scale_ptr, tl.math.div_rn(1.0, multiplier))
        if RECORD:
            tl.atomic_max(record_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
        # A no-op under current scaling (|x| * multiplier <= FP8_MAX exactly).
        x = tl.minimum(tl.maximum(x, -FP8_MAX / multiplier), FP8_MAX / multiplier)
    if ROWS:
        if not TENSOR:
            row_amax = tl.load(row_amax_ptr + rows, mask=row_mask, other=1.0)
            row_multiplier = power_of_two_multiplier(row_amax, FP8_MAX)
            if pid_k == 0:
                tl.store(row_scale_ptr + rows, tl.math.div_rn(1.0, row_multiplier), mask=row_mask)
        q = (x * row_multiplier[:, None]).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * n_cols + cols[None, :], q, mask=mask)
    if COLS:
        if not TENSOR:
            col_amax = tl.load(col_amax_ptr + cols, mask=col_mask, other=1.0)
            col_multiplier = power_of_two_multiplier(col_amax, FP8_MAX)
            if pid_m == 0:
                tl.store(col_scale_ptr + cols, tl.math.div_rn(1.0, col_multiplier), mask=col_mask)
        qt = (x * col_multiplier[None, :]).to(qt_ptr.dtype.element_ty)
        store_transposed(qt_ptr, qt, rows, cols, n_rows, row_mask, col_mask)
