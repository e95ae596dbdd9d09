"""The root of a training config: everything `fastllm train` reads."""

from __future__ import annotations

import msgspec

from fastllm.config.data import DataConfig
from fastllm.config.model import ModelConfig
from fastllm.config.section import Section
from fastllm.config.training import BatchConfig, OptimizerConfig, RunConfig, TrainingConfig


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
