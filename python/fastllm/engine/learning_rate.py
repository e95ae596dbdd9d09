"""Learning-rate schedules: warmup, then constant, linear, cosine or warmup-stable-decay, or
the shape of a `learning_rate` component of another package.

The contract of a `learning_rate` component (config/registry.py): its implementation is a
function `rate(config, step, train_iters) -> float`, the learning rate of optimizer step `step`
(0-based, at or after `config.warmup_iterations`) of a run of `train_iters` steps; the warmup
before it is everyone's."""

from __future__ import annotations

import math

from fastllm.config import registry
from fastllm.config.training import LearningRateConfig


def learning_rate(config: LearningRateConfig, step: int, train_iters: int) -> float:
    """The learning rate of optimizer step `step` (0-based) of a run of `train_iters` steps."""
    if step < config.warmup_iterations:
        return config.base * (step + 1) / config.warmup_iterations
    return float(registry.implementation(config)(config, step, train_iters))


def constant(config: LearningRateConfig, step: int, train_iters: int) -> float:
    return config.base


def linear(config: LearningRateConfig, step: int, train_iters: int) -> float:
    progress = _decay_progress(config, step, train_iters)
    return config.base - (config.base - config.minimum) * progress


def cosine(config: LearningRateConfig, step: int, train_iters: int) -> float:
    progress = _decay_progress(config, step, train_iters)
    return config.minimum + (config.base - config.minimum) * 0.5 * (
        1 + math.cos(math.pi * progress)
    )


def warmup_stable_decay(config: LearningRateConfig, step: int, train_iters: int) -> float:
    base, minimum, warmup = config.base, config.minimum, config.warmup_iterations
    decay = config.decay_iterations or max(1, round(0.2 * train_iters))
    start = max(warmup, train_iters - decay)
    if step < start:
        return base
    progress = min(1.0, (step - start + 1) / decay)
    return base - (base - minimum) * progress


def _decay_progress(config: LearningRateConfig, step: int, train_iters: int) -> float:
    """How far the decay after the warmup is at `step`: 0 to 1."""
    warmup = config.warmup_iterations
    decay = config.decay_iterations or max(1, train_iters - warmup)
    return min(1.0, (step - warmup + 1) / decay)
