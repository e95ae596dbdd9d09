"""Expert parallelism under torchrun (Gloo CPU processes) against the single-process run of the
same global batch: the experts split over the ranks of an expert group, tokens exchanged by
all-to-all, the expert buffers sharded by ZeRO over the ranks holding the same experts; and
checkpoints moving between expert-parallel and plain layouts both ways."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.training.conftest import Launched, Layout
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
EP_2 = "model.distributed.expert_parallel=2"
NO_EXPORT = "training.export.interval=null"  # for a run of MOE stopped at step 3 to resume


@pytest.fixture(scope="module")
def reference(one_process: Callable[..., Path]) -> Path:
    """The single process: 6 steps, checkpoint at 3, distributed export at 6."""
    return one_process(*MOE, "training.train_iters=6")


def layouts(dataset: Path, one_process: Callable[..., Path], root: Path) -> dict[str, Layout]:
    """The layouts of this module (trained for the fixture `launched`, see conftest.py)."""
    reference = one_process(*MOE, "training.train_iters=6")
    six = "training.train_iters=6"
    return {
        # 2 expert groups of 2 ranks: each expert's buffer is sharded over, and its gradient
        # summed across, the 2 ranks holding it.
        "dp4-ep2-zero3": Layout(
            4,
            (*MOE, "model.multi_stage.zero_stage=3", EP_2, "training.train_iters=3", NO_EXPORT),
        ),
        # 2 tensor ranks of 2 data ranks each: tensor rank t exchanges tokens with tensor
        # rank t of the other data rank and computes its half of each expert's ffn.
        "tp2-ep2-sequence-parallel": Layout(
            4,
            (
                *MOE,
                "model.distributed.tensor_parallel=2",
                "model.distributed.sequence_tensor_parallel=true",
                EP_2,
                six,
            ),
        ),
        # 2 pipeline ranks of 2 data ranks each, the data ranks of a stage splitting its
        # experts.
        "pp2-ep2": Layout(
            4,
            (
                *MOE,
                "model.distributed.pipeline_parallel=2",
                EP_2,
                "schedule.breadth_first_micro_batches=2",
                six,
            ),
        ),
        # Compiled blocks: dynamo traces the token exchange (its split sizes read by the host
        # break the graph there, the rest of the mixture compiles).
        "ep2-compiled": Layout(
            2, (*MOE, EP_2, "training.compile=true", "training.train_iters=2", NO_EXPORT)
        ),
        # Whole experts on two ranks, each expert-parallel share read back from its shards.
        "dp4-ep2-zero3-resumed-on-dp2": Layout(
            2, (*MOE, six), root / "dp4-ep2-zero3" / "checkpoint" / "3"
        ),
        "one-process-resumed-on-ep2-looped": Layout(
            2,
            (
                *MOE,
                EP_2,
                "model.multi_stage.zero_stage=2",
                "model.base_model.transformer.dropless_moe=false",
                six,
            ),
            reference / "checkpoint" / "3",
        ),
    }


def _assert_matches(experiment: Path, reference: Path, steps: range, weights: bool = True) -> None:
    expected, got = losses(reference), losses(experiment)
    assert sorted(got) == list(steps)
    for step in steps:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step
    load = {
        r["step"]: (r["expert_tokens_max"], r["expert_tokens_mean"]) for r in _records(reference)
    }
    for record in _records(experiment):
        assert (record["expert_tokens_max"], record["expert_tokens_mean"]) == load[record["step"]]
    if not weights:
        return
    ours, theirs = final_weights(experiment, 6), final_weights(reference, 6)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-5, msg=name)


def _records(experiment: Path) -> list[dict]:
    lines = (experiment / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def test_dp4_ep2_zero3_matches_one_process_and_resumes_without_expert_parallelism(
    reference: Path, launched: dict[str, Launched]
) -> None:
    run = launched["dp4-ep2-zero3"]
    experiment = run.succeeded()
    assert "expert parallel 2" in run.result.stdout
    manifest = json.loads((experiment / "checkpoint" / "3" / "manifest.json").read_text())
    assert manifest["expert_parallel"] == 2
    assert {p[0] for p in manifest["expert_parameters"]} == {
        f"layers.{i}.mlp.layer_{j}" for i in range(2) for j in (1, 2)
    }
    _assert_matches(experiment, reference, range(1, 4), weights=False)
    resumed = launched["dp4-ep2-zero3-resumed-on-dp2"]
    assert "resumed from" in resumed.result.stdout
    _assert_matches(resumed.succeeded(), reference, range(4, 7))


@pytest.mark.parametrize("name", ["pp2-ep2", "tp2-ep2-sequence-parallel"])
def test_ep2_with_model_parallelism_matches_one_process(
    reference: Path, launched: dict[str, Launched], name: str
) -> None:
    # The export holds every expert whole, its tensor slices merged.
    assert "expert parallel 2" in launched[name].result.stdout
    _assert_matches(launched[name].succeeded(), reference, range(1, 7))


def test_ep2_in_compiled_blocks_matches_one_process(
    reference: Path, launched: dict[str, Launched]
) -> None:
    run = launched["ep2-compiled"]
    assert "expert parallel 2" in run.result.stdout
    assert "compiled blocks" in run.result.stdout
    _assert_matches(run.succeeded(), reference, range(1, 3), weights=False)


def test_a_one_process_checkpoint_resumes_with_expert_parallelism_on_the_looped_experts(
    reference: Path, launched: dict[str, Launched]
) -> None:
    resumed = launched["one-process-resumed-on-ep2-looped"]
    assert "resumed from" in resumed.result.stdout
    _assert_matches(resumed.succeeded(), reference, range(4, 7))
