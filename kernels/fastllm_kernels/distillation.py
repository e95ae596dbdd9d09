"""Distillation of a linear head from a teacher's, without either model's (tokens, vocab)
logits ever existing whole.

Per chunk of rows, cuBLAS computes the student's fp32 logits and the teacher's (the teacher
may be wider: its own hidden size and weight, the same vocabulary), and one Triton kernel gives
each row's loss and, in the same launch, the student's logit gradient, which two matmuls fold
into the hidden and weight gradients at once (backward only scales them, as in
cross_entropy.py). Memory beyond the inputs and gradients is O(chunk_size × vocab) twice.

Per token, with a = student logits / τ, b = teacher logits / τ, p_S = softmax(a),
p_T = softmax(b) (τ = temperature, on both as TRL's GKD and distillation trainers do;
Fast-LLM divides the teacher's only):
- "forward_kl":    KL(p_T ‖ p_S) = Σ p_T·(log p_T - log p_S)
- "reverse_kl":    KL(p_S ‖ p_T) = Σ p_S·(log p_S - log p_T)
- "cross_entropy": -Σ p_T·log p_S (forward KL plus the teacher's entropy; same gradient)
The loss is the mean over the tokens of `mask`, with no τ² factor (TRL and Fast-LLM apply
none: at τ ≠ 1 scale the loss's weight instead). The gradient with respect to the student's
logits is (p_S - p_T)/τ for forward KL and cross-entropy, p_S·(log p_S - log p_T - KL)/τ for
reverse KL. A student equal to its teacher gets exactly zero gradient, and zero loss
under either KL.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastllm_kernels._dispatch import use_triton
from fastllm_kernels.chunked_head import chunked_head_gradients
from fastllm_kernels.cross_entropy import default_chunk_size
from fastllm_kernels.linear import matmul_into_fp32_
from fastllm_kernels.precomputed_gradients import with_precomputed_gradients

DISTILLATION_LOSS_TYPES = ("forward_kl", "reverse_kl", "cross_entropy")

RowDistillation = Callable[[Tensor, Tensor, Tensor | None, Tensor, Tensor, Tensor], None]
"""rows(student, teacher, grad, mask, losses, scale): for rows of fp32 student and teacher
logits (chunk, vocab or a vocab slice), each row's loss into `losses` (0 where `mask` is
False) and, unless `grad` is None, its student-logit gradient times the device scalar `scale`
into `grad` (zero where `mask` is False; `grad` may alias the student logits)."""


def linear_distillation(
    hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    mask: Tensor,
    temperature: float = 1.0,
    loss_type: str = "forward_kl",
    *,
    chunk_size: int | None = None,
) -> Tensor:
    """Mean over the tokens of mask (N,) of the divergence between the teacher's
    teacher_hidden (N, H_T) @ teacher_weight (V, H_T).T and the student's hidden (N, H) @
    weight (V, H).T at `temperature`; a 0-d fp32 tensor, differentiable in the student's hidden
    and weight only (the teacher's are read without gradient)."""
    hidden, teacher_hidden, mask = _as_rows(hidden, teacher_hidden, mask)
    check_distillation(hidden, weight, teacher_hidden, teacher_weight, temperature, loss_type)
    if use_triton(hidden, weight, teacher_hidden, teacher_weight, mask):
        chunk_size = chunk_size or default_chunk_size(weight.shape[0], logits_per_row=2)
        rows = _triton_rows(1.0 / temperature, loss_type)

        def compute(need_hidden: bool, need_weight: bool):
            return chunked_distillation(hidden, weight, teacher_hidden, teacher_weight, mask,
                                        chunk_size, need_hidden, need_weight, rows)  # fmt: skip

        return with_precomputed_gradients(hidden, weight, compute)[0]
    return linear_distillation_reference(
        hidden, weight, teacher_hidden, teacher_weight, mask, temperature, loss_type
    )


def linear_distillation_reference(
    hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    mask: Tensor,
    temperature: float = 1.0,
    loss_type: str = "forward_kl",
) -> Tensor:
    hidden, teacher_hidden, mask = _as_rows(hidden, teacher_hidden, mask)
    check_distillation(hidden, weight, teacher_hidden, teacher_weight, temperature, loss_type)
    student = torch.log_softmax(hidden.float() @ weight.float().T / temperature, dim=-1)
    with torch.no_grad():
        teacher_logits = teacher_hidden.float() @ teacher_weight.float().T
        teacher = torch.log_softmax(teacher_logits / temperature, dim=-1)
    if loss_type == "forward_kl":
        losses = (teacher.exp() * (teacher - student)).sum(-1)
    elif loss_type == "reverse_kl":
        losses = (student.exp() * (student - teacher)).sum(-1)
    else:
        losses = -(teacher.exp() * student).sum(-1)
    return torch.where(mask, losses, 0.0).sum() / mask.sum().clamp(min=1)


def chunked_distillation(
    hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    mask: Tensor,
    chunk_size: int,
    need_hidden_grad: bool,
    need_weight_grad: bool,
    rows: RowDistillation,
) -> tuple[Tensor, None, Tensor | None, Tensor | None]:
    """(loss, None, hidden gradient, fp32 weight gradient) of `linear_distillation`, with the
    row computation given (the vocab-parallel form gives its own)."""
    hidden, teacher_hidden = hidden.contiguous(), teacher_hidden.contiguous()
    scale = 1.0 / mask.sum().clamp(min=1).float()  # a device scalar: no host synchronization
    losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    chunk_size = max(1, min(chunk_size, hidden.shape[0]))
    teacher_buffer = torch.empty(
        (chunk_size, weight.shape[0]), dtype=torch.float32, device=hidden.device
    )

    def chunk_rows(start: int, end: int, student: Tensor, grad: Tensor | None) -> None:
        teacher = teacher_buffer[: end - start]
        with torch.no_grad():
            matmul_into_fp32_(teacher, teacher_hidden[start:end], teacher_weight.T, False)
        rows(student, teacher, grad, mask[start:end], losses[start:end], scale)

    grad_hidden, grad_weight = chunked_head_gradients(
        hidden, weight, chunk_size, need_hidden_grad, need_weight_grad, chunk_rows
    )
    return losses.sum() * scale, None, grad_hidden, grad_weight


def _triton_rows(inverse_temperature: float, loss_type: str) -> RowDistillation:
    kind = DISTILLATION_LOSS_TYPES.index(loss_type)

    def rows(student, teacher, grad, mask, losses, scale) -> None:
        n_rows, vocab = student.shape
        block = min(triton.next_power_of_2(vocab), 4096)
        _distillation_kernel[(n_rows,)](
            student, student.stride(0), teacher, teacher.stride(0),
            grad if grad is not None else student, grad.stride(0) if grad is not None else 0,
            mask.view(torch.uint8), losses, scale, vocab, inverse_temperature,
            LOSS=kind, WRITE_GRAD=grad is not None, BLOCK=block, num_warps=8,
        )  # fmt: skip

    return rows


@triton.jit
def _distillation_kernel(
    student_ptr, student_row_stride, teacher_ptr, teacher_row_stride, grad_ptr, grad_row_stride,
    mask_ptr, losses_ptr, scale_ptr, vocab, inverse_temperature,
    LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One row: its loss (LOSS 0 forward KL, 1 reverse KL, 2 cross-entropy) and its student-
    logit gradient, which may overwrite the student's logits as cross_entropy's does."""
    row = tl.program_id(0).to(tl.int64)
    student_ptr += row * student_row_stride
    teacher_ptr += row * teacher_row_stride
    grad_ptr += row * grad_row_stride
    cols = tl.arange(0, BLOCK)
    if tl.load(mask_ptr + row) != 0:
        # Sweep 1: both online logsumexps, and the weighted sum the loss needs (by p_S for
        # reverse KL, by p_T otherwise, unnormalized), rescaled with its running maximum.
        m_s = float("-inf")
        m_t = float("-inf")
        sum_s = 0.0
        sum_t = 0.0
        weighted = 0.0
        for start in range(0, vocab, BLOCK):
            valid = start + cols < vocab
            a = tl.load(student_ptr + start + cols, mask=valid, other=0.0).to(tl.float32)
            b = tl.load(teacher_ptr + start + cols, mask=valid, other=0.0).to(tl.float32)
            a *= inverse_temperature
            b *= inverse_temperature
            new_m_s = tl.maximum(m_s, tl.max(tl.where(valid, a, float("-inf")), axis=0))
            new_m_t = tl.maximum(m_t, tl.max(tl.where(valid, b, float("-inf")), axis=0))
            e_s = tl.where(valid, tl.exp(a - new_m_s), 0.0)
            e_t = tl.where(valid, tl.exp(b - new_m_t), 0.0)
            if LOSS == 1:
                weighted = weighted * tl.exp(m_s - new_m_s) + tl.sum(e_s * (a - b), axis=0)
            elif LOSS == 0:
                weighted = weighted * tl.exp(m_t - new_m_t) + tl.sum(e_t * (b - a), axis=0)
            else:
                weighted = weighted * tl.exp(m_t - new_m_t) + tl.sum(e_t * a, axis=0)
            sum_s = sum_s * tl.exp(m_s - new_m_s) + tl.sum(e_s, axis=0)
            sum_t = sum_t * tl.exp(m_t - new_m_t) + tl.sum(e_t, axis=0)
            m_s = new_m_s
            m_t = new_m_t
        lse_s = m_s + tl.log(sum_s)
        lse_t = m_t + tl.log(sum_t)
        if LOSS == 1:
            loss = weighted / sum_s - lse_s + lse_t
        elif LOSS == 0:
            loss = weighted / sum_t - lse_t + lse_s
        else:
            loss = lse_s - weighted / sum_t
        tl.store(losses_ptr + row, loss)
        if WRITE_GRAD:
            factor = tl.load(scale_ptr) * inverse_temperature
            for start in range(0, vocab, BLOCK):
                valid = start + cols < vocab
                a = tl.load(student_ptr + start + cols, mask=valid, other=0.0).to(tl.float32)
                b = tl.load(teacher_ptr + start + cols, mask=valid, other=0.0).to(tl.float32)
                log_p_s = a * inverse_temperature - lse_s
                log_p_t = b * inverse_temperature - lse_t
                if LOSS == 1:
                    g = tl.exp(log_p_s) * (log_p_s - log_p_t - loss)
                else:
                    g = tl.exp(log_p_s) - tl.exp(log_p_t)
                tl.store(grad_ptr + start + cols, (g * factor).to(grad_ptr.dtype.element_ty),
                         mask=valid)  # fmt: skip
    else:
        tl.store(losses_ptr + row, 0.0)
        if WRITE_GRAD:
            zeros = tl.zeros((BLOCK,), dtype=grad_ptr.dtype.element_ty)
            for start in range(0, vocab, BLOCK):
                tl.store(grad_ptr + start + cols, zeros, mask=start + cols < vocab)


def check_distillation(
    hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    temperature: float,
    loss_type: str,
) -> None:
    """ValueError naming the argument that `linear_distillation` cannot take."""
    if loss_type not in DISTILLATION_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DISTILLATION_LOSS_TYPES}, not {loss_type!r}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, not {temperature}")
    if teacher_hidden.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"teacher_hidden: {teacher_hidden.shape[0]} tokens, the student's hidden {hidden.shape[0]}"
        )
    if teacher_weight.shape[0] != weight.shape[0]:
        raise ValueError(
            f"teacher_weight: a vocabulary of {teacher_weight.shape[0]}, the student's {weight.shape[0]}"
        )


def _as_rows(hidden: Tensor, teacher_hidden: Tensor, mask: Tensor) -> tuple[Tensor, ...]:
    hidden = hidden.reshape(-1, hidden.shape[-1])
    return hidden, teacher_hidden.reshape(-1, teacher_hidden.shape[-1]), mask.reshape(-1).bool()
