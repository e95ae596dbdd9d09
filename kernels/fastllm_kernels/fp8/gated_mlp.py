"""A gated MLP (norm → up projection → gated activation → down projection) in FP8 under delayed
tensorwise scaling, whose backward pass hands the up projection its output gradient already
quantized.

Delayed scaling knows every operand's scale before the pass that produces it. So the gated
activation's backward kernel writes the gradient of [gate | up] straight in fp8, row-major and
transposed (the operands of the up projection's input and weight gradients), and records its
amax; the same tiles write the activation's output transposed, the down projection's
weight-gradient operand. The unfused pair (`norm_linear`, then `gated_linear`) writes that
gradient in bf16 and reads it back to quantize it, and reads gate | up once more to recompute
the activation: per llama-3b layer, 268 MB written and 536 MB read that this pass does not.
The values are the unfused pair's: the gradient is rounded to the compute dtype before it is
scaled, as the unfused path stores it. A frozen projection (no weight gradient asked for) has
its weight-gradient operand neither written nor used.

The forward pass is the unfused pair's (the norm and the activation quantize their outputs).
Chosen by `gated_mlp` (fastllm_kernels' gated_mlp.py) when both projections compute in FP8
with primed amax histories, without biases (`fused_mlp_applies`); until the histories are
primed (the first step), the unfused pair scales currently.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastllm_kernels._dispatch import as_rows, use_triton
from fastllm_kernels.fp8.amax_history import GRADIENT, INPUT
from fastllm_kernels.fp8.linear import product_of_rows, scaled_matmul, weight_gradient
from fastllm_kernels.fp8.producers import gated_quantized, norm_columns, norm_quantized
from fastllm_kernels.fp8.quantize import E4M3, FP8_MAX, DelayedScale, Fp8Tensor, quantize
from fastllm_kernels.norm import norm_backward
from fastllm_kernels.recipe import WeightRecipe
from fastllm_kernels.row_helpers import (
    activation_and_derivative,
    store_transposed,
    tensor_multiplier,
)


def fused_mlp_applies(
    x: Tensor, up: Tensor, up_recipe: WeightRecipe, down: Tensor, down_recipe: WeightRecipe
) -> bool:
    """Whether `fp8_gated_mlp` computes this MLP: both weights delayed-scaled FP8 with primed
    histories, and the kernels in reach of x."""
    fp8_up, fp8_down = up_recipe.fp8, down_recipe.fp8
    if fp8_up is None or fp8_down is None or fp8_up.delayed is None or fp8_down.delayed is None:
        return False
    primed = (
        fp8_up.scale(INPUT, record=False).history is not None  # type: ignore[union-attr]
        and fp8_up.scale(GRADIENT, record=False).history is not None  # type: ignore[union-attr]
        and fp8_down.scale(INPUT, record=False).history is not None  # type: ignore[union-attr]
    )
    return primed and use_triton(x, up, down)


def fp8_gated_mlp(
    x: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor | None,
    eps: float,
    rms: bool,
    up: Tensor,
    up_recipe: WeightRecipe,
    down: Tensor,
    down_recipe: WeightRecipe,
    activation: str,
) -> Tensor:
    """down(act(gate) * up) of [gate | up] = up_weight(norm(x)), no biases (fused_mlp_applies)."""
    return _Fp8GatedMlpFunction.apply(
        x, norm_weight, norm_bias, eps, rms, up, down, activation, up_recipe, down_recipe
    )


class _Fp8GatedMlpFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, norm_weight, norm_bias, eps, rms, up, down, activation, up_recipe, down_recipe
    ):
        fp8_up, fp8_down = up_recipe.fp8, down_recipe.fp8
        rows = as_rows(x)
        normed, mean, rstd = norm_quantized(
            rows, norm_weight, norm_bias, eps, rms, fp8_up.scale(INPUT)
        )
        h = product_of_rows(normed, up, None, fp8_up, x.dtype)
        del normed
        activated = gated_quantized(h, activation, fp8_down.scale(INPUT))
        out = product_of_rows(activated, down, None, fp8_down, x.dtype)
        ctx.save_for_backward(rows, norm_weight, norm_bias, mean, rstd, up, h, down)
        ctx.rms, ctx.activation = rms, activation
        ctx.up_recipe, ctx.down_recipe = up_recipe, down_recipe
        return out.view(*x.shape[:-1], down.shape[0])

    @staticmethod
    def backward(ctx, grad):
        rows, norm_weight, norm_bias, mean, rstd, up, h, down = ctx.saved_tensors
        up_recipe, down_recipe = ctx.up_recipe, ctx.down_recipe
        fp8_up, fp8_down = up_recipe.fp8, down_recipe.fp8
        need_up, need_down = ctx.needs_input_grad[5:7]
        dy = as_rows(grad)
        dy_q = quantize(
            dy, fp8_down.recipe.gradient_dtype, tensorwise=True, columns=need_down,
            delayed=fp8_down.scale(GRADIENT),
        )  # fmt: skip
        assert dy_q.rows is not None
        d_activated = scaled_matmul(dy_q.rows, fp8_down.columns(down), dy.dtype, fast=False)
        dh_rows, dh_columns, activated_columns = gated_backward_quantized(
            h, d_activated, ctx.activation, fp8_down.scale(INPUT, record=False),
            fp8_up.scale(GRADIENT), fp8_up.recipe.gradient_dtype,
            gradient_columns=need_up, activated_columns=need_down,
        )  # fmt: skip
        del d_activated
        d_down = None
        if need_down:
            assert dy_q.columns is not None and activated_columns is not None
            d_down = weight_gradient(
                down, dy_q.columns, activated_columns, down_recipe.gradient_sink
            )
        del dy_q, activated_columns
        d_normed = scaled_matmul(dh_rows, fp8_up.columns(up), dy.dtype, fast=False)
        del dh_rows
        d_up = None
        if need_up:
            assert dh_columns is not None
            history = fp8_up.scale(INPUT, record=False).history
            normed = norm_columns(rows, norm_weight, norm_bias, mean, rstd, ctx.rms, history)
            d_up = weight_gradient(up, dh_columns, normed, up_recipe.gradient_sink)
        del dh_columns
        bias_dtype = None if norm_bias is None else norm_bias.dtype
        dx, d_norm_weight, d_norm_bias = norm_backward(
            d_normed, rows, norm_weight, mean, rstd, ctx.rms, bias_dtype
        )
        dx = dx.view(*grad.shape[:-1], rows.shape[1])
        return dx, d_norm_weight, d_norm_bias, None, None, d_up, d_down, None, None, None


_TILE_ROWS, _TILE_COLS, _WARPS = 32, 64, 4
"""The fastest of 25 tiles on the H200 at llama-3b's shape (bench/fp8_tiles.py, h200-3ffe8e1:
0.267 ms against 0.341 for 32 x 128, the best of the nine swept before, and 0.351 for
64 x 128): the kernel computes as much as it moves, and 16 values a thread keep more tiles in
flight than 32."""


def gated_backward_quantized(
    h: Tensor,
    d_activated: Tensor,
    activation: str,
    activated_scale: DelayedScale,
    gradient_scale: DelayedScale,
    gradient_dtype: torch.dtype,
    gradient_columns: bool = True,
    activated_columns: bool = True,
) -> tuple[Fp8Tensor, Fp8Tensor | None, Fp8Tensor | None]:
    """From [gate | up] rows h (n, 2d) and the gradient of act(gate) * up (n, d): the gradient
    of h in `gradient_dtype` as rows (n, 2d) and columns (2d, n), scaled from `gradient_scale`'s
    history, its amax recorded there; and act(gate) * up as e4m3 columns (d, n), scaled from
    `activated_scale`'s history (as the forward pass scaled it). The columns, the weight
    gradients' operands, are made only when asked for (None otherwise: a frozen weight)."""
    if activated_scale.history is None or gradient_scale.history is None:
        raise ValueError("gated_backward_quantized scales from primed amax histories")
    n_rows, d = d_activated.shape
    if h.shape != (n_rows, 2 * d) or h.stride(1) != 1 or d_activated.stride(1) != 1:
        raise ValueError(f"bad shapes for the gated backward: {h.shape}, {d_activated.shape}")
    device = h.device
    dh = torch.empty((n_rows, 2 * d), dtype=gradient_dtype, device=device)
    dh_t_shape = (2 * d, n_rows) if gradient_columns else (0,)
    dh_t = torch.empty(dh_t_shape, dtype=gradient_dtype, device=device)
    activated_t = torch.empty((d, n_rows) if activated_columns else (0,), dtype=E4M3, device=device)
    dh_scale = torch.empty((), dtype=torch.float32, device=device)
    activated_scale_out = torch.empty((), dtype=torch.float32, device=device)
    record = gradient_scale.record
    grid = (triton.cdiv(n_rows, _TILE_ROWS), triton.cdiv(d, _TILE_COLS))
    _gated_backward_quantize_kernel[grid](
        h, h.stride(0), d_activated, d_activated.stride(0), n_rows, d,
        dh, dh_t, dh_scale, gradient_scale.history, gradient_scale.history.numel(),
        record if record is not None else dh_scale,
        activated_t, activated_scale_out, activated_scale.history, activated_scale.history.numel(),
        ACTIVATION=activation, RECORD=record is not None,
        GRADIENT_COLUMNS=gradient_columns, ACTIVATED_COLUMNS=activated_columns,
        GRADIENT_AMAX_BLOCK=triton.next_power_of_2(gradient_scale.history.numel()),
        ACTIVATED_AMAX_BLOCK=triton.next_power_of_2(activated_scale.history.numel()),
        GRADIENT_MAX=FP8_MAX[gradient_dtype], ACTIVATED_MAX=FP8_MAX[E4M3],
        BM=_TILE_ROWS, BK=_TILE_COLS, num_warps=_WARPS,
    )  # fmt: skip
    return (
        Fp8Tensor(dh, dh_scale),
        Fp8Tensor(dh_t, dh_scale) if gradient_columns else None,
        Fp8Tensor(activated_t, activated_scale_out) if activated_columns else None,
    )


@triton.jit
def _gated_backward_quantize_kernel(
    h_ptr, h_row_stride, da_ptr, da_row_stride, n_rows, d,
    dh_ptr, dh_t_ptr, dh_scale_ptr, dh_history_ptr, n_dh_history, record_ptr,
    a_t_ptr, a_scale_ptr, a_history_ptr, n_a_history,
    ACTIVATION: tl.constexpr, RECORD: tl.constexpr,
    GRADIENT_COLUMNS: tl.constexpr, ACTIVATED_COLUMNS: tl.constexpr,
    GRADIENT_AMAX_BLOCK: tl.constexpr, ACTIVATED_AMAX_BLOCK: tl.constexpr,
    GRADIENT_MAX: tl.constexpr, ACTIVATED_MAX: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    row_mask, col_mask = rows < n_rows, cols < d
    mask = row_mask[:, None] & col_mask[None, :]
    h_offsets = rows[:, None].to(tl.int64) * h_row_stride + cols[None, :]
    g = tl.load(h_ptr + h_offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + h_offsets + d, mask=mask, other=0.0).to(tl.float32)
    da_offsets = rows[:, None].to(tl.int64) * da_row_stride + cols[None, :]
    da = tl.load(da_ptr + da_offsets, mask=mask, other=0.0).to(tl.float32)
    a, derivative = activation_and_derivative(g, ACTIVATION)
    # Rounded to the compute dtype first, as the unfused path stores the gradient.
    compute = h_ptr.dtype.element_ty
    d_gate = (da * u * derivative).to(compute).to(tl.float32)
    d_up = (da * a).to(compute).to(tl.float32)

    multiplier = tensor_multiplier(dh_history_ptr, n_dh_history, GRADIENT_AMAX_BLOCK, GRADIENT_MAX)
    if RECORD:
        amax = tl.maximum(tl.max(tl.max(tl.abs(d_gate), axis=1), axis=0),
                          tl.max(tl.max(tl.abs(d_up), axis=1), axis=0))  # fmt: skip
        tl.atomic_max(record_ptr, amax)
    bound = GRADIENT_MAX / multiplier
    dtype = dh_ptr.dtype.element_ty
    q_gate = (tl.minimum(tl.maximum(d_gate, -bound), bound) * multiplier).to(dtype)
    q_up = (tl.minimum(tl.maximum(d_up, -bound), bound) * multiplier).to(dtype)
    dh_offsets = rows[:, None].to(tl.int64) * (2 * d) + cols[None, :]
    tl.store(dh_ptr + dh_offsets, q_gate, mask=mask)
    tl.store(dh_ptr + dh_offsets + d, q_up, mask=mask)
    if GRADIENT_COLUMNS:
        store_transposed(dh_t_ptr, q_gate, rows, cols, n_rows, row_mask, col_mask)
        store_transposed(dh_t_ptr, q_up, rows, cols + d, n_rows, row_mask, col_mask)
    if pid_m == 0 and pid_k == 0:
        tl.store(dh_scale_ptr, tl.math.div_rn(1.0, multiplier))

    if ACTIVATED_COLUMNS:
        activated = tl.where(mask, a * u, 0.0)
        a_multiplier = tensor_multiplier(a_history_ptr, n_a_history, ACTIVATED_AMAX_BLOCK,
                                         ACTIVATED_MAX)  # fmt: skip
        a_bound = ACTIVATED_MAX / a_multiplier
        q_a = (tl.minimum(tl.maximum(activated, -a_bound), a_bound) * a_multiplier).to(
            a_t_ptr.dtype.element_ty
        )
        store_transposed(a_t_ptr, q_a, rows, cols, n_rows, row_mask, col_mask)
        if pid_m == 0 and pid_k == 0:
            tl.store(a_scale_ptr, tl.math.div_rn(1.0, a_multiplier))
