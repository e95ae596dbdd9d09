"""Cross-entropy of a linear head without materializing the (tokens, vocab) logits, and the
z-loss with it.

`linear_label_losses` walks the rows in chunks (Liger-Kernel's approach): per chunk, cuBLAS
computes fp32 logits, one Triton kernel turns each row into its loss and logsumexp and, in the
same launch, its logit gradient, and two more matmuls fold that gradient into the hidden and
weight gradients. The gradients are therefore ready when forward returns; backward only scales
them by grad_output. Memory beyond the inputs and gradients is O(chunk_size * vocab).

Per token (label y, logits x, ε = label_smoothing, V = vocab size, lse = logsumexp(x)):
    cross-entropy = lse - (1 - ε)·x_y - ε·mean(x)      (torch's label-smoothed cross-entropy)
    z-loss        = lse²                               (PaLM's; the logsumexp is the row's own)
and the loss is label_weight · cross-entropy + z_loss · z-loss. Tokens labelled ignore_index
count for nothing; "mean" divides by the number of the others. `linear_cross_entropy` is the
loss alone at label_weight 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastllm_kernels._dispatch import use_triton
from fastllm_kernels.chunked_head import chunked_head_gradients
from fastllm_kernels.precomputed_gradients import with_precomputed_gradients

_LOGITS_BUDGET = 1 << 28
"""Logits elements per chunk by default (1 GiB in fp32, plus 0.5 GiB of bf16 gradient). Chunks
must be large: each one re-reads and re-writes the fp32 weight-gradient accumulator, which
with 512 rows of a 128K vocabulary made that matmul memory-bound (H200: 2048 rows were 21%
faster than 512, 4096 another 4% but 1.5 GiB more)."""


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    label_smoothing: float = 0.0,
    chunk_size: int | None = None,
    reduction: str = "mean",
) -> Tensor:
    """Cross-entropy of hidden (N, H) @ weight (V, H).T against labels (N,), plus `z_loss` times
    the z-loss; a 0-d fp32 tensor."""
    return linear_label_losses(
        hidden, weight, labels, z_loss=z_loss, ignore_index=ignore_index,
        label_smoothing=label_smoothing, chunk_size=chunk_size, reduction=reduction,
    )[0]  # fmt: skip


def linear_label_losses(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    label_weight: float = 1.0,
    z_loss: float = 0.0,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    chunk_size: int | None = None,
    reduction: str = "mean",
) -> tuple[Tensor, Tensor]:
    """label_weight · cross-entropy + z_loss · z-loss of hidden (N, H) @ weight (V, H).T
    against labels (N,), a 0-d fp32 tensor differentiable in hidden and weight; and the two
    losses apart, (cross-entropy, z-loss) detached, from the same pass."""
    _check_reduction(reduction)
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    weights = (label_weight, z_loss)
    if use_triton(hidden, weight, labels):
        chunk_size = chunk_size or default_chunk_size(weight.shape[0])
        scale = _gradient_scale(labels, ignore_index, reduction)
        rows = _triton_rows(ignore_index, label_smoothing, *weights)

        def compute(need_hidden: bool, need_weight: bool):
            return chunked_label_losses(hidden, weight, labels, scale, weights, chunk_size,
                                        need_hidden, need_weight, rows)  # fmt: skip

        total, parts = with_precomputed_gradients(hidden, weight, compute)
        assert parts is not None
        return total, parts
    return linear_label_losses_reference(
        hidden, weight, labels, *weights, ignore_index, label_smoothing, reduction
    )


def linear_label_losses_reference(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    label_weight: float = 1.0,
    z_loss: float = 0.0,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> tuple[Tensor, Tensor]:
    logits = hidden.reshape(-1, hidden.shape[-1]).float() @ weight.float().T
    loss = cross_entropy_reference(logits, labels, ignore_index, 0.0, label_smoothing, reduction)
    valid = labels.reshape(-1) != ignore_index
    z = (torch.logsumexp(logits, dim=-1)[valid] ** 2).sum()
    z = z / valid.sum().clamp(min=1) if reduction == "mean" else z
    return label_weight * loss + z_loss * z, torch.stack([loss, z]).detach()


RowCrossEntropy = Callable[[Tensor, Tensor | None, Tensor, Tensor, Tensor, Tensor], None]
"""rows(logits, grad, labels, losses, lse, scale): for rows of fp32 logits (chunk, vocab or a
vocab slice), each row's cross-entropy into `losses` and logsumexp into `lse` (both 0 on
ignored rows) and, unless `grad` is None, the logit gradient of its weighted loss times the
device scalar `scale` into `grad` (zero on ignored rows; `grad` may alias the logits)."""


def chunked_label_losses(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    scale: Tensor,
    weights: tuple[float, float],
    chunk_size: int,
    need_hidden_grad: bool,
    need_weight_grad: bool,
    rows: RowCrossEntropy,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """(loss, (cross-entropy, z-loss), hidden gradient, fp32 weight gradient) of
    `linear_label_losses`, `scale` the device scalar each row's loss counts for and `weights`
    (label_weight, z_loss), with the row computation given (the vocab-parallel form gives its
    own)."""
    hidden = hidden.contiguous()
    losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(losses)

    def chunk_rows(start: int, end: int, logits: Tensor, grad: Tensor | None) -> None:
        rows(logits, grad, labels[start:end], losses[start:end], lse[start:end], scale)

    grad_hidden, grad_weight = chunked_head_gradients(
        hidden, weight, chunk_size, need_hidden_grad, need_weight_grad, chunk_rows
    )
    parts = torch.stack([losses.sum(), lse.square().sum()]) * scale
    label_weight, z_loss = weights
    return label_weight * parts[0] + z_loss * parts[1], parts, grad_hidden, grad_weight


def _triton_rows(
    ignore_index: int, smoothing: float, label_weight: float, z_loss: float
) -> RowCrossEntropy:
    def rows(logits, grad, labels, losses, lse, scale) -> None:
        cross_entropy_rows(logits, grad, labels, losses, scale, ignore_index, z_loss, smoothing,
                           label_weight, lse)  # fmt: skip

    return rows


def default_chunk_size(vocab: int, logits_per_row: int = 1) -> int:
    """Rows per chunk within the logits budget, for rows of `logits_per_row` fp32 logit rows of
    `vocab` each (a distillation chunk holds the student's and the teacher's)."""
    return min(4096, max(64, _LOGITS_BUDGET // (vocab * logits_per_row) // 64 * 64))


def linear_cross_entropy_reference(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> Tensor:
    logits = hidden.reshape(-1, hidden.shape[-1]).float() @ weight.float().T
    return cross_entropy_reference(logits, labels, ignore_index, z_loss, label_smoothing, reduction)


def cross_entropy(
    logits: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> Tensor:
    """The same loss for logits (N, V) already computed; stores a logits-sized gradient."""
    _check_reduction(reduction)
    logits, labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    options = (ignore_index, z_loss, label_smoothing, reduction)
    if use_triton(logits, labels):
        return _CrossEntropyFunction.apply(logits, labels, *options)
    return cross_entropy_reference(logits, labels, *options)


def cross_entropy_reference(
    logits: Tensor,
    labels: Tensor,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> Tensor:
    logits, labels = logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)
    loss = torch.nn.functional.cross_entropy(
        logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="sum"
    )
    valid = labels != ignore_index
    if z_loss:
        loss = loss + z_loss * (torch.logsumexp(logits, dim=-1)[valid] ** 2).sum()
    return loss / valid.sum().clamp(min=1) if reduction == "mean" else loss


def _check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, ignore_index, z_loss, smoothing, reduction):
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        scale = _gradient_scale(labels, ignore_index, reduction)
        losses = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(losses)
        grad = torch.empty_like(logits) if ctx.needs_input_grad[0] else None
        cross_entropy_rows(logits, grad, labels, losses, scale, ignore_index, z_loss, smoothing,
                           lse=lse)  # fmt: skip
        ctx.save_for_backward(grad)
        return (losses.sum() + z_loss * lse.square().sum()) * scale

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_output.to(grad.dtype)), None, None, None, None, None


def _gradient_scale(labels: Tensor, ignore_index: int, reduction: str) -> Tensor:
    """1 / (number of counted tokens) for "mean", else 1, as a device scalar (no host sync)."""
    if reduction == "sum":
        return torch.ones((), dtype=torch.float32, device=labels.device)
    return 1.0 / (labels != ignore_index).sum().clamp(min=1).float()


def cross_entropy_rows(
    logits: Tensor,
    grad: Tensor | None,
    labels: Tensor,
    losses: Tensor,
    scale: Tensor,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    smoothing: float = 0.0,
    label_weight: float = 1.0,
    lse: Tensor | None = None,
) -> None:
    """One kernel launch over the rows of fp32 `logits` (unit column stride): each row's
    cross-entropy into `losses` and, unless None, its logsumexp into `lse` (both 0 on ignored
    rows) and, unless `grad` is None, the logit gradient of label_weight · cross-entropy +
    z_loss · lse² times the device scalar `scale` into `grad` (which may be the logits
    themselves, or their rows' first halves in a 16-bit dtype). Without smoothing a row's loss
    is -log p(label): the preference ops take sequence log-probabilities from it."""
    n_rows, vocab = logits.shape
    block = min(triton.next_power_of_2(vocab), 4096)
    _cross_entropy_kernel[(n_rows,)](
        logits, logits.stride(0), grad if grad is not None else logits,
        grad.stride(0) if grad is not None else 0, labels, losses,
        lse if lse is not None else losses, scale, vocab, ignore_index, label_weight, z_loss,
        smoothing, WRITE_GRAD=grad is not None, WRITE_LSE=lse is not None, BLOCK=block,
        num_warps=8,
    )  # fmt: skip


@triton.jit
def _cross_entropy_kernel(
    logits_ptr, logits_row_stride, grad_ptr, grad_row_stride, labels_ptr, losses_ptr, lse_ptr,
    scale_ptr, vocab, ignore_index, label_weight, z_loss, smoothing,
    WRITE_GRAD: tl.constexpr, WRITE_LSE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One row: its cross-entropy and logsumexp, and its gradient (which may overwrite the
    row's logits, in fp32 or, narrower, in the row's first bytes: sweep 2 stores each block
    after loading it, and a block's narrower stores reach no logit it has not loaded)."""
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * logits_row_stride
    grad_ptr += row * grad_row_stride
    label = tl.load(labels_ptr + row)
    cols = tl.arange(0, BLOCK)
    if label != ignore_index:
        # Sweep 1: online logsumexp (running max m, running sum of exp(x - m)), sum of logits.
        m = float("-inf")
        sum_exp = 0.0
        sum_logits = 0.0
        for start in range(0, vocab, BLOCK):
            mask = start + cols < vocab
            x = tl.load(logits_ptr + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
            new_m = tl.maximum(m, tl.max(x, axis=0))
            sum_exp = sum_exp * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
            sum_logits += tl.sum(tl.where(mask, x, 0.0), axis=0)
            m = new_m
        lse = m + tl.log(sum_exp)
        in_range = (label >= 0) & (label < vocab)
        label_logit = tl.load(logits_ptr + label, mask=in_range, other=0.0).to(tl.float32)
        tl.store(
            losses_ptr + row, lse - (1.0 - smoothing) * label_logit - smoothing * sum_logits / vocab
        )
        if WRITE_LSE:
            tl.store(lse_ptr + row, lse)
        # Sweep 2: d loss / d x_j = softmax_j·(w + 2·z_loss·lse) - w·(ε/V + (1 - ε)·[j = y]),
        # w the label weight, scaled.
        if WRITE_GRAD:
            scale = tl.load(scale_ptr)
            softmax_factor = label_weight + 2.0 * z_loss * lse
            for start in range(0, vocab, BLOCK):
                mask = start + cols < vocab
                x = tl.load(logits_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
                g = tl.exp(x - lse) * softmax_factor - label_weight * smoothing / vocab
                g -= tl.where(start + cols == label, label_weight * (1.0 - smoothing), 0.0)
                g = (g * scale).to(grad_ptr.dtype.element_ty)
                tl.store(grad_ptr + start + cols, g, mask=mask)
    else:
        tl.store(losses_ptr + row, 0.0)
        if WRITE_LSE:
            tl.store(lse_ptr + row, 0.0)
        if WRITE_GRAD:
            zeros = tl.zeros((BLOCK,), dtype=grad_ptr.dtype.element_ty)
            for start in range(0, vocab, BLOCK):
                tl.store(grad_ptr + start + cols, zeros, mask=start + cols < vocab)
