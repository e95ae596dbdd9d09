"""`run`, `training`, `batch` and `optimizer`: how long, how big and how fast a run learns."""

from __future__ import annotations

import msgspec

from fastllm.config.evaluation import TrainingEvaluatorConfig
from fastllm.config.formats import ModelFormat
from fastllm.config.registry import Component
from fastllm.config.section import ConfigError, Section, check_non_negative, check_positive


class RunConfig(Section):
    experiment_dir: str | None = None
    """Directory of the run: checkpoints, exports, metrics and logs. Required to train."""


class LogsConfig(Section):
    interval: int = 100
    """Steps between two logged lines of metrics."""
    tensorboard: bool = False
    """Also write the metrics as TensorBoard events under EXPERIMENT_DIR/tensorboard (needs the
    tensorboard package)."""
    wandb_project: str | None = None
    """Also send the metrics to this Weights & Biases project (needs wandb; WANDB_MODE=offline
    works without network)."""

    def validate(self) -> None:
        check_positive(self.interval, "interval")


class CheckpointConfig(Section):
    interval: int | None = None
    """Steps between two checkpoints (none: only on interruption and at the end)."""
    keep: int | None = 5
    """Newest checkpoints kept on disk (none: all)."""
    at_end: bool = True
    """Write one after the last step (false for benchmarks and throwaway runs; an
    interruption still writes one)."""

    def validate(self) -> None:
        check_positive(self.interval, "interval")
        check_positive(self.keep, "keep")


class ExportConfig(Section):
    interval: int | None = None
    """Steps between two exports of the model weights (none: never)."""
    format: ModelFormat = "distributed"
    """Format of the exported weights."""

    def validate(self) -> None:
        check_positive(self.interval, "interval")


class ValidationConfig(Section):
    interval: int | None = None
    """Steps between two validations (none: never)."""
    iterations: int = 10
    """Batches per validation."""

    def validate(self) -> None:
        check_positive(self.interval, "interval")
        check_positive(self.iterations, "iterations")


class ProfileConfig(Section):
    step: int | None = None
    """Profile the optimizer steps from this one (none: never): per rank, a trace viewable in
    Perfetto or chrome://tracing and a table of the time per operator and kernel, under
    EXPERIMENT_DIR/profile/."""
    steps: int = 1
    """Steps profiled."""

    def validate(self) -> None:
        check_positive(self.step, "step")
        check_positive(self.steps, "steps")


class TrainingConfig(Section):
    train_iters: int = 0
    """Optimizer steps of the whole run."""
    logs: LogsConfig = msgspec.field(default_factory=LogsConfig)
    """Metrics logging."""
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    """Checkpoints to resume from."""
    export: ExportConfig = msgspec.field(default_factory=ExportConfig)
    """Exports of the weights."""
    validation: ValidationConfig = msgspec.field(default_factory=ValidationConfig)
    """Loss on the validation datasets (`data.validation_path`), logged as validation_loss:
    the evaluator named validation."""
    evaluators: dict[str, TrainingEvaluatorConfig] = msgspec.field(default_factory=dict)
    """Evaluations by name, each at its own interval and logged as NAME_METRIC (a loss
    evaluator named wiki logs wiki_loss): `evaluators: {wiki: {interval: 100, evaluator:
    {type: loss, iterations: 10}}}`."""
    compile: bool = False
    """torch.compile each transformer block, fusing the elementwise work around the matmuls
    and attention (the first steps are slower: they compile)."""
    profile: ProfileConfig = msgspec.field(default_factory=ProfileConfig)
    """torch.profiler traces of chosen steps."""

    def validate(self) -> None:
        check_non_negative(self.train_iters, "train_iters")


class BatchConfig(Section):
    batch_size: int = 1
    """Sequences per optimizer step, over all data-parallel ranks."""
    sequence_length: int = 2048
    """Tokens per sequence."""
    micro_batch_size: int | None = None
    """Sequences per forward/backward pass on one rank; gradients are accumulated over the
    micro-batches of a step. Default: the whole batch at once."""
    cross_document_attention: bool = True
    """Whether tokens attend to the earlier documents packed into the same sequence (as in
    Fast-LLM, Megatron-LM and torchtitan by default). false keeps attention, and positions,
    within each document (varlen / block-masked attention, which skips the masked blocks:
    2k-token documents packed into 32k run attention 6.2× faster than dense causal on an H200)."""

    def validate(self) -> None:
        check_positive(self.batch_size, "batch_size")
        check_positive(self.sequence_length, "sequence_length")
        check_positive(self.micro_batch_size, "micro_batch_size")
        if self.micro_batch_size is None:
            self.micro_batch_size = self.batch_size
        if self.batch_size % self.micro_batch_size:
            raise ConfigError(
                "micro_batch_size",
                f"must divide batch_size ({self.batch_size}), got {self.micro_batch_size}",
            )


class LearningRateConfig(Component, tag_field="decay_style"):
    """The learning-rate schedule (extension point `learning_rate`), chosen by `decay_style`
    (Fast-LLM's key): a linear warmup, then the shape its type says. The implementation of a
    type is a function called as `rate(config, step, train_iters)` for the optimizer steps
    after the warmup (engine/learning_rate.py says the contract)."""

    point = "learning_rate"

    base: float = 0.0001
    """Peak learning rate."""
    warmup_iterations: int = 0
    """Steps of linear warmup from 0 to base."""
    decay_iterations: int | None = None
    """Steps of decay: after warmup for linear and cosine (default: to the end of training),
    at the end of training for wsd (default: the last 20% of it)."""
    minimum: float = 0.0
    """Learning rate at the end of the decay."""

    def validate(self) -> None:
        check_non_negative(self.base, "base")
        check_non_negative(self.warmup_iterations, "warmup_iterations")
        check_positive(self.decay_iterations, "decay_iterations")
        if not 0 <= self.minimum <= self.base:
            raise ConfigError(
                "minimum", f"must be between 0 and base ({self.base}), got {self.minimum}"
            )


class ConstantLearningRateConfig(LearningRateConfig, tag="constant"):
    """base after the warmup."""

    implementation = "fastllm.engine.learning_rate:constant"


class LinearLearningRateConfig(LearningRateConfig, tag="linear"):
    """From base down to minimum in a straight line over decay_iterations."""

    implementation = "fastllm.engine.learning_rate:linear"


class CosineLearningRateConfig(LearningRateConfig, tag="cosine"):
    """From base down to minimum along half a cosine over decay_iterations."""

    implementation = "fastllm.engine.learning_rate:cosine"


class WSDLearningRateConfig(LearningRateConfig, tag="wsd"):
    """Warmup-stable-decay: base, then down to minimum in a straight line over the last
    decay_iterations of the run."""

    implementation = "fastllm.engine.learning_rate:warmup_stable_decay"


class OptimizerConfig(Section):
    learning_rate: LearningRateConfig = msgspec.field(default_factory=ConstantLearningRateConfig)
    """Learning-rate schedule."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW); not applied to norms, biases and embeddings."""
    beta_1: float = 0.9
    """Adam's first-moment decay."""
    beta_2: float = 0.999
    """Adam's second-moment decay."""
    epsilon: float = 1e-8
    """Adam's denominator term."""
    gradient_norm_clipping: float | None = 1.0
    """Clip the global gradient norm to this value (none: no clipping)."""

    def validate(self) -> None:
        check_non_negative(self.weight_decay, "weight_decay")
        for key in ("beta_1", "beta_2"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(key, f"must be in [0, 1), got {getattr(self, key)}")
        check_positive(self.epsilon, "epsilon")
        check_positive(self.gradient_norm_clipping, "gradient_norm_clipping")


def unreached_cadences(training: TrainingConfig) -> list[str]:
    """One line for each cadence that the run ends before reaching (a likely mistake: an
    export every 2000 steps of a 1000-step run writes none)."""
    cadences = [
        ("training.export.interval", training.export.interval, "no export is written"),
        ("training.validation.interval", training.validation.interval, "nothing is validated"),
        ("training.profile.step", training.profile.step, "nothing is profiled"),
        *(  # the first evaluation is after step offset, or interval when offset is 0
            (f"training.evaluators.{name}.offset", evaluator.offset, "it never runs")
            if evaluator.offset
            else (f"training.evaluators.{name}.interval", evaluator.interval, "it never runs")
            for name, evaluator in training.evaluators.items()
        ),
    ]
    if not training.checkpoint.at_end:
        cadences.append(
            ("training.checkpoint.interval", training.checkpoint.interval, "none is written")
        )
    return [
        f"{key} is {value}, past training.train_iters ({training.train_iters}): {outcome}"
        for key, value, outcome in cadences
        if value is not None and value > training.train_iters > 0
    ]
