"""What a run could only fail at hours in (an export format that cannot express the model, a
validation dataset that cannot be read) stops `fastllm train` before its first step."""

from __future__ import annotations

import shutil
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


def test_a_malformed_tokenizer_config_is_refused_before_training_when_exporting_to_hf(
    dataset: Path, tmp_path: Path
) -> None:
    # The export reads the dataset's tokenizer_config.json for bos/eos ids: hours in, a
    # traceback; now refused at start naming the file.
    copy = tmp_path / "data"
    shutil.copytree(dataset, copy)
    (copy / "tokenizer_config.json").write_text("{not json")
    result = run_cli(
        *train_arguments(
            copy, tmp_path / "run", "training.train_iters=2",
            "training.export.interval=2", "training.export.format=starcoder2",
        )
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(
        f"fastllm: error: data.path[0]: {copy / 'tokenizer_config.json'}: Expecting"
    ), result.stderr
    assert not (tmp_path / "run").exists()


def test_cadences_the_run_never_reaches_are_warned_about(dataset: Path, tmp_path: Path) -> None:
    result = run_cli(
        *train_arguments(
            dataset, tmp_path / "run", "training.train_iters=2", "training.export.interval=5"
        )
    )
    assert result.returncode == 0, result.stderr
    assert (
        "fastllm: warning: training.export.interval is 5, past training.train_iters (2): "
        "no export is written"
    ) in result.stderr
