"""The root of a training config: everything `fastllm train` reads."""

from __future__ import annotations

import msgspec

from fastllm.config import registry
from fastllm.config.bounds import check_bounds
from fastllm.config.data import DataConfig
from fastllm.config.evaluation import LmEvalEvaluatorConfig, check_evaluators
from fastllm.config.formats import HF_ARCHITECTURES, ModelFormat, inexpressible
from fastllm.config.layout import check_compatible, check_shape
from fastllm.config.model import DPOLossConfig, LoRAConfig, ModelConfig
from fastllm.config.phases import check_phases
from fastllm.config.schedule import ScheduleConfig
from fastllm.config.section import ConfigError, Section
from fastllm.config.training import BatchConfig, OptimizerConfig, RunConfig, TrainingConfig


class PretrainedConfig(Section):
    format: ModelFormat = "fastllm"
    """Format of the checkpoint to start from."""
    path: str = ""
    """Its directory. When the config sets no architecture in `model.base_model` (at most its
    `peft`), the architecture is taken from the checkpoint."""
    adapter: str | None = None
    """A PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) for the
    model in `path`: its adapters continue training. Without `model.base_model.peft` its
    rank, alpha, dropout and projections are taken from it; with it, they must agree."""

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("path", "is required")
        if self.format == "peft":
            raise ConfigError(
                "format",
                "peft is an adapter, not a model: set path to its base model and adapter to "
                "the adapter's directory",
            )


class ReferenceModelConfig(Section):
    """A frozen model run beside the trained one (a teacher, a DPO reference): weights only,
    forward passes only, under the same layout."""

    pretrained: PretrainedConfig = msgspec.field(default_factory=PretrainedConfig)
    """Its checkpoint (a fastllm checkpoint or export, or a Hugging Face directory, with a
    PEFT adapter if `adapter` is set); its architecture is the checkpoint's."""


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
    reference_models: dict[str, ReferenceModelConfig] = msgspec.field(default_factory=dict)
    """Frozen models the losses read by name (`model.base_model.head.losses`: a distillation
    teacher)."""

    def validate(self) -> None:
        offload = self.model.multi_stage.offload_activations
        layers = self.model.base_model.transformer.num_layers
        if offload > layers:
            raise ConfigError(
                "model.multi_stage.offload_activations",
                f"is {offload}, more than the model's {layers} blocks",
            )
        export = self.training.export.format
        if export == "peft" and not isinstance(self.model.base_model.peft, LoRAConfig):
            raise ConfigError(
                "training.export.format",
                "peft writes LoRA adapters, and the model has none (model.base_model.peft)",
            )
        peft = self.model.base_model.peft
        if export == "peft" and isinstance(peft, LoRAConfig) and (reason := peft.peft_refusal()):
            raise ConfigError("training.export.format", f"peft: {reason}")
        if export in HF_ARCHITECTURES and (reason := inexpressible(self.model.base_model, export)):
            raise ConfigError(
                "training.export.format", f"{export} cannot express the model: {reason}"
            )
        self._check_tokenizer_files()
        check_evaluators(self)
        check_phases(self)
        self._check_reference_models()
        check_bounds(self)
        # What needs no number of ranks is refused here, when the config is loaded.
        check_compatible(self)
        registry.check_settings(self, TrainerConfig())
        check_shape(self)

    def _check_tokenizer_files(self) -> None:
        """Exports and lm_eval read the tokenizer files of data.path[0], which a run on a
        data source alone has not."""
        if self.data.source is None or self.data.path:
            return
        reason = "the tokenizer files of data.path[0], which a run on data.source alone has not"
        if self.training.export.interval:
            raise ConfigError("training.export.interval", f"exports copy {reason}")
        for name, evaluator in self.training.evaluators.items():
            if isinstance(evaluator.evaluator, LmEvalEvaluatorConfig):
                raise ConfigError(
                    f"training.evaluators.{name}.evaluator", f"lm_eval reads {reason}"
                )

    def _check_reference_models(self) -> None:
        """Each loss's reference model is given, and each given one is read by a loss."""
        losses = self.model.base_model.head.losses
        read: set[str] = set()
        for name, loss in losses.items():
            for reference in sorted(loss.reference_models):
                if reference not in self.reference_models:
                    raise ConfigError(
                        f"model.base_model.head.losses.{name}.reference_model",
                        f"{reference!r} is not in reference_models "
                        f"({sorted(self.reference_models) or 'none given'})",
                    )
            read |= loss.reference_models
        for reference in sorted(set(self.reference_models) - read):
            raise ConfigError(
                f"reference_models.{reference}",
                "no loss of model.base_model.head.losses reads it",
            )
        for name, loss in losses.items():
            if not isinstance(loss, DPOLossConfig) or loss.reference_log_probs != "precomputed":
                continue
            others = sorted(
                other
                for other, reader in losses.items()
                if other != name and loss.reference_model in reader.reference_models
            )
            if others:
                raise ConfigError(
                    f"model.base_model.head.losses.{name}.reference_log_probs",
                    f"precomputed frees reference_models.{loss.reference_model} before training, "
                    f"and model.base_model.head.losses {others} read it in the step; set "
                    "in_step",
                )
