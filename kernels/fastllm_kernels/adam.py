"""AdamW over flat fp32 buffers in one pass, optionally writing the bf16/fp16 compute weights.

The update is torch.optim.AdamW's (decoupled weight decay, bias correction with the 1-based
step), so a run can switch between the two without a jump:
    p ← p·(1 - lr·wd);  m ← m + (1 - β1)(g - m);  v ← β2·v + (1 - β2)·g²
    p ← p - lr / (1 - β1^t) · m / (sqrt(v) / sqrt(1 - β2^t) + eps)
with g = grads · grad_scale. One pass reads p, g, m, v and writes p, m, v (and the copy).
With `master_low`, p is the bf16 compute copy and that 16-bit remainder (master_split.py):
read, updated in fp32 and split again in the same pass.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastllm_kernels import master_split
from fastllm_kernels._dispatch import use_triton


def adamw_step_(
    params_fp32: Tensor | None,
    grads: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    lr: float,
    beta_1: float,
    beta_2: float,
    eps: float,
    weight_decay: float,
    step: int,
    compute_copy: Tensor | None = None,
    grad_scale: float = 1.0,
    master_low: Tensor | None = None,
) -> None:
    """One AdamW step in place on 1-D buffers of equal length; grads may be fp32 or bf16/fp16.
    The fp32 master is `params_fp32`, or (None given) the bf16 `compute_copy` with
    `master_low`, its int16 remainder."""
    split = master_low is not None
    if split != (params_fp32 is None) or (split and compute_copy is None):
        raise ValueError("adamw_step_ takes params_fp32, or compute_copy with master_low")
    if split and (compute_copy.dtype != torch.bfloat16 or master_low.dtype != torch.int16):
        raise ValueError("a split master is a bfloat16 compute copy and an int16 remainder")
    buffers = (params_fp32, grads, exp_avg, exp_avg_sq, compute_copy, master_low)
    for buffer in buffers:
        if buffer is not None and (buffer.dim() != 1 or buffer.stride(0) != 1):
            raise ValueError("adamw_step_ takes flat 1-D contiguous buffers")
        if buffer is not None and buffer.numel() != grads.numel():
            raise ValueError("adamw_step_ buffers must have the same length")
    if step < 1:
        raise ValueError(f"step is 1-based, got {step}")
    options = dict(lr=lr, beta_1=beta_1, beta_2=beta_2, eps=eps, weight_decay=weight_decay,
                   step=step, grad_scale=grad_scale)  # fmt: skip
    if not use_triton(*buffers):
        if split:
            params = master_split.join(compute_copy, master_low)
            adamw_step_reference_(params, grads, exp_avg, exp_avg_sq, **options)
            master_split.split_(params, compute_copy, master_low)
            return
        adamw_step_reference_(params_fp32, grads, exp_avg, exp_avg_sq,
                              compute_copy=compute_copy, **options)  # fmt: skip
        return
    n = grads.numel()
    grid = (triton.cdiv(n, _BLOCK),)
    _adamw_kernel[grid](
        params_fp32 if not split else master_low, grads, exp_avg, exp_avg_sq,
        compute_copy if compute_copy is not None else params_fp32, n,
        lr, beta_1, beta_2, eps, 1.0 - lr * weight_decay, lr / (1.0 - beta_1**step),
        math.sqrt(1.0 - beta_2**step), grad_scale,
        WRITE_COPY=compute_copy is not None, SPLIT=split, BLOCK=_BLOCK, num_warps=4,
    )  # fmt: skip


def adamw_step_reference_(
    params_fp32: Tensor,
    grads: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    lr: float,
    beta_1: float,
    beta_2: float,
    eps: float,
    weight_decay: float,
    step: int,
    compute_copy: Tensor | None = None,
    grad_scale: float = 1.0,
) -> None:
    """torch.optim.AdamW's single-tensor update, term for term."""
    grad = grads.float() * grad_scale
    params_fp32.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta_1)
    exp_avg_sq.mul_(beta_2).addcmul_(grad, grad, value=1.0 - beta_2)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1.0 - beta_2**step)).add_(eps)
    params_fp32.addcdiv_(exp_avg, denom, value=-lr / (1.0 - beta_1**step))
    if compute_copy is not None:
        compute_copy.copy_(params_fp32)


_BLOCK = 2048


@triton.jit
def _adamw_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, copy_ptr, n, lr, beta_1, beta_2, eps, decay_factor,
    step_size, sqrt_bias_correction_2, grad_scale,
    WRITE_COPY: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """p_ptr: the fp32 master, or with SPLIT its int16 remainder (copy_ptr its bf16 high half)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # buffers pass 2**31
    mask = offsets < n
    if SPLIT:
        high = tl.load(copy_ptr + offsets, mask=mask).to(tl.int16, bitcast=True)
        low = tl.load(p_ptr + offsets, mask=mask).to(tl.int32)
        p = ((high.to(tl.int32) << 16) + low).to(tl.float32, bitcast=True)
    else:
        p = tl.load(p_ptr + offsets, mask=mask)
    g = tl.load(g_ptr + offsets, mask=mask).to(tl.float32) * grad_scale
    m = tl.load(m_ptr + offsets, mask=mask)
    v = tl.load(v_ptr + offsets, mask=mask)
    p = p * decay_factor
    m = m + (1.0 - beta_1) * (g - m)
    v = beta_2 * v + (1.0 - beta_2) * g * g
    p = p - step_size * (m / (tl.sqrt_rn(v) / sqrt_bias_correction_2 + eps))
    tl.store(m_ptr + offsets, m, mask=mask)
    tl.store(v_ptr + offsets, v, mask=mask)
    if SPLIT:  # the bits rounded up from half to their upper 16, and what remains
        bits = p.to(tl.int32, bitcast=True)
        top = (bits + 0x8000) >> 16
        tl.store(copy_ptr + offsets, top.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
        tl.store(p_ptr + offsets, (bits - (top << 16)).to(tl.int16), mask=mask)
    else:
        tl.store(p_ptr + offsets, p, mask=mask)
        if WRITE_COPY:
            tl.store(copy_ptr + offsets, p.to(copy_ptr.dtype.element_ty), mask=mask)
