"""`fastllm evaluate`: which model to evaluate and the lm-eval-harness evaluators to run on it."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from fastllm.config.schema import build
from fastllm.config.section import ConfigError, Section, check_positive
from fastllm.config.trainer import PretrainedConfig, TrainerConfig


class LmEvalConfig(Section, tag_field="type", tag="lm_eval"):
    """Tasks of EleutherAI's lm-evaluation-harness, run on the model."""

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
    """Context length: rolling windows and truncation (none: the model's, as lm-eval's hf
    backend reads it from config.json, else 2048)."""
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
        if self.bootstrap_iters < 0:
            raise ConfigError(
                "bootstrap_iters", f"must be non-negative, got {self.bootstrap_iters}"
            )
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ConfigError("num_fewshot", f"must be non-negative, got {self.num_fewshot}")
        if self.limit is not None and not (
            self.limit > 0 and (isinstance(self.limit, int) or self.limit < 1)
        ):
            raise ConfigError(
                "limit", f"must be a positive count or a fraction below 1, got {self.limit}"
            )


class EvaluateConfig(Section):
    pretrained: PretrainedConfig = msgspec.field(default_factory=PretrainedConfig)
    """The model to evaluate: a fastllm checkpoint or export, or a Hugging Face directory."""
    evaluators: dict[str, LmEvalConfig] = msgspec.field(default_factory=dict)
    """The evaluations to run, by name (`evaluators.mc.tasks=[hellaswag]`)."""
    tokenizer: str | None = None
    """A directory with the tokenizer's files (tokenizer.json, tokenizer_config.json;
    default: the model's directory)."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """The dtype to evaluate in (none: as stored)."""
    output: str | None = None
    """The JSON file of the results (default: evaluation.json in the model's directory)."""

    def validate(self) -> None:
        if not self.evaluators:
            raise ConfigError(
                "evaluators", "is required: add one, e.g. evaluators.mc.tasks=[hellaswag]"
            )


TRAINING_SECTIONS = frozenset(
    field.encode_name for field in msgspec.structs.fields(TrainerConfig)
) - {"pretrained"}
"""The sections of a training config that evaluation does not read: a training config is also
an evaluation config (`fastllm evaluate -c run.yaml pretrained.path=…`)."""


def evaluate_config(raw: dict[str, Any]) -> EvaluateConfig:
    """The evaluation config in `raw`, a training config's sections other than `pretrained`
    set aside."""
    return build(EvaluateConfig, {k: v for k, v in raw.items() if k not in TRAINING_SECTIONS})
