"""The root of a training config: everything `fastllm train` reads."""

from __future__ import annotations

from typing import Literal

import msgspec

from fastllm.config.data import DataConfig
from fastllm.config.model import ModelConfig
from fastllm.config.section import ConfigError, Section
from fastllm.config.training import BatchConfig, OptimizerConfig, RunConfig, TrainingConfig


class PretrainedConfig(Section):
    format: Literal[
        "fastllm", "distributed", "llama", "mistral", "mixtral", "qwen2", "starcoder2"
    ] = "fastllm"
    """Format of the checkpoint to start from."""
    path: str = ""
    """Its directory. When the config sets no `model.base_model`, the architecture is taken
    from the checkpoint."""

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("path", "is required")


class TrainerConfig(Section):
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    """Where the run keeps its files."""
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    """The model and its precision."""
    training: TrainingConfig = msgspec.field(default_factory=TrainingConfig)
    """Length of the run, logging, checkpoints, exports and validation."""
    batch: BatchConfig = msgspec.field(default_factory=BatchConfig)
    """Batch geometry."""
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    """Training data."""
    optimizer: OptimizerConfig = msgspec.field(default_factory=OptimizerConfig)
    """AdamW and its learning-rate schedule."""
    pretrained: PretrainedConfig | None = None
    """Initialize the model from a checkpoint (fine-tuning, continued pretraining)."""
