"""A mixture-of-experts run through the Trainer (flat buffers, fp32 gradients, AdamW): the
dropless path against the looped one."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.training.test_training_options import trainer


@pytest.mark.parametrize("kernels", ["references", "triton"])
def test_dropless_trains_like_looped_through_the_trainer(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: str
) -> None:
    # Every token goes to every expert, so rounding differences between the two paths cannot
    # flip a top-k choice over the steps; the expert weights' gradients reach the flat buffer.
    # With the kernels (the interpreter: one block, short sequences, fewer steps), the grouped
    # matmuls write them there themselves, each step's second micro-batch adding to the first.
    # Each step's summed gradient is compared before the update: AdamW's first steps move an
    # element whose gradient is near its epsilon by a sizeable part of the learning rate, so
    # the two paths' rounding shows up in the weights far above it (a query bias element
    # 1.4e-5 apart after one step, with torch 2.15, gradients 4e-7 apart relatively).
    steps, options = 10, ()
    if kernels == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        steps = 3
        options = ("model.base_model.transformer.num_layers=1", "batch.sequence_length=16")
    options += (
        "model.base_model.transformer.num_experts=4",
        "model.base_model.transformer.num_experts_per_token=4",
        "model.base_model.transformer.add_linear_biases=only_attn_qkv",
        "model.base_model.transformer.gated=true",
        "model.base_model.transformer.activation_type=silu",
        "model.base_model.transformer.expert_z_loss_coefficient=0.01",
        "batch.batch_size=2",
        "batch.micro_batch_size=1",  # two micro-batches per step
        f"training.train_iters={steps}",
    )
    runs = [
        trainer(
            dataset, tmp_path / path, *options, f"model.base_model.transformer.dropless_moe={v}"
        )
        for path, v in (("dropless", "true"), ("looped", "false"))
    ]
    # Each run's summed gradients, read as its optimizer step starts.
    gradients: list[list[list[torch.Tensor]]] = [[], []]
    for run, record in zip(runs, gradients, strict=True):
        monkeypatch.setattr(run.engine, "optimizer_step", _recording(run, record))
    for steps in zip(*(itertools.islice(run.data_loader(), steps) for run in runs), strict=True):
        pairs = zip(runs, steps, strict=True)
        losses = [run.engine.train_step(micro_batches)["loss"] for run, micro_batches in pairs]
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
        for ours, theirs in zip(gradients[0][-1], gradients[1][-1], strict=True):
            error = torch.linalg.vector_norm(ours - theirs)
            assert error <= 1e-5 * torch.linalg.vector_norm(theirs), float(error)


def _recording(run: Any, record: list[list[torch.Tensor]]) -> Callable[[], dict[str, Any]]:
    """`run.engine.optimizer_step` that first appends copies of the shards' gradients to `record`."""
    step = run.engine.optimizer_step

    def recording() -> dict[str, Any]:
        record.append(
            [shard.grad.clone() for shard in run.engine.stages.dense.buffers.shards.values()]
        )
        return step()

    return recording
