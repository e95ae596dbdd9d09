"""Learning-rate schedules: warmup, then constant, linear, cosine or warmup-stable-decay, or
the shape of a `learning_rate` component of another package; and the schedules of a run's
phases one after the other.

The contract of a `learning_rate` component (config/registry.py): its implementation is a
function `rate(config, step, train_iters) -> float`, the learning rate of optimizer step `step`
(0-based, at or after `config.warmup_iterations`) of a run of `train_iters` steps; the warmup
before it is everyone's."""

from __future__ import annotations

import math

import msgspec

from fastllm.config import registry
from fastllm.config.training import LearningRateConfig, PhaseConfig


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


def phased_learning_rate(
    config: LearningRateConfig, phases: list[PhaseConfig], step: int, train_iters: int
) -> float:
    """The learning rate of optimizer step `step` (0-based) of a run of `train_iters` steps
    whose `phases` may switch schedules: `config` runs from step 0, and each phase that sets a
    learning rate runs its own from its `begin_step` to the next such phase (or the end),
    from the learning rate of the step before it when it sets no base."""
    begin, end = 0, train_iters
    for phase in phases:
        schedule, start = phase.learning_rate, phase.begin_step
        if schedule is None:
            continue
        if step < start:
            end = start
            break
        base = schedule.base
        if base is None:  # the last step's before the phase
            base = learning_rate(config, start - 1 - begin, start - begin)
        config = msgspec.structs.replace(schedule, base=base)
        begin = start
    return learning_rate(config, step - begin, end - begin)
