"""`run`, `training`, `batch` and `optimizer`: how long, how big and how fast a run learns."""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from fastllm.config.evaluation import TrainingEvaluatorConfig
from fastllm.config.formats import ModelFormat
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
    phases: list[PhaseConfig] = msgspec.field(default_factory=list)
    """Phases of the run after its first (which trains on `data` with
    `optimizer.learning_rate`), each switching the blend, the learning-rate schedule or both
    at its `begin_step`, in order: `phases: [{begin_step: 800, data: {path: [DIR, DIR],
    weights: [0.5, 0.5]}, learning_rate: {decay_style: linear}}]` (an annealing phase)."""

    def validate(self) -> None:
        check_non_negative(self.train_iters, "train_iters")
        for i, phase in enumerate(self.phases):
            if phase.data is None and phase.learning_rate is None:
                raise ConfigError(f"phases[{i}]", "sets neither data nor learning_rate")
            if phase.data is not None and phase.data.path is phase.data.weights is None:
                raise ConfigError(
                    f"phases[{i}].data",
                    "sets neither path nor weights (leave it out to go on with the blend before)",
                )
            if i and phase.begin_step <= self.phases[i - 1].begin_step:
                raise ConfigError(
                    f"phases[{i}].begin_step",
                    f"is {phase.begin_step}, not after training.phases[{i - 1}].begin_step "
                    f"({self.phases[i - 1].begin_step}): phases are listed in the order they "
                    "begin, one at a time",
                )
            if phase.begin_step >= self.train_iters > 0:
                raise ConfigError(
                    f"phases[{i}].begin_step",
                    f"is {phase.begin_step}, not before train_iters ({self.train_iters}): the "
                    "phase would train no step",
                )


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


class LearningRateConfig(Section):
    base: float = 0.0001
    """Peak learning rate."""
    warmup_iterations: int = 0
    """Steps of linear warmup from 0 to base."""
    decay_style: Literal["constant", "linear", "cosine", "wsd"] = "constant"
    """Shape after warmup; wsd is warmup-stable-decay (constant, then linear decay)."""
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


class PhaseDataConfig(Section):
    """The blend a phase of `training.phases` trains on."""

    path: list[str] | None = None
    """Prepared datasets (directories written by `fastllm prepare`); default: those of the
    phase before (`data.path` for the first phase)."""
    weights: list[float] | None = None
    """Share of each dataset in the blend; default proportional to their token counts."""

    def validate(self) -> None:
        if self.path is not None and not self.path:
            raise ConfigError("path", "no dataset given")
        if self.weights is None:
            return
        if self.path is not None and len(self.weights) != len(self.path):
            raise ConfigError(
                "weights", f"has {len(self.weights)} entries but path has {len(self.path)}"
            )
        for i, weight in enumerate(self.weights):
            if not (math.isfinite(weight) and weight > 0):
                raise ConfigError(f"weights[{i}]", f"must be finite and positive, got {weight}")


class PhaseLearningRateConfig(LearningRateConfig):
    """The learning-rate schedule of a phase of `training.phases`."""

    base: float | None = None  # type: ignore[assignment]
    """Peak learning rate; default: the learning rate of the last step before the phase, so
    that the schedule goes on from it without a jump (a WSD decay: `{decay_style: linear}`)."""

    def validate(self) -> None:
        if self.base is not None:
            super().validate()
            return
        check_non_negative(self.warmup_iterations, "warmup_iterations")
        check_positive(self.decay_iterations, "decay_iterations")
        check_non_negative(self.minimum, "minimum")


class PhaseConfig(Section):
    """A phase of `training.phases`: from `begin_step` on, another blend, another
    learning-rate schedule, or both."""

    begin_step: int
    """Steps trained before the phase begins: its first step is step begin_step + 1 (as
    logged)."""
    data: PhaseDataConfig | None = None
    """The blend the phase trains on, sampled afresh from its own seed (drawn from
    `model.distributed.seed` and `begin_step`) with `data`'s other keys (sampling, FIM); none:
    the blend of the phase before goes on."""
    learning_rate: PhaseLearningRateConfig | None = None
    """The learning-rate schedule of the phase, with the keys of `optimizer.learning_rate`: its
    steps counted from `begin_step`, its end of training being the next phase that sets one (or
    `training.train_iters`); none: the schedule of the phase before goes on."""

    def validate(self) -> None:
        check_positive(self.begin_step, "begin_step")


class OptimizerConfig(Section):
    learning_rate: LearningRateConfig = msgspec.field(default_factory=LearningRateConfig)
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
