"""The sizes a run can hold, checked when a training config is loaded: a value past them could
only end in an integer overflow or an allocation no machine makes (an abort in Rust or torch),
so `config validate` refuses it with the bound and its reason. Each bound is far above any
run trained so far."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastllm.config.evaluation import LossEvaluatorConfig
from fastllm.config.section import ConfigError

if TYPE_CHECKING:
    from fastllm.config.trainer import TrainerConfig

MAX_SEQUENCE_LENGTH = 2**24
"""16M tokens per sequence (long-context runs use up to 1M): with `MAX_SAMPLES`, the tokens of
a whole run stay below 2**60, in a signed 64-bit integer wherever they are counted."""
MAX_TOKENS_PER_BATCH = 2**40
"""A step's tokens (the largest runs take about 2**24): its token ids alone would take 8 TiB."""
INDEX_BYTES_PER_SAMPLE = 32
"""An upper estimate of the sampling index's memory per sequence: its start and offset (12
bytes), its dataset and place in the blend (12) and its share of the document order."""
MAX_SAMPLES = 2**36
"""Sequences the run draws, training or validation (15T tokens at 8k per sequence are about
2**31): their sampling index would take 2 TiB at this bound."""
MAX_MICRO_BATCHES = 2**20
"""Micro-batches a step accumulates on one rank (batch_size / micro_batch_size; the largest
runs accumulate about 2**7): the step's program holds a few ops for each."""
MAX_PARAMETERS = 2**42
"""4.4 trillion parameters: their AdamW state alone (16 bytes each) would take 64 TiB."""


def check_bounds(config: TrainerConfig) -> None:
    """Raises `ConfigError` naming the first size past its bound, with the reason."""
    batch, training = config.batch, config.training
    _at_most(
        "batch.sequence_length",
        f"{batch.sequence_length:,} tokens",
        batch.sequence_length,
        MAX_SEQUENCE_LENGTH,
        "with at most 2**36 sequences, a run's tokens stay below 2**60",
    )
    _at_most(
        "batch.batch_size",
        f"batch_size × sequence_length = {batch.batch_size * batch.sequence_length:,} tokens",
        batch.batch_size * batch.sequence_length,
        MAX_TOKENS_PER_BATCH,
        "8 TiB of token ids per step at the bound",
    )
    micro_batches = batch.batch_size // (batch.micro_batch_size or batch.batch_size)
    _at_most(
        "batch.micro_batch_size",
        f"batch_size / micro_batch_size = {micro_batches:,} micro-batches a step",
        micro_batches,
        MAX_MICRO_BATCHES,
        "the step's program holds a few ops for each micro-batch",
    )
    for key, steps in (
        ("training.train_iters", training.train_iters),
        ("training.validation.iterations", training.validation.iterations),
        *(
            (f"training.evaluators.{name}.evaluator.iterations", evaluator.evaluator.iterations)
            for name, evaluator in training.evaluators.items()
            if isinstance(evaluator.evaluator, LossEvaluatorConfig)
        ),
    ):
        _at_most(
            key,
            f"{key.rsplit('.', 1)[1]} × batch_size = {steps * batch.batch_size:,} sequences",
            steps * batch.batch_size,
            MAX_SAMPLES,
            f"the sampling index takes up to {INDEX_BYTES_PER_SAMPLE} bytes per sequence: "
            "2 TiB at the bound",
        )
    parameters = config.model.base_model.num_parameters()
    _at_most(
        "model.base_model",
        f"{parameters:,} parameters",
        parameters,
        MAX_PARAMETERS,
        "AdamW keeps 16 bytes per parameter: 64 TiB at the bound",
    )


def _at_most(key: str, what: str, value: int, bound: int, why: str) -> None:
    if value > bound:
        raise ConfigError(
            key, f"{what} is more than 2**{bound.bit_length() - 1} = {bound:,} ({why})"
        )
