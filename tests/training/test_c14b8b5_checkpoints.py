"""Checkpoints and exports that fastllm wrote at commit c14b8b5 (tests/checkpoint/fixtures/,
made there by make_c14b8b5.py), read by today's code through the command line, as a user
would: a c14b8b5 checkpoint resumes to the losses and the final state of c14b8b5's
uninterrupted run, today's export of that state is c14b8b5's files, and converting a c14b8b5
checkpoint writes c14b8b5's bytes. The runs compute on one thread per process, as the fixture's
did (the bits of a CPU run depend on the thread count).

The bits of a training step also depend on the host: with the same torch and AVX512, an AMD EPYC
computes the backward a few ulps from the fixture's host (after two steps, exp_avg 1.5 and
exp_avg_sq 2.2 units of fp32 rounding apart at each tensor's largest value), and hosts drew the
initial weights a few ulps apart. So steps are held to c14b8b5's to fp32's
rounding (ROUNDINGS units at each tensor's scale, far below what a misread moment, master or
step count moves), while conversion, which computes nothing, is held to c14b8b5's bytes.
Resuming bit for bit on one host is test_train_cli's."""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.checkpoint.fixtures.make_c14b8b5 import (
    CHECKPOINT,
    CONVERTED,
    EXPORT,
    FINAL_CHECKPOINT,
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
ROUNDINGS = 16
"""How many units of fp32 rounding, at a tensor's largest magnitude, a step's state may move by
from c14b8b5's on another host."""


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
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = run_cli(*run_arguments(same_dataset, root / name, "one_process"))
            assert result.returncode == 0, result.stderr
            (root / f"{name}.warnings").write_text("\n".join(str(w.message) for w in caught))
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


def assert_close_to(
    got: torch.Tensor, expected: torch.Tensor, what: str, scale: float | None = None
) -> None:
    """`got` is `expected` within ROUNDINGS units of rounding at `scale` (by default
    `expected`'s largest magnitude); exact when not floating point (random state, counters)."""
    assert (got.dtype, got.shape) == (expected.dtype, expected.shape), what
    if not expected.is_floating_point():
        assert torch.equal(got, expected), what
        return
    rounding = (scale or expected.abs().max().item()) * torch.finfo(expected.dtype).eps
    moved = (got.double() - expected.double()).abs().max().item()
    assert moved <= ROUNDINGS * rounding, (
        f"{what}: moved {moved:.3g}, {moved / rounding:.1f} roundings"
    )


def assert_same_export(got: Path, expected: Path) -> None:
    """`got` holds the files of `expected`: the same bytes, but for safetensors files, whose
    header (names, dtypes, shapes, metadata) is the same and whose tensors are close at the
    scale of the file's largest weight (a key bias, which softmax ignores, trains on rounding
    noise alone, so its own scale is no measure)."""
    names = sorted(p.relative_to(expected) for p in expected.rglob("*") if p.is_file())
    assert sorted(p.relative_to(got) for p in got.rglob("*") if p.is_file()) == names
    for name in names:
        if name.suffix != ".safetensors":
            assert (got / name).read_bytes() == (expected / name).read_bytes(), name
            continue
        assert header(got / name) == header(expected / name), name
        ours, theirs = load_file(got / name), load_file(expected / name)
        scale = max(t.abs().max().item() for t in theirs.values() if t.is_floating_point())
        for key, tensor in theirs.items():
            assert_close_to(ours[key], tensor, f"{name}: {key}", scale)


def header(path: Path) -> dict[str, object]:
    """A safetensors file's header without the data offsets: names, dtypes, shapes, metadata."""
    with path.open("rb") as file:
        size = int.from_bytes(file.read(8), "little")
        entries = json.loads(file.read(size))
    return {
        name: entry
        if name == "__metadata__"
        else {k: v for k, v in entry.items() if k != "data_offsets"}
        for name, entry in entries.items()
    }


def tensors(checkpoint: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Each rank file's tensors: weights, Adam's moments, random state."""
    return {path.name: load_file(path) for path in sorted(checkpoint.glob("*.safetensors"))}


@pytest.mark.parametrize("run", RUNS)
def test_a_c14b8b5_checkpoint_resumes_to_its_losses_and_state(
    request: pytest.FixtureRequest, run: str
) -> None:
    # Steps 3 and 4 from c14b8b5's step-2 checkpoint: its losses and its final state, to fp32's
    # rounding on another host (module docstring).
    experiments = request.getfixturevalue(f"{run}_runs")
    recorded = {int(step): loss for step, loss in RECORD["losses"][run].items()}
    assert sorted(recorded) == [1, 2, 3, 4]
    made = f"c14b8b5's, made with torch {RECORD['torch']} on {RECORD['cpu_capability']}"
    resumed = {step: recorded[step] for step in (3, 4)}
    assert losses(experiments["resumed"]) == pytest.approx(resumed, rel=1e-6, abs=0), made
    got = tensors(experiments["resumed"] / FINAL_CHECKPOINT)
    expected = tensors(FIXTURE / run / FINAL_CHECKPOINT)
    assert {name: sorted(t) for name, t in got.items()} == {
        name: sorted(t) for name, t in expected.items()
    }
    for name, rank_tensors in expected.items():
        for key, tensor in rank_tensors.items():
            assert_close_to(got[name][key], tensor, f"{name}: {key} is not {made}")


def test_resuming_a_c14b8b5_checkpoint_warns_only_of_keys_the_run_changed(
    one_process_runs: dict[str, Path],
) -> None:
    # The dataset is built elsewhere; keys added since c14b8b5 keep their defaults, unchanged.
    caught = (one_process_runs["resumed"].parent / "resumed.warnings").read_text()
    assert "differs from the checkpoint's in data.path (the checkpoint's" in caught, caught


@pytest.mark.parametrize("run", RUNS)
def test_a_whole_run_follows_c14b8b5s_losses(request: pytest.FixtureRequest, run: str) -> None:
    # From today's initial weights: c14b8b5's losses to fp32's rounding (module docstring).
    experiments = request.getfixturevalue(f"{run}_runs")
    recorded = {int(step): loss for step, loss in RECORD["losses"][run].items()}
    assert losses(experiments["uninterrupted"]) == pytest.approx(recorded, rel=1e-6, abs=0)


@pytest.mark.parametrize("run", [name for name, run in RUNS.items() if run.exports])
def test_training_exports_c14b8b5s_files_at_step_4(
    request: pytest.FixtureRequest, run: str
) -> None:
    # The trainer's export from its weights in memory after resuming c14b8b5's checkpoint, at the
    # step whose state c14b8b5's run exported.
    experiments = request.getfixturevalue(f"{run}_runs")
    assert_same_export(experiments["resumed"] / EXPORT, FIXTURE / run / EXPORT)


@pytest.mark.parametrize("output_format", CONVERTED)
@pytest.mark.parametrize("run", RUNS)
def test_converting_a_c14b8b5_checkpoint_writes_c14b8b5s_bytes(
    tmp_path: Path, run: str, output_format: str
) -> None:
    output = tmp_path / output_format
    convert(FIXTURE / run / CHECKPOINT, output_format, output)
    assert_same_files(output, FIXTURE / run / "converted" / output_format)
