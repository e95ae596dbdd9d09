"""The root of a training config: everything `fastllm train` reads."""

from __future__ import annotations

import msgspec

from fastllm.config.data import DataConfig
from fastllm.config.formats import ModelFormat
from fastllm.config.model import ModelConfig
from fastllm.config.schedule import ScheduleConfig
from fastllm.config.section import ConfigError, Section
from fastllm.config.training import BatchConfig, OptimizerConfig, RunConfig, TrainingConfig


class PretrainedConfig(Section):
    format: ModelFormat = "fastllm"
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
    schedule: ScheduleConfig = msgspec.field(default_factory=ScheduleConfig)
    """How a step's micro-batches are grouped and ordered through the pipeline stages, and
    cut into pieces."""
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    """Training data."""
    optimizer: OptimizerConfig = msgspec.field(default_factory=OptimizerConfig)
    """AdamW and its learning-rate schedule."""
    pretrained: PretrainedConfig | None = None
    """Initialize the model from a checkpoint (fine-tuning, continued pretraining)."""

    def _check_offload(self) -> None:
        offload = self.model.multi_stage.offload_activations
        layers = self.model.base_model.transformer.num_layers
        if not offload:
            return
        if offload > layers:
            raise ConfigError(
                "model.multi_stage.offload_activations",
                f"is {offload}, more than the model's {layers} blocks",
            )
        refused = [
            key
            for key, used in (
                ("training.compile", self.training.compile),
                ("model.distributed.pipeline_parallel", self.model.distributed.pipeline_parallel > 1),
                ("schedule.breadth_first_micro_batches", (self.schedule.breadth_first_micro_batches or 1) > 1),
                ("schedule.micro_batch_splits", self.schedule.micro_batch_splits > 1),
            )
            if used
        ]  # fmt: skip
        if refused:
            raise ConfigError(
                "model.multi_stage.offload_activations",
                f"with {', '.join(refused)} is not supported yet (one forward pass of the "
                "blocks at a time, run eagerly)",
            )

    def validate(self) -> None:
        distributed = self.model.distributed
        if self.training.compile and distributed.tensor_parallel > 1:
            raise ConfigError(
                "training.compile",
                "compiled blocks with model.distributed.tensor_parallel > 1 are not supported "
                "yet (their collectives would break the graphs)",
            )
        if self.training.compile and distributed.sequence_data_parallel > 1:
            raise ConfigError(
                "training.compile",
                "compiled blocks with model.distributed.sequence_data_parallel > 1 are not "
                "supported yet (their collectives would break the graphs)",
            )
        if self.training.compile and distributed.fp8_linear != "none":
            raise ConfigError(
                "training.compile",
                f"compiled blocks with model.distributed.fp8_linear={distributed.fp8_linear} are "
                "not supported yet (the FP8 layers run their own kernels)",
            )
        if (
            distributed.sequence_parallel
            and self.batch.sequence_length % distributed.tensor_parallel
        ):
            raise ConfigError(
                "batch.sequence_length",
                f"({self.batch.sequence_length}) must be divisible by "
                f"model.distributed.tensor_parallel ({distributed.tensor_parallel}) with "
                "model.distributed.sequence_tensor_parallel",
            )
        self._check_offload()
        splits = self.schedule.micro_batch_splits
        if splits > 1 and distributed.sequence_data_parallel > 1:
            raise ConfigError(
                "schedule.micro_batch_splits",
                "with model.distributed.sequence_data_parallel > 1 is not supported yet",
            )
        if splits > 1 and self.model.multi_stage.recompute == "full":
            raise ConfigError(
                "schedule.micro_batch_splits",
                "with model.multi_stage.recompute: full is not supported yet (a recomputed "
                "block would add its piece's keys and values a second time)",
            )
        head_tail = (
            distributed.sequence_data_chunking == "head_tail"
            and distributed.sequence_data_parallel > 1
        )
        chunks = distributed.sequence_data_parallel * splits * (2 if head_tail else 1)
        if distributed.sequence_parallel:
            chunks *= distributed.tensor_parallel
        if chunks > 1 and self.batch.sequence_length % chunks:
            parts = [
                key
                for key, used in (
                    ("2 (model.distributed.sequence_data_chunking: head_tail)", head_tail),
                    ("model.distributed.sequence_data_parallel", distributed.sequence_data_parallel > 1),
                    ("schedule.micro_batch_splits", splits > 1),
                    ("model.distributed.tensor_parallel (with sequence_tensor_parallel)", distributed.sequence_parallel),
                )
                if used
            ]  # fmt: skip
            raise ConfigError(
                "batch.sequence_length",
                f"({self.batch.sequence_length}) must be divisible by {' × '.join(parts)} "
                f"({chunks})",
            )
