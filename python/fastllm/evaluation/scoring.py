"""The log-probability of chosen tokens under a linear head, without the logits of a batch: only
the positions that are scored go through the head, a chunk of rows at a time."""

from __future__ import annotations

import torch
from torch import Tensor

from fastllm_kernels.linear import matmul_into_fp32_

LOGITS_BUDGET = 1 << 26
"""fp32 logits per chunk (256 MiB): a few thousand rows of a 128K vocabulary."""


@torch.no_grad()
def token_log_probs(hidden: Tensor, weight: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """For hidden states (N, H) and a head `weight` (V, H): the fp32 log-probability of each
    row's target (N,) and whether the target is the row's most likely token (lm-eval's
    `is_greedy`, token by token). Not differentiable."""
    count, vocab = hidden.shape[0], weight.shape[0]
    log_probs = torch.empty(count, dtype=torch.float32, device=hidden.device)
    greedy = torch.empty(count, dtype=torch.bool, device=hidden.device)
    rows = max(1, LOGITS_BUDGET // vocab)
    for start in range(0, count, rows):
        chunk = slice(start, min(start + rows, count))
        logits = torch.empty(chunk.stop - start, vocab, dtype=torch.float32, device=hidden.device)
        matmul_into_fp32_(logits, hidden[chunk], weight.T, accumulate=False)
        target = targets[chunk, None]
        log_probs[chunk] = (logits.gather(1, target) - logits.logsumexp(1, keepdim=True))[:, 0]
        greedy[chunk] = logits.argmax(1) == target[:, 0]
    return log_probs, greedy
