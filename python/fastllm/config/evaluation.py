"""`training.evaluators`: what a run measures besides its training loss, each under its own
name and at its own interval, in Fast-LLM's shape:
`evaluators: {NAME: {interval, offset, evaluator: {type: loss, iterations, dataset_name}}}`,
or `evaluator: {type: lm_eval, tasks, …}` (lm-evaluation-harness tasks, the class that
`fastllm evaluate`'s evaluators are too).

An evaluator type is a component of the extension point `evaluator` (a subclass of
`EvaluatorConfig`, config/registry.py), whose implementation (an `Evaluation` of
`fastllm.training.evaluators`) is built as `Evaluation(trainer, name, schedule, config)`."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import msgspec

from fastllm.config.registry import Component
from fastllm.config.section import ConfigError, Section, check_non_negative, check_positive

if TYPE_CHECKING:
    from fastllm.config.trainer import TrainerConfig

VALIDATION = "validation"
"""The name of `training.validation`'s evaluator (its loss is validation_loss)."""


class EvaluatorConfig(Component):
    """What an evaluator measures, by its `type`."""

    point = "evaluator"


class LossEvaluatorConfig(EvaluatorConfig, tag="loss"):
    """The mean loss over the trained tokens of a held-out dataset of `data.datasets`, on the
    model being trained (forward passes only, under the run's layout)."""

    implementation = "fastllm.training.evaluators:loss_evaluation"

    iterations: int = 10
    """Batches (of batch.batch_size sequences) per evaluation."""
    dataset_name: str | None = None
    """The dataset of `data.datasets` it reads; default: the evaluator's name."""

    def validate(self) -> None:
        check_positive(self.iterations, "iterations")

    def dataset(self, name: str) -> str:
        """The name of the dataset it reads, as the evaluator `name`."""
        return name if self.dataset_name is None else self.dataset_name


class LmEvalEvaluatorConfig(EvaluatorConfig, tag="lm_eval"):
    """Tasks of EleutherAI's lm-evaluation-harness, run on the model (in training: the model
    being trained, in place, its documents split over the data-parallel ranks)."""

    implementation = "fastllm.training.evaluators:LmEvalEvaluation"

    tasks: list[str] = msgspec.field(default_factory=list)
    """Task (or group) names, as lm-eval's `--tasks` takes them."""
    num_fewshot: int | None = None
    """Examples in each prompt (none: each task's default)."""
    limit: int | float | None = None
    """Documents per task: a count, or a fraction below 1 of each task (none: all)."""
    batch_size: int = 16
    """Sequences per forward pass, on each data-parallel rank."""
    include_path: str | None = None
    """A directory of task YAML files to add to lm-eval's (local tasks)."""
    max_length: int | None = None
    """Context length: rolling windows and truncation (none: as lm-eval's hf backend finds it
    for the model's directory: config.json's max_position_embeddings, else the tokenizer's
    model_max_length, else 2048; in training, as for the run's fastllm export, which has no
    config.json)."""
    max_gen_toks: int = 256
    """Generated tokens per request when a task sets no `max_gen_toks`."""
    bootstrap_iters: int = 100000
    """Bootstrap resamples for the standard error of a metric that is not a mean (0: none)."""

    def validate(self) -> None:
        if not self.tasks:
            raise ConfigError("tasks", "is required: name at least one lm-eval task")
        check_positive(self.batch_size, "batch_size")
        check_positive(self.max_length, "max_length")
        check_positive(self.max_gen_toks, "max_gen_toks")
        check_non_negative(self.bootstrap_iters, "bootstrap_iters")
        check_non_negative(self.num_fewshot, "num_fewshot")
        if self.limit is not None and not (
            self.limit > 0 and (isinstance(self.limit, int) or self.limit < 1)
        ):
            raise ConfigError(
                "limit", f"must be a positive count or a fraction below 1, got {self.limit}"
            )


Evaluator = EvaluatorConfig
"""Any evaluator type (a component of the `evaluator` point, chosen by `type`; default loss)."""


class TrainingEvaluatorConfig(Section):
    """An evaluator run during training, at its interval."""

    interval: int | None = None
    """Steps between two evaluations (none: never); the first, after step `offset` (or
    `interval` when offset is 0), at most `training.train_iters`."""
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
