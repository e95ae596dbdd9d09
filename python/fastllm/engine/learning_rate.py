"""Learning-rate schedules: warmup, then constant, linear, cosine or warmup-stable-decay; and
the schedules of a run's phases one after the other."""

from __future__ import annotations

import math

import msgspec

from fastllm.config.training import LearningRateConfig, PhaseConfig


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
        config = LearningRateConfig(**{**msgspec.structs.asdict(schedule), "base": base})
        begin = start
    return learning_rate(config, step - begin, end - begin)
