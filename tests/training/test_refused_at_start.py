"""What a run could only fail at hours in (an export format that cannot express the model, a
validation dataset that cannot be read) or would silently not do (an export, a checkpoint, an
evaluation or a profile past its last step) stops `fastllm train` before its first step."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from fastllm.config import ConfigError, TrainerConfig, load_config
from fastllm.config.training import check_cadences
from tests.conftest import ROOT
from tests.data.conftest import run_cli
from tests.training.conftest import train_arguments

TINY = ROOT / "examples" / "tiny.yaml"
TEN_STEPS = ("training.train_iters=10", "training.export.interval=null")
"""examples/tiny.yaml cut to 10 steps (it exports every 200)."""


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


def test_train_refuses_a_cadence_the_run_never_reaches_before_making_its_directory(
    dataset: Path, tmp_path: Path
) -> None:
    # It trained the 2 steps and wrote no export, with a warning line easily lost in a log.
    experiment = tmp_path / "run"
    result = run_cli(
        *train_arguments(
            dataset, experiment, "training.train_iters=2", "training.export.interval=5"
        )
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line == (
        "fastllm: error: training.export.interval: is 5, past training.train_iters (2): no "
        "export would be written; set it to at most 2, or to null for none"
    )
    assert not experiment.exists(), "refused before the run made its directory"


@pytest.mark.parametrize(
    ("overrides", "key", "outcome"),
    [
        (["training.export.interval=11"], "training.export.interval", "no export would be written"),
        (
            ["training.validation.interval=20", "data.validation_path=[v]"],
            "training.validation.interval",
            "nothing would be validated",
        ),
        (["training.profile.step=11"], "training.profile.step", "nothing would be profiled"),
        (
            ["data.datasets.wiki.path=[w]", "training.evaluators.wiki.interval=11"],
            "training.evaluators.wiki.interval",
            "it would never run",
        ),
        (  # offset 12 evaluates after steps 12, 14, ...: never within 10 steps
            [
                "data.datasets.wiki.path=[w]", "training.evaluators.wiki.interval=2",
                "training.evaluators.wiki.offset=12",
            ],
            "training.evaluators.wiki.offset",
            "it would never run",
        ),
    ],
)  # fmt: skip
def test_each_cadence_past_train_iters_is_refused_naming_its_key(
    overrides: list[str], key: str, outcome: str
) -> None:
    config = load_config(TrainerConfig, [TINY], [*TEN_STEPS, *overrides])
    with pytest.raises(ConfigError, match=re.escape(f"{key}: is ")) as error:
        check_cadences(config.training)
    assert f"past training.train_iters (10): {outcome}; set it to at most 10" in str(error.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["training.export.interval=10", "training.profile.step=10"],  # the last step is reached
        ["training.checkpoint.interval=11"],  # at_end writes the last step's checkpoint
        # a throwaway run: no checkpoint at the end, and the example's interval is never reached
        ["training.checkpoint.interval=100", "training.checkpoint.at_end=false"],
        # no run: `config validate` of a model alone
        ["training.train_iters=0", "training.export.interval=200"],
    ],
)
def test_cadences_the_run_reaches_or_leaves_unset_are_accepted(overrides: list[str]) -> None:
    config = load_config(TrainerConfig, [TINY], [*TEN_STEPS, *overrides])
    check_cadences(config.training)


def test_config_validate_refuses_a_cadence_past_train_iters() -> None:
    result = run_cli(
        "config", "validate", "-c", str(TINY), "training.train_iters=150",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(
        "fastllm: error: training.export.interval: is 200, past training.train_iters (150)"
    ), result.stderr
