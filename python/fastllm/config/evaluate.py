"""`fastllm evaluate`: which model to evaluate and the lm-eval-harness evaluators to run on it."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from fastllm.config.evaluation import LmEvalEvaluatorConfig
from fastllm.config.model import DistributedConfig, MultiStageConfig
from fastllm.config.schema import build
from fastllm.config.section import ConfigError, Section
from fastllm.config.trainer import PretrainedConfig, TrainerConfig


class EvaluationLayoutConfig(Section):
    """The layout the model is evaluated in, under the training run's keys; of the model
    section of a training config, only these two are read."""

    distributed: DistributedConfig = msgspec.field(default_factory=DistributedConfig)
    """tensor_parallel, sequence_tensor_parallel, pipeline_parallel, sequence_data_parallel
    (and its chunking) and expert_parallel split the model as in training; the data-parallel
    ranks (the rest of the launch's) each answer a share of the documents. Not read:
    training_dtype (`dtype` is the evaluation's), seed and the FP8 keys."""
    multi_stage: MultiStageConfig = msgspec.field(default_factory=MultiStageConfig)
    """zero_stage 3 shards the weights over the data-parallel ranks, each stage gathered as it
    runs (stages of layers_per_stage blocks, also the pipeline's unit); the other keys are
    training's and not read."""


class EvaluateConfig(Section):
    pretrained: PretrainedConfig = msgspec.field(default_factory=PretrainedConfig)
    """The model to evaluate: a fastllm checkpoint or export, or a Hugging Face directory."""
    model: EvaluationLayoutConfig = msgspec.field(default_factory=EvaluationLayoutConfig)
    """How the model is split over the ranks of a torchrun launch (default: whole on each,
    the documents split over them)."""
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
) - {"pretrained", "model"}
"""The sections of a training config that evaluation does not read: a training config is also
an evaluation config (`fastllm evaluate -c run.yaml pretrained.path=…`)."""
LAYOUT_SECTIONS = frozenset(
    field.encode_name for field in msgspec.structs.fields(EvaluationLayoutConfig)
)
"""The parts of a training config's model section that evaluation reads (the architecture is
the checkpoint's)."""


def evaluate_config(raw: dict[str, Any]) -> EvaluateConfig:
    """The evaluation config in `raw`: of a training config, `pretrained` and the layout keys
    of `model` (LAYOUT_SECTIONS), the other sections set aside."""
    kept = {k: v for k, v in raw.items() if k not in TRAINING_SECTIONS}
    if isinstance(kept.get("model"), dict):
        kept["model"] = {k: v for k, v in kept["model"].items() if k in LAYOUT_SECTIONS}
    return build(EvaluateConfig, kept)
