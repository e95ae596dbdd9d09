"""What a run could only fail at hours in (an export format that cannot express the model, a
validation dataset that cannot be read) stops `fastllm train` before its first step."""

from __future__ import annotations

from pathlib import Path

from tests.data.conftest import run_cli
from tests.training.conftest import train_arguments


def test_train_refuses_an_export_format_the_model_cannot_be_written_in(
    dataset: Path, tmp_path: Path
) -> None:
    experiment = tmp_path / "run"
    result = run_cli(
        *train_arguments(
            dataset, experiment, "training.train_iters=2",
            "training.export.interval=1", "training.export.format=llama",
        )
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line == (
        "fastllm: error: training.export.format: llama cannot express the model: "
        "model.base_model.transformer.normalization.type is 'layer_norm' (llama has rms_norm)"
    )
    assert not experiment.exists(), "refused before the run made its directory"


def test_train_refuses_an_unreadable_validation_dataset_before_its_first_step(
    dataset: Path, tmp_path: Path
) -> None:
    experiment, not_a_dataset = tmp_path / "run", tmp_path / "empty"
    not_a_dataset.mkdir()
    result = run_cli(
        *train_arguments(
            dataset, experiment, "training.train_iters=2", "training.validation.interval=2",
            f"data.validation_path=[{not_a_dataset}]",
        )
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line == (
        f"fastllm: error: data.validation_path[0]: {not_a_dataset}: no dataset shards (*.idx) found"
    )
    metrics = experiment / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip(), "refused before step 1"
