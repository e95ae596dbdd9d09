"""A run with reference models (DPO against its starting point, distillation from a teacher)
stopped at a checkpoint and resumed logs, bit for bit, what the uninterrupted run logs, and
ends with the same weights: the reference models are loaded again, unchanged, and nothing of
theirs is lost or taken from the trained model's checkpoint."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fastllm.training.trainer import Trainer
from tests.training.test_distillation import TEACHER_RUN, distilling
from tests.training.test_dpo import dpo_config, llamas_and_pairs
from tests.training.test_training_options import trainer

DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen")
CHECKPOINTS = ("training.train_iters=4", "training.checkpoint.interval=2")


def trained(run: Trainer) -> dict[str, torch.Tensor]:
    """`run` fitted (resuming its experiment's newest checkpoint, if any); its weights."""
    assert run.fit() is None
    run.wait_for_checkpoints()
    return dict(run.engine.whole_parameters())


def logged(experiment: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (experiment / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "loss" in r}


def assert_resumed_as_uninterrupted(
    make: Callable[[Path, tuple[str, ...]], Trainer], tmp_path: Path, keys: tuple[str, ...]
) -> None:
    """Four steps straight, and two steps then, in a new trainer (its reference models loaded
    afresh), two more from the checkpoint of step 2: the same `keys` logged at each step and
    the same final weights, exactly. A reference model's weights off by 1e-4 in one tensor
    change the loss of step 3."""
    straight = trained(make(tmp_path / "straight", CHECKPOINTS))
    part = tmp_path / "part"
    trained(make(part, (*CHECKPOINTS, "training.train_iters=2")))
    assert (part / "checkpoint" / "2").is_dir()
    resumed = make(part, CHECKPOINTS)
    assert resumed.resume() == part / "checkpoint" / "2"
    assert resumed.engine.state.step == 2
    weights = trained(resumed)
    expected, got = logged(tmp_path / "straight"), logged(part)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    for step, record in expected.items():
        for key in ("loss", "grad_norm", "lr", *keys):
            assert got[step][key] == record[key], (step, key)
    for name, tensor in straight.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0, msg=name)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return llamas_and_pairs(tmp_path_factory.mktemp("dpo_resume"))


def test_a_dpo_run_resumes_exactly(pairs, tmp_path: Path) -> None:
    def make(experiment: Path, overrides: tuple[str, ...]) -> Trainer:
        return Trainer(dpo_config(pairs, experiment, *overrides))

    assert_resumed_as_uninterrupted(make, tmp_path, DPO_METRICS)


def test_a_distillation_run_resumes_exactly(
    dataset: Path, one_process: Callable[..., Path], tmp_path: Path
) -> None:
    teacher = one_process(*TEACHER_RUN) / "export" / "4"

    def make(experiment: Path, overrides: tuple[str, ...]) -> Trainer:
        return trainer(dataset, experiment, *distilling(teacher), *overrides)

    assert_resumed_as_uninterrupted(make, tmp_path, ("label_loss", "kd_loss"))
