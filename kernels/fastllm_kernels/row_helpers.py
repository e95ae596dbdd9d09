"""@triton.jit helpers that the kernels of several ops inline: one row's normalization, a gated
activation and its derivative, FP8 scale multipliers, a transposed tile store.

Kept in one place so that a fused kernel (the FP8 producers, the FP8 MLP) computes exactly
what the op it fuses computes, bit for bit, from the same code.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def normalized_row(
    x_ptr, x_row_stride, w_ptr, b_ptr, mean_ptr, rstd_ptr, row, cols, mask, n_cols, eps,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """Row `row` of x normalized (RMSNorm, or LayerNorm storing its mean) and scaled (and
    shifted, HAS_BIAS) in fp32; its reciprocal std stored."""
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
    return y


@triton.jit
def activation_and_derivative(g, ACTIVATION: tl.constexpr):
    """act(g) and act'(g) in fp32, for the names of activation.ACTIVATIONS."""
    if ACTIVATION == "silu":
        s = tl.sigmoid(g)
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
    elif ACTIVATION == "gelu":
        # 0.5·g·(1 + tanh(k·(g + 0.044715·g³))), k = sqrt(2/π); tanh(u) = 2·sigmoid(2u) - 1.
        k = 0.7978845608028654
        t = 2.0 * tl.sigmoid(2.0 * k * (g + 0.044715 * g * g * g)) - 1.0
        a = 0.5 * g * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * g * g)
    elif ACTIVATION == "relu":
        a = tl.maximum(g, 0.0)
        da = tl.where(g > 0.0, 1.0, 0.0)
    else:  # squared_relu
        r = tl.maximum(g, 0.0)
        a = r * r
        da = 2.0 * r
    return a, da


@triton.jit
def power_of_two_multiplier(amax, FP8_MAX: tl.constexpr):
    """As fp8.quantize.multiplier_reference; IEEE division, so the exponent is the
    reference's exactly."""
    ratio = tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), tl.maximum(amax, 1e-12))
    return (ratio.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def tensor_multiplier(amax_ptr, n_amax, AMAX_BLOCK: tl.constexpr, FP8_MAX: tl.constexpr):
    """The multiplier of one tensor scale: from its amax (n_amax 1) or from the max of an
    amax history (delayed scaling)."""
    offsets = tl.arange(0, AMAX_BLOCK)
    amax = tl.max(tl.load(amax_ptr + offsets, mask=offsets < n_amax, other=0.0), axis=0)
    return power_of_two_multiplier(amax, FP8_MAX)


@triton.jit
def store_transposed(ptr, values, rows, cols, n_rows, row_mask, col_mask):
    """A (rows, cols) tile into a (cols, n_rows) row-major matrix, transposed."""
    tl.store(
        ptr + cols[:, None].to(tl.int64) * n_rows + rows[None, :],
        tl.trans(values),
        mask=col_mask[:, None] & row_mask[None, :],
    )
