"""FP8 versions of `norm_linear` and `gated_linear`: the kernel that produces the projection's
input also quantizes it.

With rowwise scaling the norm (or the gated activation) holds each output row whole in
registers, so it writes the row in fp8 with its scale directly: the bf16 activation is never
written nor read again (4 bytes per element saved, of 7). So does tensorwise with delayed
scaling, its scale known before the pass (from the amax history), the output's amax recorded
by the same pass. Current tensorwise scaling needs the amax of the whole output before the
first element can be cast, so there the producer writes bf16 and `quantize` follows. As in the bf16 versions, the backward pass recomputes the producer's
output from the input it keeps anyway, for the weight gradient; tensorwise, in tiles that are
written transposed in fp8 with the forward's scale, the operand the weight gradient takes
(rowwise, each column's scale needs the whole column first: the output is recomputed in bf16
and quantized after).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastllm_kernels._dispatch import as_rows, row_block, use_triton
from fastllm_kernels.activation import (
    _activation_and_derivative,
    _gated_rows,
    _launch_backward,
    gated_activation_reference,
)
from fastllm_kernels.fp8 import (
    FP8_MAX,
    DelayedScale,
    Fp8Tensor,
    power_of_two_multiplier,
    tensor_multiplier,
)
from fastllm_kernels.fp8_linear import (
    E4M3,
    INPUT,
    Fp8Weight,
    backward_products,
    bias_gradient,
    forward_product,
    fp8_linear,
    input_scale_source,
    product_of_rows,
)
from fastllm_kernels.norm import (
    layer_norm_reference,
    norm_backward,
    norm_forward,
    rms_norm_reference,
)


def fp8_norm_linear(
    x: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor | None,
    eps: float,
    rms: bool,
    weight: Tensor,
    bias: Tensor | None,
    fp8: Fp8Weight,
) -> Tensor:
    """`norm_linear` with the projection in FP8."""
    if use_triton(x, norm_weight, norm_bias, weight, bias):
        return _Fp8NormLinearFunction.apply(x, norm_weight, norm_bias, eps, rms, weight, bias, fp8)
    if rms:
        normed = rms_norm_reference(x, norm_weight, eps)
    else:
        normed = layer_norm_reference(x, norm_weight, norm_bias, eps)
    return fp8_linear(normed, weight, bias, fp8)


def fp8_gated_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str, fp8: Fp8Weight
) -> Tensor:
    """`gated_linear` with the projection in FP8."""
    if use_triton(x, weight, bias):
        return _Fp8GatedLinearFunction.apply(x, weight, bias, activation, fp8)
    gate, up = x.chunk(2, dim=-1)
    return fp8_linear(gated_activation_reference(gate, up, activation), weight, bias, fp8)


class _Fp8NormLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, norm_weight, norm_bias, eps, rms, weight, bias, fp8):
        rows = as_rows(x)
        delayed = fp8.scale(INPUT)
        if _fused(fp8, delayed):
            quantized, mean, rstd = _norm_quantized(rows, norm_weight, norm_bias, eps, rms, delayed)
            out, amax = product_of_rows(quantized, weight, bias, fp8, x.dtype), None
        else:
            normed, mean, rstd = norm_forward(rows, norm_weight, norm_bias, eps, rms)
            out, amax = forward_product(normed, weight, bias, fp8)
            del normed
        ctx.save_for_backward(rows, norm_weight, norm_bias, mean, rstd, weight, amax)
        ctx.eps, ctx.rms, ctx.fp8 = eps, rms, fp8
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        rows, norm_weight, norm_bias, mean, rstd, weight, amax = ctx.saved_tensors
        grad_rows = as_rows(grad)
        need_x, need_norm_weight, need_norm_bias = ctx.needs_input_grad[:3]
        need_weight, need_bias = ctx.needs_input_grad[5:7]
        need_normed = need_x or need_norm_weight or need_norm_bias
        source = input_scale_source(ctx.fp8, amax)
        normed: Tensor | Fp8Tensor | None = None
        if need_weight and source is not None:
            normed = _norm_columns(rows, norm_weight, norm_bias, mean, rstd, ctx.rms, source)
        elif need_weight:
            normed = norm_forward(rows, norm_weight, norm_bias, ctx.eps, ctx.rms)[0]
        d_normed, d_weight = backward_products(
            grad_rows, normed, amax, weight, ctx.fp8, need_normed
        )
        del normed
        d_bias = bias_gradient(grad_rows, ctx.bias_dtype) if need_bias else None
        dx = d_norm_weight = d_norm_bias = None
        if d_normed is not None:
            bias_dtype = None if norm_bias is None else norm_bias.dtype
            dx, d_norm_weight, d_norm_bias = norm_backward(
                d_normed, rows, norm_weight, mean, rstd, ctx.rms, bias_dtype
            )
            dx = dx.view(*grad.shape[:-1], rows.shape[1])
        return dx, d_norm_weight, d_norm_bias, None, None, d_weight, d_bias, None


class _Fp8GatedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, activation, fp8):
        x2 = as_rows(x)
        delayed = fp8.scale(INPUT)
        if _fused(fp8, delayed):
            quantized = _gated_quantized(x2, activation, delayed)
            out, amax = product_of_rows(quantized, weight, bias, fp8, x.dtype), None
        else:
            out, amax = forward_product(_gated_rows(x2, activation), weight, bias, fp8)
        ctx.save_for_backward(x2, weight, amax)
        ctx.activation, ctx.fp8 = activation, fp8
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, weight, amax = ctx.saved_tensors
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        dy2 = as_rows(dy)
        source = input_scale_source(ctx.fp8, amax)
        activated: Tensor | Fp8Tensor | None = None
        if need_weight and source is not None:
            activated = _gated_columns(x2, ctx.activation, source)
        elif need_weight:
            activated = _gated_rows(x2, ctx.activation)
        d_activation, d_weight = backward_products(dy2, activated, amax, weight, ctx.fp8, need_x)
        del activated
        d_bias = bias_gradient(dy2, ctx.bias_dtype) if need_bias else None
        dx = None
        if d_activation is not None:
            d = x2.shape[1] // 2
            dx2 = torch.empty_like(x2)
            _launch_backward(
                d_activation, x2[:, :d], x2[:, d:], dx2[:, :d], dx2[:, d:], ctx.activation
            )
            dx = dx2.view(*dy.shape[:-1], 2 * d)
        return dx, d_weight, d_bias, None, None


def _fused(fp8: Fp8Weight, delayed: DelayedScale | None) -> bool:
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


def _norm_quantized(
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


def _gated_quantized(x2: Tensor, activation: str, delayed: DelayedScale | None) -> Fp8Tensor:
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


def _norm_columns(
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


def _gated_columns(x2: Tensor, activation: str, source: Tensor) -> Fp8Tensor:
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
        a, _ = _activation_and_derivative(g, ACTIVATION)
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
    qt = tl.trans((y * multiplier).to(qt_ptr.dtype.element_ty))
    tl.store(
        qt_ptr + cols[:, None].to(tl.int64) * n_rows + rows[None, :],
        qt,
        mask=col_mask[:, None] & row_mask[None, :],
    )


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
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / n_cols
        xc = tl.where(mask, x - mean, 0.0)
        tl.store(mean_ptr + row, mean)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    y = xc * rstd * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
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
    a, _ = _activation_and_derivative(g, ACTIVATION)
    y = a * u  # zero where masked: act(0) * 0
    _store_quantized(
        y, q_ptr + row * d, scale_ptr, history_ptr, n_amax, record_ptr, row, cols, mask,
        TENSOR, RECORD, AMAX_BLOCK, FP8_MAX,
    )  # fmt: skip
