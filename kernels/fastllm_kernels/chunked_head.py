"""The chunk loop of a linear head's fused losses (cross_entropy.py, distillation.py): per chunk
of rows, cuBLAS writes the fp32 logits, the loss's row function turns them into its losses and,
in place, the logit gradient, which two matmuls fold into the hidden and weight gradients at
once. Memory beyond the inputs and gradients is one (chunk_size, vocab) fp32 buffer (and what
the row function keeps of its own)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from fastllm_kernels.linear import matmul_into_fp32_

ChunkRows = Callable[[int, int, Tensor, Tensor | None], None]
"""rows(start, end, logits, grad): the loss of rows start:end from their fp32 logits and, unless
`grad` is None, their logit gradient into `grad` (which aliases the logits: the row function
reads a row's logits before it writes its gradients)."""


def chunked_head_gradients(
    hidden: Tensor,
    weight: Tensor,
    chunk_size: int,
    need_hidden_grad: bool,
    need_weight_grad: bool,
    rows: ChunkRows,
) -> tuple[Tensor | None, Tensor | None]:
    """(hidden gradient, fp32 weight gradient) of the head `hidden @ weight.T` under the loss
    that `rows` computes chunk by chunk (`hidden` contiguous rows)."""
    n_rows, vocab, device = hidden.shape[0], weight.shape[0], hidden.device
    grad_hidden = torch.empty_like(hidden) if need_hidden_grad else None
    # The weight gradient sums over all chunks: accumulate it in fp32 whatever weight's dtype
    # (the first chunk's product overwrites the accumulator, which needs no zeroing).
    grad_weight = None
    if need_weight_grad:
        grad_weight = torch.empty(weight.shape, dtype=torch.float32, device=device)
        if n_rows == 0:
            grad_weight.zero_()
    chunk_size = max(1, min(chunk_size, n_rows))
    logits_buffer = torch.empty((chunk_size, vocab), dtype=torch.float32, device=device)
    # The logit gradient overwrites the logits: in bf16/fp16 (what the gradient matmuls take),
    # each row's in the first half of its own fp32 row, a matrix of row stride 2V.
    grad_buffer = None
    if need_hidden_grad or need_weight_grad:
        grad_buffer = logits_buffer
        if hidden.dtype != torch.float32:
            grad_buffer = logits_buffer.view(hidden.dtype)[:, :vocab]
    for start in range(0, n_rows, chunk_size):
        end = min(start + chunk_size, n_rows)
        chunk = hidden[start:end]
        logits = logits_buffer[: end - start]
        matmul_into_fp32_(logits, chunk, weight.T, accumulate=False)
        grad = None if grad_buffer is None else grad_buffer[: end - start]
        rows(start, end, logits, grad)
        if need_hidden_grad:
            torch.mm(grad, weight, out=grad_hidden[start:end])
        if need_weight_grad:
            matmul_into_fp32_(grad_weight, grad.T, chunk, accumulate=start > 0)
    return grad_hidden, grad_weight
