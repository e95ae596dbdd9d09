"""Checkpoints and exports that fastllm wrote at commit c14b8b5 (tests/checkpoint/fixtures/,
made there by make_c14b8b5.py), read by today's code through the command line, as a user
would: a c14b8b5 checkpoint resumes to the losses of c14b8b5's uninterrupted run, bit for bit,
and today's exports of the same state are c14b8b5's bytes. The runs compute on one thread per
process, as the fixture's did (the bits of a CPU run depend on the thread count)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.checkpoint.fixtures.make_c14b8b5 import (
    CHECKPOINT,
    CONVERTED,
    EXPORT,
    FIXTURE,
    RUNS,
    THREADS,
    convert,
    dataset_digests,
    run_arguments,
)
from tests.data.conftest import run_cli
from tests.training.conftest import Launched, Layout
from tests.training.test_train_cli import losses

RECORD = json.loads((FIXTURE / "fixture.json").read_text())
FINAL_CHECKPOINT = "checkpoint/4"


def layouts(dataset: Path, one_process: Callable[..., Path], root: Path) -> dict[str, Layout]:
    """Today's two-rank runs (one thread per rank, torchrun's default): c14b8b5's checkpoint
    resumed, and the whole run."""
    run = RUNS["two_ranks"]
    checkpoint = FIXTURE / "two_ranks" / CHECKPOINT
    return {
        "resumed": Layout(run.ranks, run.overrides(), resumes=checkpoint),
        "uninterrupted": Layout(run.ranks, run.overrides()),
    }


@pytest.fixture(scope="module")
def same_dataset(dataset: Path) -> Path:
    """The training tests' dataset, checked to be the bytes c14b8b5's runs trained on."""
    assert dataset_digests(dataset) == RECORD["dataset"], (
        f"not the dataset of c14b8b5's runs, which Python {RECORD['python']} built from its "
        "json and email sources"
    )
    return dataset


@contextmanager
def threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_process_runs(
    same_dataset: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Today's one-process runs: c14b8b5's checkpoint resumed, and the whole run."""
    root = tmp_path_factory.mktemp("c14b8b5")
    shutil.copytree(FIXTURE / "one_process" / CHECKPOINT, root / "resumed" / CHECKPOINT)
    with threads(THREADS):
        for name in ("resumed", "uninterrupted"):
            result = run_cli(*run_arguments(same_dataset, root / name, "one_process"))
            assert result.returncode == 0, result.stderr
    return {name: root / name for name in ("resumed", "uninterrupted")}


@pytest.fixture(scope="module")
def two_ranks_runs(same_dataset: Path, launched: dict[str, Launched]) -> dict[str, Path]:
    return {name: launched[name].succeeded() for name in ("resumed", "uninterrupted")}


def assert_same_files(got: Path, expected: Path, pattern: str = "*") -> None:
    """`got` holds the files of `expected` that match `pattern`, byte for byte, and no others."""
    names = sorted(p.relative_to(expected) for p in expected.rglob(pattern) if p.is_file())
    assert sorted(p.relative_to(got) for p in got.rglob(pattern) if p.is_file()) == names
    differ = [str(n) for n in names if (got / n).read_bytes() != (expected / n).read_bytes()]
    assert not differ, f"{got}: not the bytes of {expected} in {differ}"


@pytest.mark.parametrize("run", RUNS)
def test_a_c14b8b5_checkpoint_resumes_bit_for_bit(request: pytest.FixtureRequest, run: str) -> None:
    # The losses of c14b8b5's run and of today's whole run, and today's final state (weights,
    # Adam's moments, random state; the manifests name their directories).
    experiments = request.getfixturevalue(f"{run}_runs")
    recorded = {int(step): loss for step, loss in RECORD["losses"][run].items()}
    assert sorted(recorded) == [1, 2, 3, 4]
    made = f"c14b8b5's, made with torch {RECORD['torch']} on {RECORD['cpu_capability']}"
    assert losses(experiments["resumed"]) == {step: recorded[step] for step in (3, 4)}, made
    assert losses(experiments["uninterrupted"]) == recorded, made
    assert_same_files(
        experiments["resumed"] / FINAL_CHECKPOINT,
        experiments["uninterrupted"] / FINAL_CHECKPOINT,
        "*.safetensors",
    )


@pytest.mark.parametrize("run", [name for name, run in RUNS.items() if run.exports])
def test_training_exports_c14b8b5s_bytes_at_step_2(
    request: pytest.FixtureRequest, run: str
) -> None:
    # The trainer's export from its weights in memory, at the step whose state c14b8b5's run
    # exported (the resume test checks that today's run reaches that state).
    experiments = request.getfixturevalue(f"{run}_runs")
    assert_same_files(experiments["uninterrupted"] / EXPORT, FIXTURE / run / EXPORT)


@pytest.mark.parametrize("output_format", CONVERTED)
@pytest.mark.parametrize("run", RUNS)
def test_converting_a_c14b8b5_checkpoint_writes_c14b8b5s_bytes(
    tmp_path: Path, run: str, output_format: str
) -> None:
    output = tmp_path / output_format
    convert(FIXTURE / run / CHECKPOINT, output_format, output)
    assert_same_files(output, FIXTURE / run / "converted" / output_format)
