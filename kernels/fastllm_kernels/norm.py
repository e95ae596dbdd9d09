"""RMSNorm and LayerNorm over the last dimension: fp32 statistics, output in the input's dtype.

One Triton program normalizes one row, which it holds whole in registers. The backward pass
gives each program a contiguous range of rows, accumulates its weight/bias gradient in fp32
registers and writes one partial sum per program; torch sums the partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastllm_kernels._dispatch import as_rows, num_programs, row_block, use_triton
from fastllm_kernels.row_helpers import normalized_row


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-5) -> Tensor:
    """RMSNorm over the last dimension; differentiable in x and weight."""
    if use_triton(x, weight):
        return _NormFunction.apply(x, weight, None, eps, True)
    return rms_norm_reference(x, weight, eps)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dimension; differentiable in x, weight and bias (which may be None)."""
    if use_triton(x, weight, bias):
        return _NormFunction.apply(x, weight, bias, eps, False)
    return layer_norm_reference(x, weight, bias, eps)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def layer_norm_reference(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    x32 = x.float()
    bias32 = None if bias is None else bias.float()
    y = torch.nn.functional.layer_norm(x32, x.shape[-1:], weight.float(), bias32, eps)
    return y.to(x.dtype)


def norm_reference(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, rms: bool) -> Tensor:
    """`rms_norm_reference` (`rms`) or `layer_norm_reference`: the norm a fused projection
    reads."""
    if rms:
        return rms_norm_reference(x, weight, eps)
    return layer_norm_reference(x, weight, bias, eps)


_PROGRAMS_PER_SM = 2
"""Backward programs per multiprocessor: enough rows in flight to hide memory latency, few
enough that the (programs, n_cols) fp32 partial sums stay small. On the H200 the backward
pass of 65536 x 4096 bf16 rows ran at ~3.4 TB/s with this (1, 2 or 4 were within 3%)."""
_TILE_ELEMENTS = 4096
"""Backward tile: a program takes max(1, _TILE_ELEMENTS // n_cols) rows at a time, so narrow
rows (e.g. per-head norms of 128) still keep enough loads in flight."""


class _NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, is_rms):
        rows = as_rows(x)
        # The output is a tensor of its own, not a view made here: its caller may change it
        # in place (rotary turns normalized queries and keys in place).
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _, mean, rstd = norm_forward(rows, weight, bias, eps, is_rms, y.view(rows.shape))
        ctx.save_for_backward(rows, weight, mean, rstd)
        ctx.is_rms, ctx.bias_dtype = is_rms, None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        rows, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = norm_backward(
            as_rows(dy), rows, weight, mean, rstd, ctx.is_rms, ctx.bias_dtype
        )
        return dx.view(dy.shape), dw, db, None, None


def norm_forward(
    rows: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    eps: float,
    is_rms: bool,
    out: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The normalized (rows, n_cols) rows (written to `out`, contiguous, if given), their means
    (LayerNorm) and reciprocal std devs."""
    n_rows, n_cols = rows.shape
    block, num_warps = row_block(n_cols)
    y = torch.empty((n_rows, n_cols), dtype=rows.dtype, device=rows.device) if out is None else out
    rstd = torch.empty(n_rows, dtype=torch.float32, device=rows.device)
    mean = rstd if is_rms else torch.empty_like(rstd)  # never written for RMSNorm
    _norm_forward_kernel[(n_rows,)](
        rows, rows.stride(0), y, weight, bias if bias is not None else weight, mean, rstd,
        n_cols, eps, IS_RMS=is_rms, HAS_BIAS=bias is not None, BLOCK=block,
        num_warps=num_warps,
    )  # fmt: skip
    return y, mean, rstd


def norm_backward(
    dy_rows: Tensor,
    rows: Tensor,
    weight: Tensor,
    mean: Tensor,
    rstd: Tensor,
    is_rms: bool,
    bias_dtype: torch.dtype | None,
    normed: Tensor | None = None,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """dx, d(weight) and d(bias) (None when bias_dtype is) from the output gradient. With
    `normed`, the same pass also writes the norm's output there (LayerNorm's with `bias`), as
    `norm_forward` computes it; it may be dy_rows itself, each element overwritten after it
    is read."""
    n_rows, n_cols = rows.shape
    has_bias = bias_dtype is not None
    block, num_warps = row_block(n_cols)
    tile_rows = max(1, min(_TILE_ELEMENTS // block, triton.next_power_of_2(n_rows)))
    programs = min(num_programs(rows.device) * _PROGRAMS_PER_SM, triton.cdiv(n_rows, tile_rows))
    rows_per_program = triton.cdiv(triton.cdiv(n_rows, programs), tile_rows) * tile_rows
    dx = torch.empty((n_rows, n_cols), dtype=rows.dtype, device=rows.device)
    dw_partial = torch.empty((programs, n_cols), dtype=torch.float32, device=rows.device)
    db_partial = torch.empty_like(dw_partial) if has_bias else dw_partial
    y = normed if normed is not None else dx
    _norm_backward_kernel[(programs,)](
        dy_rows, dy_rows.stride(0), rows, rows.stride(0), weight, mean, rstd, dx,
        dw_partial, db_partial, y, y.stride(0), bias if bias is not None else weight,
        n_rows, n_cols, rows_per_program, IS_RMS=is_rms, HAS_BIAS=has_bias,
        WRITE_NORMED=normed is not None, NORMED_BIAS=bias is not None, ROWS=tile_rows,
        BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    dw = dw_partial.sum(0).to(weight.dtype)
    db = db_partial.sum(0).to(bias_dtype) if has_bias else None
    return dx, dw, db


@triton.jit
def _norm_forward_kernel(
    x_ptr, x_row_stride, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, n_cols, eps,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = normalized_row(
        x_ptr, x_row_stride, w_ptr, b_ptr, mean_ptr, rstd_ptr, row, cols, mask, n_cols, eps,
        IS_RMS, HAS_BIAS,
    )  # fmt: skip
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_backward_kernel(
    dy_ptr, dy_row_stride, x_ptr, x_row_stride, w_ptr, mean_ptr, rstd_ptr, dx_ptr,
    dw_partial_ptr, db_partial_ptr, y_ptr, y_row_stride, b_ptr, n_rows, n_cols,
    rows_per_program, IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, WRITE_NORMED: tl.constexpr,
    NORMED_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Rows [pid * rows_per_program, ...), ROWS at a time (a 2-D tile keeps more loads in flight)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)[None, :]
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if NORMED_BIAS:
        b = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    db = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program  # int64: row * stride may pass 2**31
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for first in range(row_start, row_end, ROWS):
        rows = first + tl.arange(0, ROWS)[:, None]
        row_mask = rows < row_end
        mask = row_mask & col_mask
        x = tl.load(x_ptr + rows * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        x_hat = x * rstd
        if not IS_RMS:
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
            x_hat = tl.where(mask, (x - mean) * rstd, 0.0)
        w_dy = w * dy
        # d/dx of (x - mean) * rstd, projected: dx = rstd * (w·dy - mean(w·dy) - x̂·mean(x̂·w·dy)).
        dx = w_dy - x_hat * (tl.sum(x_hat * w_dy, axis=1)[:, None] / n_cols)
        if not IS_RMS:
            dx -= tl.sum(w_dy, axis=1)[:, None] / n_cols
        tl.store(dx_ptr + rows * n_cols + cols, (dx * rstd).to(dx_ptr.dtype.element_ty), mask=mask)
        if WRITE_NORMED:  # as _norm_forward_kernel computes it, from the same mean and rstd
            y = x_hat * w
            if NORMED_BIAS:
                y += b
            tl.store(y_ptr + rows * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat
        if HAS_BIAS:
            db += dy
    tl.store(dw_partial_ptr + pid * n_cols + cols, tl.sum(dw, axis=0)[None, :], mask=col_mask)
    if HAS_BIAS:
        tl.store(db_partial_ptr + pid * n_cols + cols, tl.sum(db, axis=0)[None, :], mask=col_mask)
