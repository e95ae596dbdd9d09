"""The head's losses with the vocabulary split in contiguous ranges over the tensor ranks: the
label loss and z-loss, sequence log-probabilities, DPO and distillation. Each rank holds a
vocabulary slice of the head weight (and of the teacher's), computes its slice of each chunk's
logits, and the per-token values that need the whole vocabulary (maxima, sums of exponentials,
the target logit, the weighted sums of the divergences) are all-reduced over the tensor group:
two all-reduces of a few values per token per chunk, none in the backward pass.

The chunking, the pairing of DPO's spans and the folding of gradients are the single-process
ops' (fastllm_kernels.cross_entropy, .preference, .distillation); only the row computation
differs (torch here, with the collectives). `hidden` must come through `tensor.enter`, whose backward sums the
ranks' partial hidden gradients; the weight's gradient is this rank's slice, handed to the
sink of its `recipe` if it has one."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from fastllm.parallel.tensor import TensorDimension
from fastllm_kernels.cross_entropy import (
    RowCrossEntropy,
    chunked_label_losses,
    default_chunk_size,
)
from fastllm_kernels.distillation import (
    DISTILLATION_LOSS_TYPES,
    RowDistillation,
    check_distillation,
    chunked_distillation,
)
from fastllm_kernels.precomputed_gradients import with_precomputed_gradients
from fastllm_kernels.preference import (
    RowLogProbs,
    check_dpo,
    chunked_dpo,
    chunked_sequence_log_probs,
    dpo_metrics,
)
from fastllm_kernels.recipe import WeightRecipe

IGNORED = -100
"""The label of a position that trains nothing."""


def vocab_parallel_label_losses(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    tensor: TensorDimension,
    *,
    label_weight: float = 1.0,
    z_loss: float = 0.0,
    ignore_index: int = -100,
    recipe: WeightRecipe | None = None,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """`linear_label_losses` (mean reduction, no label smoothing) with weight (V / size, H)
    this rank's vocabulary slice: the same loss and (cross-entropy, z-loss) on every tensor
    rank."""
    hidden, labels = _rows(hidden), labels.reshape(-1)
    chunk_size = chunk_size or default_chunk_size(weight.shape[0])
    scale = 1.0 / (labels != ignore_index).sum().clamp(min=1).float()
    weights = (label_weight, z_loss)
    rows = _cross_entropy_rows(tensor, ignore_index, *weights)

    def compute(need_hidden: bool, need_weight: bool):
        return chunked_label_losses(hidden, weight, labels, scale, weights, chunk_size,
                                    need_hidden, need_weight, rows)  # fmt: skip

    total, parts = with_precomputed_gradients(hidden, weight, compute, recipe)
    assert parts is not None
    return total, parts


def vocab_parallel_sequence_log_probs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    spans: Tensor,
    num_spans: int,
    tensor: TensorDimension,
    *,
    chunk_size: int | None = None,
) -> Tensor:
    """`linear_sequence_log_probs` with weight (V / size, H) this rank's vocabulary slice; the
    same (num_spans,) fp32 values on every tensor rank. Not differentiable."""
    hidden, labels, spans = _rows(hidden), labels.reshape(-1), spans.reshape(-1).long()
    chunk_size = chunk_size or default_chunk_size(weight.shape[0])
    rows = _label_rows(tensor)
    return chunked_sequence_log_probs(hidden, weight, labels, spans, num_spans, chunk_size, rows)


def vocab_parallel_dpo(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    spans: Tensor,
    reference_log_probs: Tensor,
    tensor: TensorDimension,
    beta: float,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
    *,
    recipe: WeightRecipe | None = None,
    chunk_size: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`linear_dpo` with weight (V / size, H) this rank's vocabulary slice: the same loss and
    metrics on every tensor rank."""
    hidden, labels, spans = _rows(hidden), labels.reshape(-1), spans.reshape(-1).long()
    check_dpo(reference_log_probs, beta, label_smoothing, loss_type)
    chunk_size = chunk_size or default_chunk_size(weight.shape[0])
    reference = reference_log_probs.float()
    rows = _label_rows(tensor)

    def compute(need_hidden: bool, need_weight: bool):
        return chunked_dpo(hidden, weight, labels, spans, reference, beta, label_smoothing,
                           loss_type, chunk_size, need_hidden, need_weight, rows)  # fmt: skip

    loss, policy = with_precomputed_gradients(hidden, weight, compute, recipe)
    assert policy is not None
    return loss, dpo_metrics(policy, reference, beta)


def vocab_parallel_distillation(
    hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    mask: Tensor,
    tensor: TensorDimension,
    temperature: float = 1.0,
    loss_type: str = "forward_kl",
    *,
    recipe: WeightRecipe | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """`linear_distillation` with weight (V / size, H) and teacher_weight (V / size, H_T) the
    same vocabulary slice of the student's and the teacher's heads: the same loss on every
    tensor rank."""
    hidden, teacher_hidden, mask = _rows(hidden), _rows(teacher_hidden), mask.reshape(-1).bool()
    check_distillation(hidden, weight, teacher_hidden, teacher_weight, temperature, loss_type)
    chunk_size = chunk_size or default_chunk_size(weight.shape[0], logits_per_row=2)
    rows = _distillation_rows(tensor, 1.0 / temperature, loss_type)

    def compute(need_hidden: bool, need_weight: bool):
        return chunked_distillation(hidden, weight, teacher_hidden, teacher_weight, mask,
                                    chunk_size, need_hidden, need_weight, rows)  # fmt: skip

    return with_precomputed_gradients(hidden, weight, compute, recipe)[0]


def _cross_entropy_rows(
    tensor: TensorDimension, ignore_index: int, label_weight: float, z_loss: float
) -> RowCrossEntropy:
    def rows(
        logits: Tensor, grad: Tensor | None, labels: Tensor, losses: Tensor, lse: Tensor,
        scale: Tensor,
    ) -> None:  # fmt: skip
        vocab = logits.shape[1]
        valid = labels != ignore_index
        maximum = logits.max(dim=-1).values
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=tensor.group)
        shifted = logits - maximum.unsqueeze(-1)
        local = labels - tensor.rank * vocab
        here = valid & (local >= 0) & (local < vocab)
        local = local.clamp(0, vocab - 1).unsqueeze(-1)
        exponentials = shifted.exp()
        sums = torch.stack(
            [exponentials.sum(dim=-1), torch.where(here, shifted.gather(1, local)[:, 0], 0.0)]
        )
        dist.all_reduce(sums, group=tensor.group)  # sums of exponentials, target logits
        total, target = sums
        log_total = total.log()
        row_lse = log_total + maximum
        losses.copy_(torch.where(valid, log_total - target, 0.0))
        lse.copy_(torch.where(valid, row_lse, 0.0))
        if grad is not None:
            # softmax·(w + 2·z_loss·lse) - w·onehot (the one on the rank that holds the
            # label), w the label weight, times scale, on the counted rows.
            factor = torch.where(valid, (label_weight + 2.0 * z_loss * row_lse) * scale, 0.0)
            g = exponentials.div_(total.unsqueeze(-1)).mul_(factor.unsqueeze(-1))
            onehot = torch.where(here, label_weight * scale, 0.0)
            grad.copy_(g.scatter_add_(1, local, -onehot.unsqueeze(-1)))

    return rows


def _label_rows(tensor: TensorDimension) -> RowLogProbs:
    rows = _cross_entropy_rows(tensor, IGNORED, 1.0, 0.0)

    def log_prob_rows(logits: Tensor, grad: Tensor | None, labels: Tensor, out: Tensor) -> None:
        ones = torch.ones((), dtype=torch.float32, device=logits.device)
        rows(logits, grad, labels, out, torch.empty_like(out), ones)

    return log_prob_rows


def _distillation_rows(
    tensor: TensorDimension, inverse_temperature: float, loss_type: str
) -> RowDistillation:
    kind = DISTILLATION_LOSS_TYPES.index(loss_type)

    def rows(
        student: Tensor,
        teacher: Tensor,
        grad: Tensor | None,
        mask: Tensor,
        losses: Tensor,
        scale: Tensor,
    ) -> None:
        a, b = student * inverse_temperature, teacher * inverse_temperature
        maxima = torch.stack([a.max(dim=-1).values, b.max(dim=-1).values])
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=tensor.group)
        a, b = a.sub_(maxima[0].unsqueeze(-1)), b.sub_(maxima[1].unsqueeze(-1))
        e_s, e_t = a.exp(), b.exp()
        # The weighted sum of each divergence (see distillation.py), unnormalized.
        weighted = (e_s * (a - b)) if kind == 1 else (e_t * (b - a)) if kind == 0 else (e_t * a)
        sums = torch.stack([e_s.sum(dim=-1), e_t.sum(dim=-1), weighted.sum(dim=-1)])
        dist.all_reduce(sums, group=tensor.group)
        sum_s, sum_t, weighted_sum = sums
        log_sum_s, log_sum_t = sum_s.log(), sum_t.log()
        if kind == 1:
            loss = weighted_sum / sum_s - log_sum_s + log_sum_t
        elif kind == 0:
            loss = weighted_sum / sum_t - log_sum_t + log_sum_s
        else:
            loss = log_sum_s - weighted_sum / sum_t
        losses.copy_(torch.where(mask, loss, 0.0))
        if grad is not None:
            p_s = e_s.div_(sum_s.unsqueeze(-1))
            if kind == 1:
                log_ratio = (a - log_sum_s.unsqueeze(-1)) - (b - log_sum_t.unsqueeze(-1))
                g = p_s * (log_ratio - loss.unsqueeze(-1))
            else:
                g = p_s - e_t.div_(sum_t.unsqueeze(-1))
            g = torch.where(mask.unsqueeze(-1), g * (scale * inverse_temperature), 0.0)
            grad.copy_(g)

    return rows


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])
