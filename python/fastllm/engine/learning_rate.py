"""Learning-rate schedules: warmup, then constant, linear, cosine or warmup-stable-decay."""

from __future__ import annotations

import math

from fastllm.config.training import LearningRateConfig


def learning_rate(config: LearningRateConfig, step: int, train_iters: int) -> float:
    """The learning rate of optimizer step `step` (0-based) of a run of `train_iters` steps."""
    base, minimum, warmup = config.base, config.minimum, config.warmup_iterations
    if step < warmup:
        return base * (step + 1) / warmup
    if config.decay_style == "constant":
        return base
    if config.decay_style == "wsd":
        decay = config.decay_iterations or max(1, round(0.2 * train_iters))
        start = max(warmup, train_iters - decay)
        if step < start:
            return base
        progress = min(1.0, (step - start + 1) / decay)
        return base - (base - minimum) * progress
    decay = config.decay_iterations or max(1, train_iters - warmup)
    progress = min(1.0, (step - warmup + 1) / decay)
    if config.decay_style == "linear":
        return base - (base - minimum) * progress
    return minimum + (base - minimum) * 0.5 * (1 + math.cos(math.pi * progress))
