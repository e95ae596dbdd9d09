"""What a resumed run may change in its checkpoint's config without a warning."""

from __future__ import annotations

import msgspec

from fastllm.config import TrainerConfig, load_config
from fastllm.config.resume_changes import changed_keys, resume_warning


def builtins(*overrides: str) -> dict:
    return msgspec.to_builtins(load_config(TrainerConfig, overrides=["data.path=[d]", *overrides]))


def test_the_run_length_logging_intervals_and_layout_may_change_on_resume() -> None:
    saved = builtins()
    resumed = builtins(
        "training.train_iters=50", "training.logs.interval=1", "training.checkpoint.interval=5",
        "training.export.interval=7", "run.experiment_dir=/elsewhere", "model.multi_stage.zero_stage=3",
        "model.multi_stage.recompute=full", "batch.micro_batch_size=1", "data.prefetch=0",
    )  # fmt: skip
    assert changed_keys(saved, resumed, step=4) == []
    assert resume_warning(saved, resumed, step=4) is None


def test_changes_to_what_the_run_computes_are_listed_by_full_key() -> None:
    saved = builtins()
    resumed = builtins(
        "optimizer.learning_rate.base=0.01", "model.distributed.seed=7", "data.path=[other]",
        "model.base_model.transformer.rotary={type: llama3}", "training.train_iters=9",
    )  # fmt: skip
    assert changed_keys(saved, resumed, step=4) == [
        "data.path",
        "model.base_model.transformer.rotary.high_frequency_factor",
        "model.base_model.transformer.rotary.low_frequency_factor",
        "model.base_model.transformer.rotary.original_context_length",
        "model.base_model.transformer.rotary.scale_factor",
        "model.base_model.transformer.rotary.type",
        "model.distributed.seed",
        "optimizer.learning_rate.base",
    ]
    warning = resume_warning(saved, resumed, step=4)
    assert warning is not None and "\n" not in warning
    assert "optimizer.learning_rate.base" in warning and "train_iters" not in warning


PHASES = (
    "training.train_iters=20",
    "training.phases=[{begin_step: 4, learning_rate: {decay_style: linear}},"
    " {begin_step: 10, data: {weights: [1]}}]",
)


def test_phases_may_change_until_they_begin() -> None:
    saved = builtins(*PHASES)
    planned = builtins(
        "training.train_iters=20",
        "training.phases=[{begin_step: 4, learning_rate: {decay_style: linear}},"
        " {begin_step: 12, data: {path: [e], weights: [1]}}, {begin_step: 15, learning_rate: {}}]",
    )
    assert changed_keys(saved, planned, step=10) == []  # the phase of step 10 begins after it
    assert changed_keys(saved, builtins("training.train_iters=20"), step=4) == []
    written_before_phases = builtins()
    del written_before_phases["training"]["phases"]
    assert changed_keys(written_before_phases, builtins(), step=4) == []


def test_changes_to_phases_that_began_are_listed_by_full_key() -> None:
    saved = builtins(*PHASES)
    changed = builtins(
        "training.train_iters=20",
        "training.phases=[{begin_step: 4, learning_rate: {decay_style: cosine}},"
        " {begin_step: 10, data: {weights: [2]}}]",
    )
    assert changed_keys(saved, changed, step=11) == [
        "training.phases[0].learning_rate.decay_style",
        "training.phases[1].data.weights",
    ]
    assert changed_keys(saved, builtins("training.train_iters=20"), step=5) == [
        "training.phases[0]"
    ]
