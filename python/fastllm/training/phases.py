"""A run's `training.phases` in the loop: their loaders one after the other, and the line a
run prints when a phase begins."""

from __future__ import annotations

from collections.abc import Iterator

from fastllm.config import TrainerConfig
from fastllm.config.phases import data_phases
from fastllm.data import Batch, DataLoader
from fastllm.engine.learning_rate import phased_learning_rate


class PhasedLoader:
    """The steps of `loaders` (one per blend of the run, from the current step on), one loader
    after the other: each starts its background thread once the one before is done."""

    def __init__(self, loaders: list[DataLoader]) -> None:
        self.loaders = loaders

    def __iter__(self) -> Iterator[list[Batch]]:
        for loader in self.loaders:
            yield from loader


def describe_phase(config: TrainerConfig, index: int) -> str:
    """What phase `index` of `training.phases` switches, with the learning rates its schedule
    runs through."""
    training = config.training
    phase = training.phases[index]
    parts = [f"phase {index + 1} (training.phases[{index}]) begins after step {phase.begin_step}"]
    if phase.data is not None:
        (blend,) = [p for p in data_phases(config) if p.begin_step == phase.begin_step]
        weights = "by token counts" if blend.weights is None else f"weights {blend.weights}"
        parts.append(f"data {blend.path}, {weights}")
    if phase.learning_rate is not None:
        end = next(
            (
                later.begin_step
                for later in training.phases[index + 1 :]
                if later.learning_rate is not None
            ),
            training.train_iters,
        )

        def lr(step: int) -> float:
            return phased_learning_rate(
                config.optimizer.learning_rate, training.phases, step, training.train_iters
            )

        parts.append(
            f"learning rate {lr(phase.begin_step):.3g} at step {phase.begin_step + 1} to "
            f"{lr(end - 1):.3g} at step {end} ({phase.learning_rate.decay_style})"
        )
    return "; ".join(parts)
