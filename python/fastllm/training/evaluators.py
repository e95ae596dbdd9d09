"""The evaluators of a run: `training.evaluators`, and `training.validation` as the one named
validation. Each runs after the steps of its interval and offset, on the model being trained,
and gives metrics that the run logs under its name (NAME_METRIC: a loss evaluator named wiki
logs wiki_loss). One runner class per evaluator type; `evaluations` makes a run's."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastllm.config.evaluation import VALIDATION, LossEvaluatorConfig, TrainingEvaluatorConfig
from fastllm.data import SampleStream

if TYPE_CHECKING:
    from fastllm.training.trainer import Trainer


class Evaluation(ABC):
    """An evaluator of the run, named `name`, run at its `schedule`."""

    def __init__(self, name: str, schedule: TrainingEvaluatorConfig) -> None:
        self.name = name
        self.schedule = schedule

    def due(self, step: int) -> bool:
        """Whether it runs after `step`."""
        return self.schedule.due(step)

    @abstractmethod
    def prepare(self, stop: Callable[[], bool]) -> None:
        """What it can do before the first step, so that its inputs are refused then and not
        at its first evaluation; `stop` (this rank's signal) ends it with `BuildStopped`."""

    @abstractmethod
    def run(self, stop: Callable[[], bool]) -> dict[str, float] | None:
        """Its metrics, by name without the evaluator's; None when `stop` (asked by every
        rank at the same points) said to stop. Every rank calls it after the same step."""


class LossEvaluation(Evaluation):
    """The mean loss over the trained tokens of `iterations` batches of held-out datasets,
    through the engine's `evaluate` (any layout): the same batches each time, so that
    evaluations compare."""

    def __init__(
        self,
        trainer: Trainer,
        name: str,
        schedule: TrainingEvaluatorConfig,
        iterations: int,
        paths: list[str],
        key: str,
    ) -> None:
        super().__init__(name, schedule)
        self._trainer, self._iterations = trainer, iterations
        self._paths, self._key = paths, key
        self._stream: SampleStream | None = None

    def prepare(self, stop: Callable[[], bool]) -> None:
        self.samples(stop)

    def samples(self, stop: Callable[[], bool] | None = None) -> SampleStream:
        """Its samples, made (and their datasets checked) once; `stop` ends the building of
        the sampling index (`BuildStopped`)."""
        if self._stream is None:
            samples = self._iterations * self._trainer.config.batch.batch_size
            self._stream = self._trainer.sample_stream(self._paths, samples, self._key, stop)
        return self._stream

    def run(self, stop: Callable[[], bool]) -> dict[str, float] | None:
        stream = self.samples()
        if stop():
            return None
        batches = [b for step in self._trainer.loader(stream) for b in step]
        loss = self._trainer.engine.evaluate(batches, stop)
        return None if loss is None else {"loss": loss}


def evaluations(trainer: Trainer) -> dict[str, Evaluation]:
    """The run's evaluators by name, in the config's order after `training.validation`'s (the
    one named validation, when there is validation data)."""
    config = trainer.config
    found: dict[str, Evaluation] = {}
    validation = config.training.validation
    if config.data.validation_path:
        schedule = TrainingEvaluatorConfig(interval=validation.interval)
        found[VALIDATION] = LossEvaluation(
            trainer,
            VALIDATION,
            schedule,
            validation.iterations,
            config.data.validation_path,
            "data.validation_path",
        )
    for name, schedule in config.training.evaluators.items():
        evaluator = schedule.evaluator
        match evaluator:
            case LossEvaluatorConfig():
                dataset = evaluator.dataset(name)
                paths = config.data.datasets[dataset].path
                key = f"data.datasets.{dataset}.path"
                found[name] = LossEvaluation(
                    trainer, name, schedule, evaluator.iterations, paths, key
                )
    return found
