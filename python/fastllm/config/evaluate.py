"""`fastllm evaluate`: which model to evaluate and the lm-eval-harness evaluators to run on it."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from fastllm.config.evaluation import LmEvalEvaluatorConfig
from fastllm.config.schema import build
from fastllm.config.section import ConfigError, Section
from fastllm.config.trainer import PretrainedConfig, TrainerConfig


class EvaluateConfig(Section):
    pretrained: PretrainedConfig = msgspec.field(default_factory=PretrainedConfig)
    """The model to evaluate: a fastllm checkpoint or export, or a Hugging Face directory."""
    evaluators: dict[str, LmEvalEvaluatorConfig] = msgspec.field(default_factory=dict)
    """The evaluations to run, by name (`evaluators.mc.tasks=[hellaswag]`): lm_eval
    evaluators, as `training.evaluators.NAME.evaluator` takes them."""
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
