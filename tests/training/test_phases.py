"""A run of two phases (`training.phases`): at its boundary the blend and the learning-rate
schedule switch, the switch is logged, and a run stopped before the boundary or after it and
resumed trains the uninterrupted run's steps bit for bit."""

from __future__ import annotations

import json
import math
import os
import signal
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from fastllm.config import ConfigError, TrainerConfig, build, load_raw
from fastllm.config.phases import phase_seed
from fastllm.data import SampleStream
from fastllm.engine.engine import Engine
from fastllm.training import Trainer
from fastllm.training.setup import check_inputs
from tests.data.conftest import prepare
from tests.data.conftest import run_cli as in_process
from tests.training.conftest import STDLIB, Launched, Layout, train_arguments
from tests.training.test_train_cli import assert_same_losses

BEGIN, STEPS, BATCH = 3, 6, 4


def other_dataset(dataset: Path) -> Path:
    """Another dataset beside `dataset` (the urllib package's sources) made with its
    tokenizer, at the first call."""
    output = dataset.parent / "urllib"
    if not output.is_dir():
        tokenizer = dataset.parent / "tokenizer"
        prepare(STDLIB / "urllib", tokenizer, output, "input.extensions=[.py]")
    return output


@pytest.fixture
def other(dataset: Path) -> Path:
    return other_dataset(dataset)


def phased(dataset: Path, other: Path) -> tuple[str, ...]:
    """Three steps on `dataset`, then three on a blend weighted towards `other` with the
    learning rate decaying linearly to 0 from where it was."""
    return (
        f"training.train_iters={STEPS}",
        f"training.phases=[{{begin_step: {BEGIN}, data: {{path: [{dataset}, {other}], "
        "weights: [1, 3]}, learning_rate: {decay_style: linear}}]",
    )


def layouts(dataset: Path, one_process: Callable[..., Path], root: Path) -> dict[str, Layout]:
    """The two-phase run on two data-parallel ranks (trained for the fixture `launched`)."""
    return {"two-ranks": Layout(2, phased(dataset, other_dataset(dataset)))}


def records(experiment: Path) -> list[dict]:
    return [json.loads(line) for line in (experiment / "metrics.jsonl").read_text().splitlines()]


def trainer(dataset: Path, experiment: Path, *overrides: str) -> Trainer:
    arguments = train_arguments(dataset, experiment, *overrides)
    config_files = [arguments[arguments.index("-c") + 1]]
    return Trainer(build(TrainerConfig, load_raw(config_files, [a for a in arguments if "=" in a])))


def stopped_after(steps: set[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM (a preemption) reaches the run right after each of `steps`."""
    train_step = Engine.train_step

    def step_then_signal(engine: Engine, micro_batches: list) -> dict:
        metrics = train_step(engine, micro_batches)
        if engine.state.step in steps:
            os.kill(os.getpid(), signal.SIGTERM)
        return metrics

    monkeypatch.setattr(Engine, "train_step", step_then_signal)


SWITCH = "fastllm: phase 1 (training.phases[0]) begins after step 3; data ["


def test_the_boundary_switches_blend_and_schedule_and_resumes_bit_for_bit(
    dataset: Path,
    other: Path,
    one_process: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    logged = records(one_process(*phased(dataset, other)))
    assert [r["step"] for r in logged if "phase" in r] == [BEGIN + 1]
    assert [r["phase"] for r in logged if "phase" in r] == [1]
    # tiny.yaml's cosine schedule (1e-3 to 1e-4; warmup 2, decay 8 steps here) until the
    # boundary, then down to 0 in the phase's 3 steps from the rate of step 3.
    last = 1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi / 8))
    lr = {r["step"]: r["lr"] for r in logged if "lr" in r}
    assert [lr[s] for s in range(1, STEPS + 1)] == pytest.approx(
        [5e-4, 1e-3, last, last * 2 / 3, last / 3, 0.0], rel=1e-12
    )

    # Stopped after step 3 (at the boundary, before crossing it), resumed and stopped after
    # step 5 (it crossed the boundary in between), resumed to the end. (The blend a run
    # resumed at any step reads is the next test's.)
    interrupted = tmp_path / "interrupted"
    arguments = train_arguments(dataset, interrupted, *phased(dataset, other))
    with monkeypatch.context() as patch:
        stopped_after({BEGIN, 5}, patch)
        first, second = in_process(*arguments), in_process(*arguments)
    assert (first.returncode, second.returncode) == (143, 143), first.stderr + second.stderr
    assert SWITCH not in first.stdout and second.stdout.count(SWITCH) == 1, second.stdout
    third = in_process(*arguments)
    assert third.returncode == 0, third.stderr
    assert "resumed from" in third.stdout and SWITCH not in third.stdout
    losses = {r["step"]: r["loss"] for r in logged if "loss" in r}
    resumed = records(interrupted)
    assert {r["step"]: r["loss"] for r in resumed if "loss" in r} == losses
    assert {r["step"]: r["lr"] for r in resumed if "lr" in r} == lr
    assert [r["step"] for r in resumed if "phase" in r] == [BEGIN + 1]


def test_each_phase_reads_its_own_blend_whenever_the_run_resumed(
    dataset: Path, other: Path, tmp_path: Path
) -> None:
    # Without FIM, which transforms a sample by its place in the blend: the phase's samples
    # are then its datasets' own.
    run = trainer(dataset, tmp_path / "run", *phased(dataset, other), "data.fim=null")
    config, seed = run.config, run.config.model.distributed.seed

    def stream(paths: list[Path], seed: int, steps: int, weights: list[float] | None) -> np.ndarray:
        samples = SampleStream(
            [str(p) for p in paths],
            config.data,
            sequence_length=config.batch.sequence_length,
            num_samples=steps * BATCH,
            seed=seed,
            cache_dir=tmp_path / "cache",
            weights=weights,
        )
        return samples.read(0, steps * BATCH).tokens[:, :-1]

    first = stream([dataset], seed, BEGIN, None)
    blend = stream([dataset, other], phase_seed(seed, BEGIN), STEPS - BEGIN, [1, 3])
    expected = np.concatenate([first, blend])

    def trained(step: int) -> np.ndarray:
        """The inputs of the steps after `step`, as a run resumed there reads them."""
        run.engine.state.step, run.engine.state.consumed_samples = step, step * BATCH
        batches = [b.input_ids.numpy() for micro in run.data_loader() for b in micro]
        return np.concatenate(batches)

    for step in (0, BEGIN - 1, BEGIN, BEGIN + 1):
        assert np.array_equal(trained(step), expected[step * BATCH :]), step
    # The phase's samples are those of its two datasets drawn with its seed: 3 of the other's
    # for 1 of the first's.
    own = stream([dataset], phase_seed(seed, BEGIN), 1, None)[:3]
    others = stream([other], phase_seed(seed, BEGIN), 3, None)[:9]
    assert sorted(map(tuple, blend)) == sorted(map(tuple, np.concatenate([own, others])))


def test_a_phase_naming_a_missing_dataset_is_refused(dataset: Path, tmp_path: Path) -> None:
    arguments = train_arguments(
        dataset,
        tmp_path / "run",
        "training.phases=[{begin_step: 2, data: {path: [/nonexistent/dataset]}}]",
    )
    config = build(
        TrainerConfig, load_raw(["examples/tiny.yaml"], [a for a in arguments if "=" in a])
    )
    with pytest.raises(ConfigError) as error:
        check_inputs(config)
    assert error.value.path == "training.phases[0].data.path[0]"
    assert "no such dataset" in error.value.message


def test_two_ranks_match_one_process_across_the_boundary(
    dataset: Path,
    other: Path,
    launched: dict[str, Launched],
    one_process: Callable[..., Path],
) -> None:
    two = launched["two-ranks"]
    assert two.result.stdout.count(SWITCH) == 1, "rank 0 says it, once"
    assert_same_losses(one_process(*phased(dataset, other)), two.succeeded(), STEPS, rel=1e-5)
    assert [r["step"] for r in records(two.experiment) if "phase" in r] == [BEGIN + 1]
