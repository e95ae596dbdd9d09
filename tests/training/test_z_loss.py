"""The z-loss head loss (`type: z_loss`) beside the label loss: each logged as NAME_loss, the
values plain torch gives on the model's logits, their weighted sum the loss trained on, and two
tensor ranks against one process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.training.conftest import Launched, Layout
from tests.training.test_distillation import logged
from tests.training.test_training_options import trainer

LOSSES = (
    "model.base_model.head.losses={label: {type: label, weight: 0.5}, "
    "z: {type: z_loss, weight: 0.01}}",
)


def test_z_loss_is_the_mean_squared_logsumexp_mixed_with_the_label_loss_by_weight(
    dataset: Path, tmp_path: Path
) -> None:
    run = trainer(dataset, tmp_path / "run", "training.train_iters=1", *LOSSES)
    batches = next(iter(run.data_loader()))
    with torch.no_grad():  # the weights the step starts from
        logits = torch.cat([run.engine.model(b.input_ids).float().flatten(0, 1) for b in batches])
    labels = torch.cat([b.labels.flatten() for b in batches])
    metrics = run.engine.train_step(batches)

    trained = labels != -100
    z = (torch.logsumexp(logits, dim=-1)[trained] ** 2).mean().item()
    cross_entropy = F.cross_entropy(logits, labels).item()
    assert metrics["z_loss"] == pytest.approx(z, rel=1e-5)
    assert metrics["label_loss"] == pytest.approx(cross_entropy, rel=1e-5)
    assert metrics["loss"] == pytest.approx(0.5 * cross_entropy + 0.01 * z, rel=1e-5)


STEPS = ("training.train_iters=3",)
TENSOR = ("model.distributed.tensor_parallel=2", "model.distributed.sequence_tensor_parallel=true")


def layouts(dataset: Path, one_process, root: Path) -> dict[str, Layout]:
    return {"z_loss_tensor": Layout(2, (*STEPS, *LOSSES, *TENSOR))}


def test_two_tensor_ranks_with_a_z_loss_match_one_process(
    launched: dict[str, Launched], one_process: Callable[..., Path]
) -> None:
    single = one_process(*STEPS, *LOSSES)
    double = launched["z_loss_tensor"].succeeded()
    for key in ("loss", "label_loss", "z_loss"):
        expected, got = logged(single, key), logged(double, key)
        assert sorted(got) == sorted(expected) == [1, 2, 3]
        for step, value in expected.items():
            assert got[step] == pytest.approx(value, rel=1e-5), (key, step)
