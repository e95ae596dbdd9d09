"""Expert parallelism under torchrun (Gloo CPU processes) against the single-process run of the
same global batch: the experts split over the ranks of an expert group, tokens exchanged by
all-to-all, the expert buffers sharded by ZeRO over the ranks holding the same experts; and
checkpoints moving between expert-parallel and plain layouts both ways."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.test_cli import fastllm as run_cli
from tests.torchrun import torchrun
from tests.training.conftest import train_arguments
from tests.training.test_data_parallel import final_weights
from tests.training.test_train_cli import losses

# Top-2 of 4 experts with a strong balance loss; 8 sequences per step, 4 micro-batches of 2 in
# the single process.
MOE_MODEL = (
    "model.base_model.transformer.num_experts=4",
    "model.base_model.transformer.num_experts_per_token=2",
    "model.base_model.transformer.add_linear_biases=only_attn_qkv",
    "model.base_model.transformer.expert_auxiliary_loss_coefficient=0.1",
    "model.base_model.transformer.expert_z_loss_coefficient=0.01",
)
MOE = (
    *MOE_MODEL,
    "batch.batch_size=8",
    "training.checkpoint.interval=3",
    "training.export.interval=6",
    "training.export.format=distributed",
)


@pytest.fixture(scope="module")
def reference(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The single process: 6 steps, checkpoint at 3, distributed export at 6."""
    experiment = tmp_path_factory.mktemp("expert_parallel") / "single"
    result = run_cli(*train_arguments(dataset, experiment, *MOE, "training.train_iters=6"))
    assert result.returncode == 0, result.stderr
    return experiment


def _assert_matches(experiment: Path, reference: Path, steps: range) -> None:
    expected, got = losses(reference), losses(experiment)
    for step in steps:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step
    load = {
        r["step"]: (r["expert_tokens_max"], r["expert_tokens_mean"]) for r in _records(reference)
    }
    for record in _records(experiment):
        assert (record["expert_tokens_max"], record["expert_tokens_mean"]) == load[record["step"]]
    ours, theirs = final_weights(experiment, 6), final_weights(reference, 6)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-5, msg=name)


def _records(experiment: Path) -> list[dict]:
    lines = (experiment / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def test_dp4_ep2_zero3_matches_one_process_and_resumes_without_expert_parallelism(
    dataset: Path, reference: Path, tmp_path: Path
) -> None:
    # 2 expert groups of 2 ranks: each expert's buffer is sharded over, and its gradient summed
    # across, the 2 ranks holding it.
    experiment = tmp_path / "ep"
    zero3 = ("model.multi_stage.zero_stage=3", "model.distributed.expert_parallel=2")
    arguments = train_arguments(dataset, experiment, *MOE, *zero3, "training.train_iters=3")
    result = torchrun(4, *arguments)
    assert result.returncode == 0, result.stderr
    assert "expert parallel 2" in result.stdout
    manifest = json.loads((experiment / "checkpoint" / "3" / "manifest.json").read_text())
    assert manifest["expert_parallel"] == 2
    assert {p[0] for p in manifest["expert_parameters"]} == {
        f"layers.{i}.mlp.layer_{j}" for i in range(2) for j in (1, 2)
    }
    # Whole experts on two ranks, each expert-parallel share read back from its shards.
    result = torchrun(2, *train_arguments(dataset, experiment, *MOE, "training.train_iters=6"))
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stdout
    _assert_matches(experiment, reference, range(1, 7))


@pytest.mark.parametrize(
    "layout",
    [
        # 2 pipeline ranks of 2 data ranks each, the data ranks of a stage splitting its experts.
        ("model.distributed.pipeline_parallel=2", "schedule.breadth_first_micro_batches=2"),
        # 2 tensor ranks of 2 data ranks each: tensor rank t exchanges tokens with tensor rank t
        # of the other data rank and computes its half of each expert's ffn.
        ("model.distributed.tensor_parallel=2", "model.distributed.sequence_tensor_parallel=true"),
    ],
    ids=["pp2-ep2", "tp2-ep2-sequence-parallel"],
)
def test_ep2_with_model_parallelism_matches_one_process(
    dataset: Path, reference: Path, tmp_path: Path, layout: tuple[str, ...]
) -> None:
    # The export holds every expert whole, its tensor slices merged.
    experiment = tmp_path / "ep"
    layout = (*layout, "model.distributed.expert_parallel=2", "training.train_iters=6")
    result = torchrun(4, *train_arguments(dataset, experiment, *MOE, *layout))
    assert result.returncode == 0, result.stderr
    assert "expert parallel 2" in result.stdout
    _assert_matches(experiment, reference, range(1, 7))


def test_a_one_process_checkpoint_resumes_with_expert_parallelism_on_the_looped_experts(
    dataset: Path, reference: Path, tmp_path: Path
) -> None:
    experiment = tmp_path / "ep"
    (experiment / "checkpoint").mkdir(parents=True)
    shutil.copytree(reference / "checkpoint" / "3", experiment / "checkpoint" / "3")
    overrides = (
        "model.distributed.expert_parallel=2",
        "model.multi_stage.zero_stage=2",
        "model.base_model.transformer.dropless_moe=false",
        "training.train_iters=6",
    )
    result = torchrun(2, *train_arguments(dataset, experiment, *MOE, *overrides))
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stdout
    _assert_matches(experiment, reference, range(4, 7))
