"""The label-smoothed cross-entropy: a `head_loss` component, from the final-normed hidden
states and the head's weight."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from fastllm.model.gpt import GPTModel
from fastllm.model.head_losses import IGNORED, HeadTargets
from fastllm_example_plugin.config import LabelSmoothingLossConfig


def label_smoothing_loss(
    config: LabelSmoothingLossConfig, model: GPTModel, hidden: Tensor, targets: HeadTargets
) -> Tensor:
    """The mean over the trained tokens of (1 - s) · (−log p(label)) + s · mean(−log p), the
    logits of the trained rows formed whole (a fused chunked head would spare their memory)."""
    labels = targets.labels.reshape(-1)
    trained = labels != IGNORED
    logits = F.linear(hidden[trained], model.head_weight).float()
    log_probs = logits.log_softmax(-1)
    label = -log_probs.gather(-1, labels[trained, None]).squeeze(-1)
    spread = -log_probs.mean(-1)
    per_token = (1.0 - config.smoothing) * label + config.smoothing * spread
    return per_token.sum() / trained.sum().clamp(min=1)
