"""The evaluators of a run: `training.evaluators`, and `training.validation` as the one named
validation. Each runs after the steps of its interval and offset, on the model being trained,
and gives metrics that the run logs under its name (NAME_METRIC: a loss evaluator named wiki
logs wiki_loss; an lm_eval evaluator named mc logs mc_TASK_METRIC). One runner class per
evaluator type; `evaluations` makes a run's."""

from __future__ import annotations

import contextlib
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy
import torch
import torch.distributed as dist

from fastllm.config import ConfigError, registry
from fastllm.config.evaluation import (
    VALIDATION,
    LmEvalEvaluatorConfig,
    LossEvaluatorConfig,
    TrainingEvaluatorConfig,
)
from fastllm.data import SampleStream
from fastllm.evaluation.model_files import context_length, generation_eos, load_tokenizer

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

    from fastllm.evaluation.lm_eval_model import FastLLMLM
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


class LmEvalEvaluation(Evaluation):
    """lm-eval's tasks on the model being trained, in place: its parameters are the engine's
    buffers (ZeRO-3's shards gathered stage by stage, a tensor rank's slices, a pipeline
    rank's stages), under the layouts the compatibility table lets an lm_eval evaluator run
    with. Each data-parallel rank answers the requests of its share of the documents; the
    metrics lm-eval gathers to data rank 0 reach every rank. The tokenizer is the one
    `fastllm prepare` copied into the first training dataset (which exports carry too), so
    the results are `fastllm evaluate`'s on the run's checkpoint of the same step."""

    def __init__(
        self,
        trainer: Trainer,
        name: str,
        schedule: TrainingEvaluatorConfig,
        config: LmEvalEvaluatorConfig,
    ) -> None:
        super().__init__(name, schedule)
        self._trainer, self._config = trainer, config
        self._ready: tuple[FastLLMLM, TaskManager] | None = None

    def prepare(self, stop: Callable[[], bool]) -> None:
        self._model_and_tasks()

    def _model_and_tasks(self) -> tuple[FastLLMLM, TaskManager]:
        """lm-eval's model interface on the engine's model and the index of the tasks, made
        (the tokenizer read, the task names checked) once."""
        if self._ready is None:
            # lm-eval and transformers load in seconds: only runs that evaluate with it pay.
            from fastllm.evaluation.lm_eval_model import FastLLMLM
            from fastllm.evaluation.tasks import task_manager

            config, key = self._config, f"training.evaluators.{self.name}.evaluator"
            if config.include_path is not None and not Path(config.include_path).is_dir():
                raise ConfigError(
                    f"{key}.include_path", f"{config.include_path}: no such directory"
                )
            directory = Path(self._trainer.config.data.path[0])
            tokenizer = load_tokenizer(
                directory,
                "data.path[0]",
                "an lm_eval evaluator reads the tokenizer files that fastllm prepare copies "
                "into a dataset: prepare the first dataset again",
            )
            manager = task_manager(config, key)
            engine = self._trainer.engine
            documents = engine.mesh.document_groups
            lm = FastLLMLM(
                engine.model,
                tokenizer,
                max_length=config.max_length or context_length(directory, tokenizer),
                batch_size=config.batch_size,
                max_gen_toks=config.max_gen_toks,
                eos_token_ids=generation_eos(directory),
                data=engine.mesh.data if documents is None else documents,
                stages=engine.stages,
            )
            self._ready = lm, manager
        return self._ready

    def run(self, stop: Callable[[], bool]) -> dict[str, float] | None:
        from fastllm.evaluation.tasks import numeric_metrics, run_tasks

        lm, manager = self._model_and_tasks()
        if stop():  # lm-eval cannot be stopped midway: a signal during it stops the run after
            return None
        engine = self._trainer.engine
        engine.wait_for_weights()
        with _random_state_kept():
            results = run_tasks(lm, self._config, manager)
        metrics = [None if results is None else numeric_metrics(results)]
        data = engine.mesh.data
        if data.size > 1:
            source = dist.get_global_rank(data.group, 0)
            dist.broadcast_object_list(metrics, src=source, group=data.group)
        return metrics[0]


@contextlib.contextmanager
def _random_state_kept() -> Iterator[None]:
    """The random generators as they were before: lm-eval seeds Python's, NumPy's and torch's
    for its few-shot sampling, which must not change what training draws next."""
    python, numpy_state, cpu = random.getstate(), numpy.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(python)
        numpy.random.set_state(numpy_state)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


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
        found[name] = registry.implementation(evaluator)(trainer, name, schedule, evaluator)
    return found


def loss_evaluation(
    trainer: Trainer, name: str, schedule: TrainingEvaluatorConfig, config: LossEvaluatorConfig
) -> LossEvaluation:
    """The `loss` evaluator `name`: its dataset of `data.datasets`."""
    dataset = config.dataset(name)
    paths = trainer.config.data.datasets[dataset].path
    key = f"data.datasets.{dataset}.path"
    return LossEvaluation(trainer, name, schedule, config.iterations, paths, key)
