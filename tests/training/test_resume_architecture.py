"""A checkpoint loads only into the model that wrote it: a resume or a `pretrained` start with
other shapes exits 2 in one line naming the config key and both values, before anything is
loaded or written (every checkpoint stays as it was), alone and on every rank under torchrun;
a resume that changes only what a resume may change continues the run."""

from __future__ import annotations

import hashlib
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from fastllm.training.experiment_lock import LOCK_FILE
from tests.data.conftest import CliResult, run_cli
from tests.training.conftest import Launched, Layout, train_arguments
from tests.training.test_train_cli import losses

TRAINED = ("training.train_iters=6", "training.checkpoint.interval=2", "training.checkpoint.keep=3")
"""The reference run: checkpoints at steps 2, 4 and 6 of the tiny model (hidden 64, ffn 128,
4 heads in 2 groups, vocabulary 512, not gated)."""
RESUMED = (*TRAINED, "training.train_iters=8")
FFN = "model.base_model.transformer.ffn_hidden_size"
CHANGES = {
    f"{FFN}=64": f"{FFN}: checkpoint 128, config 64",
    "model.base_model.transformer.hidden_size=32": (
        "model.base_model.transformer.hidden_size: checkpoint 64, config 32"
    ),
    "model.base_model.transformer.num_attention_heads=8": (
        "model.base_model.transformer.num_attention_heads: checkpoint 4, config 8"
    ),
    "model.base_model.transformer.head_groups=1": (
        "model.base_model.transformer.head_groups: checkpoint 2, config 1"
    ),
    "model.base_model.vocab_size=1024": "model.base_model.vocab_size: checkpoint 512, config 1024",
    "model.base_model.transformer.gated=true": (
        "model.base_model.transformer.gated: checkpoint false, config true"
    ),
}
"""An architecture change and the start of the one line that refuses it."""


def layouts(dataset: Path, one_process: Callable[..., Path], root: Path) -> dict[str, Layout]:
    checkpoint = one_process(*TRAINED) / "checkpoint" / "4"
    return {"ffn_changed": Layout(2, (*RESUMED, f"{FFN}=64"), resumes=checkpoint)}


def files(directory: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under `directory` but the run lock: (size, modification time, digest)."""
    return {
        str(path.relative_to(directory)): (
            path.stat().st_size,
            path.stat().st_mtime_ns,
            hashlib.sha256(path.read_bytes()).hexdigest(),
        )
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != LOCK_FILE
    }


def interrupted_at_step_4(one_process: Callable[..., Path], experiment: Path) -> Path:
    """An experiment directory holding the reference run's checkpoints of steps 2 and 4."""
    for step in ("2", "4"):
        source = one_process(*TRAINED) / "checkpoint" / step
        shutil.copytree(source, experiment / "checkpoint" / step)
    return experiment


def assert_refused(result: CliResult, refusal: str) -> None:
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"fastllm: error: {refusal}"), line


@pytest.mark.parametrize("change", CHANGES)
def test_a_resume_with_another_architecture_exits_2_naming_the_key_and_leaves_every_file(
    dataset: Path, one_process: Callable[..., Path], tmp_path: Path, change: str
) -> None:
    experiment = interrupted_at_step_4(one_process, tmp_path / "run")
    before = files(experiment)
    assert_refused(
        run_cli(*train_arguments(dataset, experiment, *RESUMED, change)), CHANGES[change]
    )
    assert files(experiment) == before


def test_a_refused_resume_set_back_continues_with_the_changes_a_resume_may_make(
    dataset: Path, one_process: Callable[..., Path], tmp_path: Path
) -> None:
    experiment = interrupted_at_step_4(one_process, tmp_path / "run")
    assert_refused(
        run_cli(*train_arguments(dataset, experiment, *RESUMED, f"{FFN}=64")), CHANGES[f"{FFN}=64"]
    )
    allowed = ("model.multi_stage.zero_stage=3", "model.multi_stage.recompute=full",
               "training.checkpoint.interval=1", "data.prefetch=0")  # fmt: skip
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        result = run_cli(*train_arguments(dataset, experiment, *TRAINED, *allowed))
    assert result.returncode == 0, result.stderr
    assert f"resumed from {experiment / 'checkpoint' / '4'} (step 4)" in result.stdout
    assert not [w for w in warned if "resuming with a config" in str(w.message)]
    reference = losses(one_process(*TRAINED))
    assert losses(experiment) == {step: reference[step] for step in (5, 6)}


def test_every_rank_refuses_a_resume_with_another_architecture_under_torchrun(
    one_process: Callable[..., Path], launched: dict[str, Launched]
) -> None:
    result = launched["ffn_changed"].result
    assert result.returncode == 2, result.stderr
    # Each rank's output, then torchrun's report of the failed ranks.
    ranks = result.stderr.splitlines()[:2]
    assert [line.split(" (")[0] for line in ranks] == [
        f"fastllm: error: {CHANGES[f'{FFN}=64']}"
    ] * 2
    saved = files(one_process(*TRAINED) / "checkpoint")
    assert files(launched["ffn_changed"].experiment / "checkpoint") == {
        name: saved[name] for name in saved if name.startswith("4/")
    }


@pytest.fixture(scope="module")
def pretrained(
    one_process: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The reference run's weights at step 4 in each format `pretrained` reads."""
    checkpoint = one_process(*TRAINED) / "checkpoint" / "4"
    root = tmp_path_factory.mktemp("pretrained")
    for output_format in ("fastllm", "starcoder2"):
        result = run_cli(
            "convert", "input.format=distributed", f"input.path={checkpoint}",
            f"output.format={output_format}", f"output.path={root / output_format}",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
    return {
        "distributed": checkpoint,
        "fastllm": root / "fastllm",
        "starcoder2": root / "starcoder2",
    }


@pytest.mark.parametrize("source_format", ["distributed", "fastllm", "starcoder2"])
def test_a_pretrained_model_of_other_shapes_exits_2_in_one_line_naming_the_key(
    dataset: Path, pretrained: dict[str, Path], tmp_path: Path, source_format: str
) -> None:
    experiment = tmp_path / "run"
    arguments = train_arguments(
        dataset, experiment, "training.train_iters=1", f"pretrained.format={source_format}",
        f"pretrained.path={pretrained[source_format]}", f"{FFN}=64",
    )  # fmt: skip
    assert_refused(run_cli(*arguments), CHANGES[f"{FFN}=64"])
    assert not (experiment / "checkpoint").exists()
