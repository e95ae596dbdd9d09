"""`training.evaluators`: what a run measures besides its training loss, each under its own
name and at its own interval, in Fast-LLM's shape:
`evaluators: {NAME: {interval, offset, evaluator: {type: loss, iterations, dataset_name}}}`.

An evaluator type is a variant of `EvaluatorConfig` (its `type`), listed in `Evaluator`, with
one runner in `fastllm.training.evaluators`."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import msgspec

from fastllm.config.section import ConfigError, Section, check_non_negative, check_positive

if TYPE_CHECKING:
    from fastllm.config.trainer import TrainerConfig

VALIDATION = "validation"
"""The name of `training.validation`'s evaluator (its loss is validation_loss)."""


class EvaluatorConfig(Section, tag_field="type"):
    """What an evaluator measures, by its `type`."""


class LossEvaluatorConfig(EvaluatorConfig, tag="loss"):
    """The mean loss over the trained tokens of a held-out dataset of `data.datasets`, on the
    model being trained (forward passes only, under the run's layout)."""

    iterations: int = 10
    """Batches (of batch.batch_size sequences) per evaluation."""
    dataset_name: str | None = None
    """The dataset of `data.datasets` it reads; default: the evaluator's name."""

    def validate(self) -> None:
        check_positive(self.iterations, "iterations")

    def dataset(self, name: str) -> str:
        """The name of the dataset it reads, as the evaluator `name`."""
        return name if self.dataset_name is None else self.dataset_name


Evaluator = LossEvaluatorConfig
"""Every evaluator type (a union of the variants, chosen by `type`)."""


class TrainingEvaluatorConfig(Section):
    """An evaluator run during training, at its interval."""

    interval: int | None = None
    """Steps between two evaluations (none: never)."""
    offset: int = 0
    """Evaluations run after the steps offset + k × interval (k = 0, 1, …; there is no step
    0): offset 5 and interval 10 evaluate after steps 5, 15, 25…"""
    evaluator: Evaluator = msgspec.field(default_factory=LossEvaluatorConfig)
    """What it measures."""

    def validate(self) -> None:
        check_positive(self.interval, "interval")
        check_non_negative(self.offset, "offset")

    def due(self, step: int) -> bool:
        """Whether it runs after `step` (1-based, steps completed)."""
        interval, offset = self.interval, self.offset
        return interval is not None and step >= offset and (step - offset) % interval == 0


_NAME = re.compile(r"[A-Za-z_][\w-]*")
"""An evaluator's or a dataset's name: a key of the command line's overrides
(`training.evaluators.NAME.interval=…`) and part of metric names."""


def _check_name(name: str, key: str) -> None:
    if not _NAME.fullmatch(name):
        raise ConfigError(
            key, f"{name!r} is not a name (a letter or _, then letters, digits, _ and -)"
        )


def check_evaluators(config: TrainerConfig) -> None:
    """Names are plain words, each loss evaluator reads a dataset of `data.datasets`, and no
    evaluator takes the name of `training.validation`'s while that one runs."""
    for name in config.data.datasets:
        _check_name(name, "data.datasets")
    for name, evaluator in config.training.evaluators.items():
        _check_name(name, "training.evaluators")
        key = f"training.evaluators.{name}"
        if name == VALIDATION and config.training.validation.interval is not None:
            raise ConfigError(
                key,
                "is the name training.validation logs under (validation_loss), and "
                "training.validation.interval is set: rename this evaluator",
            )
        kind = evaluator.evaluator
        if isinstance(kind, LossEvaluatorConfig):
            named = ", ".join(config.data.datasets) or "none"
            if kind.dataset_name is None and name not in config.data.datasets:
                raise ConfigError(
                    f"{key}.evaluator.dataset_name",
                    f"is not set and data.datasets has no dataset named {name!r}, the "
                    f"evaluator's name (it has: {named})",
                )
            if kind.dataset_name is not None and kind.dataset_name not in config.data.datasets:
                raise ConfigError(
                    f"{key}.evaluator.dataset_name",
                    f"{kind.dataset_name!r} is not in data.datasets (it has: {named})",
                )
