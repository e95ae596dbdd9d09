"""Sequence log-probabilities and the DPO loss of a linear head, without the (tokens, vocab)
logits ever existing whole.

Tokens belong to spans: `spans[i]` is the id of the sequence token i's label counts for, or -1
(a prompt token, padding: not counted). A span's log-probability is the sum of log p(label)
over its tokens. Only the counted rows go through the head (gathered first: in DPO the prompt
is a third of the tokens or more), chunk by chunk: cuBLAS computes a chunk's fp32 logits and
the cross-entropy row kernel (cross_entropy.py) gives each row's -log p(label) and, in the same
launch, its logit gradient softmax - onehot.

DPO (Rafailov et al. 2023) pairs the spans: 2p is the chosen answer of pair p, 2p + 1 its
rejected one. With π and ref the policy's and the reference's span log-probabilities and
m = (π_c - ref_c) - (π_r - ref_r), a pair's loss is, as TRL computes it:
- "sigmoid": -(1 - ε)·logσ(β·m) - ε·logσ(-β·m) (ε = label_smoothing: conservative DPO);
- "ipo": (m' - 1/(2β))², with m' the difference of the log-ratios divided by their spans' token
  counts (TRL's normalization, which the IPO authors confirm their results use).
The loss is the mean over pairs. Its gradient is formed in the one pass over the logits: chunks
hold whole pairs (a pair longer than the chunk budget gets a chunk of its own), so when a
chunk's row kernel has run, its pairs' log-probabilities are complete and dL/dπ of each of its
spans is known. The logit gradient of row i is -dL/dπ_span(i) · (softmax - onehot); the factor
is folded in on the hidden side (the chunk's hidden rows are scaled before the weight-gradient
matmul, the hidden-gradient rows after theirs), not by another pass over the logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from fastllm_kernels._dispatch import use_triton
from fastllm_kernels.cross_entropy import cross_entropy_rows, default_chunk_size
from fastllm_kernels.linear import matmul_into_fp32_
from fastllm_kernels.precomputed_gradients import with_precomputed_gradients

DPO_LOSS_TYPES = ("sigmoid", "ipo")

RowLogProbs = Callable[[Tensor, Tensor | None, Tensor, Tensor], None]
"""rows(logits, grad, labels, out): for the rows of fp32 `logits` (chunk, vocab or a vocab
slice), -log p(label) into `out` and, unless `grad` is None, d(-log p(label)) / d logits =
softmax - onehot into `grad` (which may alias the logits, as in cross_entropy_rows)."""


def linear_sequence_log_probs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    spans: Tensor,
    num_spans: int,
    *,
    chunk_size: int | None = None,
) -> Tensor:
    """(num_spans,) fp32: each span's sum of log p(label) under hidden (N, H) @ weight (V, H).T,
    spans (N,) holding span ids in [0, num_spans) or -1 (not counted); labels of counted tokens
    must be vocabulary ids. Not differentiable (the reference model's log-probabilities)."""
    hidden, labels, spans = _as_rows(hidden, labels, spans)
    if use_triton(hidden, weight, labels):
        chunk_size = chunk_size or default_chunk_size(weight.shape[0])
        return chunked_sequence_log_probs(
            hidden, weight, labels, spans, num_spans, chunk_size, _triton_rows
        )
    return linear_sequence_log_probs_reference(hidden, weight, labels, spans, num_spans).detach()


def linear_sequence_log_probs_reference(
    hidden: Tensor, weight: Tensor, labels: Tensor, spans: Tensor, num_spans: int
) -> Tensor:
    hidden, labels, spans = _as_rows(hidden, labels, spans)
    counted = spans >= 0
    log_probs = torch.log_softmax(hidden.float() @ weight.float().T, dim=-1)
    token = log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    sums = torch.zeros(num_spans, dtype=torch.float32, device=hidden.device)
    return sums.index_add(0, spans[counted], token[counted])


def linear_dpo(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    spans: Tensor,
    reference_log_probs: Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
    *,
    chunk_size: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The mean DPO loss over the P pairs of spans (2p chosen, 2p + 1 rejected; -1 not
    counted) of hidden (N, H) @ weight (V, H).T against labels (N,), given the reference's span
    log-probabilities (2P,); a 0-d fp32 tensor differentiable in hidden and weight, and TRL's
    metrics (`dpo_metrics`). One host synchronization plans the chunks."""
    hidden, labels, spans = _as_rows(hidden, labels, spans)
    check_dpo(reference_log_probs, beta, label_smoothing, loss_type)
    options = (beta, label_smoothing, loss_type)
    if use_triton(hidden, weight, labels):
        chunk_size = chunk_size or default_chunk_size(weight.shape[0])
        reference = reference_log_probs.float()

        def compute(need_hidden: bool, need_weight: bool):
            return chunked_dpo(hidden, weight, labels, spans, reference, *options, chunk_size,
                               need_hidden, need_weight, _triton_rows)  # fmt: skip

        loss, policy = with_precomputed_gradients(hidden, weight, compute)
        assert policy is not None
        return loss, dpo_metrics(policy, reference, beta)
    return linear_dpo_reference(hidden, weight, labels, spans, reference_log_probs, *options)


def linear_dpo_reference(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    spans: Tensor,
    reference_log_probs: Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> tuple[Tensor, dict[str, Tensor]]:
    """The DPO paper's formula (and TRL's variants) on whole fp32 logits, through autograd."""
    hidden, labels, spans = _as_rows(hidden, labels, spans)
    check_dpo(reference_log_probs, beta, label_smoothing, loss_type)
    num_spans = reference_log_probs.shape[0]
    policy = linear_sequence_log_probs_reference(hidden, weight, labels, spans, num_spans)
    reference = reference_log_probs.float()
    ratios = (policy - reference).view(-1, 2)
    if loss_type == "sigmoid":
        logits = beta * (ratios[:, 0] - ratios[:, 1])
        losses = -(1 - label_smoothing) * F.logsigmoid(logits)
        losses = losses - label_smoothing * F.logsigmoid(-logits)
    else:
        tokens = torch.bincount(spans[spans >= 0], minlength=num_spans).view(-1, 2).clamp(min=1)
        normalized = ratios[:, 0] / tokens[:, 0] - ratios[:, 1] / tokens[:, 1]
        losses = (normalized - 1 / (2 * beta)) ** 2
    return losses.mean(), dpo_metrics(policy.detach(), reference, beta)


DPO_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
"""TRL's names of `dpo_metrics`, in its order."""


def dpo_metrics(
    policy_log_probs: Tensor, reference_log_probs: Tensor, beta: float
) -> dict[str, Tensor]:
    """TRL's DPO metrics over the pairs, as detached 0-d tensors (means over pairs)."""
    policy = policy_log_probs.detach().float().view(-1, 2)
    rewards = beta * (policy - reference_log_probs.detach().float().view(-1, 2))
    chosen, rejected = rewards[:, 0], rewards[:, 1]
    return {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/accuracies": (chosen > rejected).float().mean(),
        "rewards/margins": (chosen - rejected).mean(),
        "logps/chosen": policy[:, 0].mean(),
        "logps/rejected": policy[:, 1].mean(),
    }


def chunked_sequence_log_probs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    spans: Tensor,
    num_spans: int,
    chunk_size: int,
    rows: RowLogProbs,
) -> Tensor:
    """`linear_sequence_log_probs` with the row computation given (the vocab-parallel form
    gives its own): only the counted rows, `chunk_size` at a time."""
    with torch.no_grad():
        sums = torch.zeros(num_spans, dtype=torch.float32, device=hidden.device)
        counted = (spans >= 0).nonzero().squeeze(1)
        n_rows = counted.numel()
        if n_rows == 0:
            return sums
        span_ids = spans[counted]
        if int(span_ids.max()) >= num_spans:
            raise ValueError(f"spans: ids must be below num_spans ({num_spans})")
        chunk_size = max(1, min(chunk_size, n_rows))
        logits_buffer = torch.empty(
            (chunk_size, weight.shape[0]), dtype=torch.float32, device=hidden.device
        )
        negative = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
        for start in range(0, n_rows, chunk_size):
            index = counted[start : start + chunk_size]
            logits = logits_buffer[: index.numel()]
            matmul_into_fp32_(logits, hidden[index], weight.T, accumulate=False)
            rows(logits, None, labels[index], negative[start : start + index.numel()])
        return sums.index_add_(0, span_ids, negative, alpha=-1.0)


def chunked_dpo(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    spans: Tensor,
    reference: Tensor,
    beta: float,
    label_smoothing: float,
    loss_type: str,
    chunk_size: int,
    need_hidden_grad: bool,
    need_weight_grad: bool,
    rows: RowLogProbs,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """(loss, policy span log-probabilities (2P,), hidden gradient, fp32 weight gradient) of
    `linear_dpo`, with the row computation given (the vocab-parallel form gives its own)."""
    device, vocab = hidden.device, weight.shape[0]
    num_spans = reference.shape[0]
    counted = (spans >= 0).nonzero().squeeze(1)
    # The counted rows grouped by pair (in their order within a pair), so that chunks can end
    # at pair boundaries.
    rows_index = counted[torch.argsort(spans[counted] // 2, stable=True)]
    span_ids = spans[rows_index]
    tokens = torch.bincount(span_ids, minlength=num_spans)
    if tokens.shape[0] > num_spans:
        raise ValueError(f"spans: ids must be below 2 × pairs ({num_spans})")
    chunks = _pair_chunks(tokens.view(-1, 2).sum(1).tolist(), chunk_size)
    policy = torch.zeros(num_spans, dtype=torch.float32, device=device)
    negative = torch.empty(rows_index.numel(), dtype=torch.float32, device=device)
    need_grad = need_hidden_grad or need_weight_grad
    grad_hidden = torch.zeros_like(hidden) if need_hidden_grad else None
    grad_weight = None
    if need_weight_grad:
        grad_weight = torch.empty(weight.shape, dtype=torch.float32, device=device)
        if not chunks:
            grad_weight.zero_()
    largest = max((end - start for _, _, start, end in chunks), default=0)
    logits_buffer = torch.empty((largest, vocab), dtype=torch.float32, device=device)
    grad_buffer = None
    if need_grad:
        grad_buffer = logits_buffer
        if hidden.dtype != torch.float32:
            grad_buffer = logits_buffer.view(hidden.dtype)[:, :vocab]
    counts = tokens.float().clamp(min=1.0)
    for number, (first_pair, end_pair, start, end) in enumerate(chunks):
        index = rows_index[start:end]
        chunk_hidden = hidden[index]
        logits = logits_buffer[: end - start]
        matmul_into_fp32_(logits, chunk_hidden, weight.T, accumulate=False)
        grad_logits = None if grad_buffer is None else grad_buffer[: end - start]
        rows(logits, grad_logits, labels[index], negative[start:end])
        chunk_spans = span_ids[start:end]
        policy.index_add_(0, chunk_spans, negative[start:end], alpha=-1.0)
        if not need_grad:
            continue
        # The chunk holds pairs first_pair … end_pair - 1 whole: their log-probabilities are
        # complete, and so is dL/dπ of their spans.
        pair_spans = slice(2 * first_pair, 2 * end_pair)
        _, derivative = _dpo_pair_terms(policy[pair_spans], reference[pair_spans],
                                        counts[pair_spans], beta, label_smoothing, loss_type)  # fmt: skip
        # d loss / d logits = -dL/dπ · (softmax - onehot), and the kernel gave the latter.
        factor = -derivative[chunk_spans - 2 * first_pair] / (num_spans // 2)
        if need_hidden_grad:
            product = torch.empty(
                (end - start, hidden.shape[1]), dtype=torch.float32, device=device
            )
            matmul_into_fp32_(product, grad_logits, weight, accumulate=False)
            grad_hidden.index_copy_(0, index, product.mul_(factor[:, None]).to(hidden.dtype))
        if need_weight_grad:
            scaled = (chunk_hidden.float() * factor[:, None]).to(hidden.dtype)
            matmul_into_fp32_(grad_weight, grad_logits.T, scaled, accumulate=number > 0)
    pair_losses, _ = _dpo_pair_terms(policy, reference, counts, beta, label_smoothing, loss_type)
    return pair_losses.mean(), policy, grad_hidden, grad_weight


def _dpo_pair_terms(
    policy: Tensor,
    reference: Tensor,
    counts: Tensor,
    beta: float,
    label_smoothing: float,
    loss_type: str,
) -> tuple[Tensor, Tensor]:
    """Each pair's loss (pairs,) and its derivative with respect to the policy's span
    log-probabilities (2 × pairs,), from those of the pairs' spans (chosen, rejected, ...)."""
    ratios = (policy - reference).view(-1, 2)
    if loss_type == "sigmoid":
        logits = beta * (ratios[:, 0] - ratios[:, 1])
        losses = -(1 - label_smoothing) * F.logsigmoid(logits)
        losses -= label_smoothing * F.logsigmoid(-logits)
        slope = beta * (label_smoothing * torch.sigmoid(logits)
                        - (1 - label_smoothing) * torch.sigmoid(-logits))  # fmt: skip
        derivative = torch.stack([slope, -slope], dim=1)
    else:
        tokens = counts.view(-1, 2)
        excess = ratios[:, 0] / tokens[:, 0] - ratios[:, 1] / tokens[:, 1] - 1 / (2 * beta)
        losses = excess**2
        derivative = torch.stack([2 * excess / tokens[:, 0], -2 * excess / tokens[:, 1]], dim=1)
    return losses, derivative.view(-1)


def _pair_chunks(pair_rows: list[int], chunk_size: int) -> list[tuple[int, int, int, int]]:
    """(first pair, end pair, first row, end row) of each chunk: consecutive pairs whose rows
    fit `chunk_size`, or one pair alone when its rows do not. Pairs without rows add none."""
    chunks: list[tuple[int, int, int, int]] = []
    first_pair = row = start = 0
    for pair, size in enumerate(pair_rows):
        if row > start and row + size - start > chunk_size:
            chunks.append((first_pair, pair, start, row))
            first_pair, start = pair, row
        row += size
    if row > start:
        chunks.append((first_pair, len(pair_rows), start, row))
    return chunks


def _triton_rows(logits: Tensor, grad: Tensor | None, labels: Tensor, out: Tensor) -> None:
    ones = torch.ones((), dtype=torch.float32, device=logits.device)
    cross_entropy_rows(logits, grad, labels, out, ones)


def check_dpo(reference: Tensor, beta: float, label_smoothing: float, loss_type: str) -> None:
    """ValueError naming the argument that `linear_dpo` cannot take."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, not {loss_type!r}")
    if reference.dim() != 1 or reference.shape[0] % 2:
        raise ValueError(
            f"reference_log_probs must be (2 × pairs,): chosen, rejected per pair; got {tuple(reference.shape)}"
        )
    if beta <= 0:
        raise ValueError(f"beta must be positive, not {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), not {label_smoothing}")
    if loss_type == "ipo" and label_smoothing:
        raise ValueError("label_smoothing applies to the sigmoid loss only, not to ipo")


def _as_rows(hidden: Tensor, labels: Tensor, spans: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1), spans.reshape(-1).long()
