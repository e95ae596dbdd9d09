"""The log-probability of chosen tokens under a linear head, without the logits of a batch: only
the positions that are scored go through the head, a chunk of rows at a time; under tensor
parallelism each rank forms its vocabulary slice's logits, and the per-row values that need the
whole vocabulary are all-reduced over the tensor ranks, as the vocab-parallel losses do
(`fastllm.parallel.vocab_parallel_losses`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from fastllm.parallel.tensor import TensorDimension
from fastllm_kernels.linear import matmul_into_fp32_

LOGITS_BUDGET = 1 << 26
"""fp32 logits per chunk (256 MiB): a few thousand rows of a 128K vocabulary."""


@torch.no_grad()
def token_log_probs(
    hidden: Tensor, weight: Tensor, targets: Tensor, tensor: TensorDimension | None = None
) -> tuple[Tensor, Tensor]:
    """For hidden states (N, H) and a head `weight` (V, H): the fp32 log-probability of each
    row's target (N,) and whether the target is the row's most likely token (lm-eval's
    `is_greedy`, token by token). With `tensor` split, `weight` is this rank's contiguous
    vocabulary slice (V / size, H) and every tensor rank gets the same values. Not
    differentiable."""
    count, vocab = hidden.shape[0], weight.shape[0]
    log_probs = torch.empty(count, dtype=torch.float32, device=hidden.device)
    greedy = torch.empty(count, dtype=torch.bool, device=hidden.device)
    rows = max(1, LOGITS_BUDGET // vocab)
    for start in range(0, count, rows):
        chunk = slice(start, min(start + rows, count))
        logits = torch.empty(chunk.stop - start, vocab, dtype=torch.float32, device=hidden.device)
        matmul_into_fp32_(logits, hidden[chunk], weight.T, accumulate=False)
        if tensor is not None and tensor.split:
            log_probs[chunk], greedy[chunk] = _vocab_parallel(logits, targets[chunk], tensor)
            continue
        target = targets[chunk, None]
        log_probs[chunk] = (logits.gather(1, target) - logits.logsumexp(1, keepdim=True))[:, 0]
        greedy[chunk] = logits.argmax(1) == target[:, 0]
    return log_probs, greedy


def _vocab_parallel(
    logits: Tensor, targets: Tensor, tensor: TensorDimension
) -> tuple[Tensor, Tensor]:
    """The rows' target log-probabilities and greediness from each rank's slice of `logits`."""
    vocab, group = logits.shape[1], tensor.group
    maximum = logits.max(1).values
    dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - maximum[:, None]
    local = targets - tensor.rank * vocab
    here = (local >= 0) & (local < vocab)
    target = shifted.gather(1, local.clamp(0, vocab - 1)[:, None])[:, 0]
    sums = torch.stack([shifted.exp().sum(1), torch.where(here, target, 0.0)])
    dist.all_reduce(sums, group=group)  # sums of exponentials, target logits
    # argmax's token: the first of the whole vocabulary to reach the maximum.
    at_maximum = shifted == 0
    first = torch.where(
        at_maximum.any(1),
        at_maximum.int().argmax(1) + tensor.rank * vocab,
        torch.iinfo(torch.long).max,
    )
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    return sums[1] - sums[0].log(), first == targets
