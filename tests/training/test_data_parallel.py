"""Data parallelism under torchrun (2 and 4 Gloo CPU processes) against the single-process run of
the same global batch, and resharded resumption."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.test_cli import fastllm as run_cli
from tests.torchrun import torchrun
from tests.training.conftest import train_arguments
from tests.training.test_train_cli import losses


def final_weights(experiment: Path, step: int) -> dict[str, torch.Tensor]:
    import fastllm

    return dict(fastllm.load_model(experiment / "export" / str(step)).state_dict())


@pytest.mark.parametrize(
    ("ranks", "dtype", "zero_stage"),
    [
        *((2, dtype, stage) for stage in (1, 2, 3) for dtype in ("float32", "bfloat16")),
        *((4, "float32", stage) for stage in (1, 2, 3)),
    ],
)
def test_ranks_match_one_process_on_the_same_global_batch(
    dataset: Path, tmp_path: Path, ranks: int, dtype: str, zero_stage: int
) -> None:
    _assert_ranks_match_one_process(
        dataset, tmp_path, ranks, dtype, f"model.multi_stage.zero_stage={zero_stage}"
    )


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_accumulated_micro_batches_match_one_process(
    dataset: Path, tmp_path: Path, zero_stage: int
) -> None:
    # 8 sequences over 2 ranks in micro-batches of 2: each rank accumulates 2, and ZeRO-1 sums
    # over ranks during the second backward pass only.
    _assert_ranks_match_one_process(
        dataset, tmp_path, 2, "float32",
        f"model.multi_stage.zero_stage={zero_stage}", "batch.batch_size=8",
    )  # fmt: skip


def _assert_ranks_match_one_process(
    dataset: Path, tmp_path: Path, ranks: int, dtype: str, *overrides: str
) -> None:
    overrides = (
        f"model.distributed.training_dtype={dtype}",
        *overrides,
        "training.train_iters=6",
        "training.export.interval=6",
        "training.export.format=distributed",
    )
    single = tmp_path / "single"
    result = run_cli(*train_arguments(dataset, single, *overrides))
    assert result.returncode == 0, result.stderr
    double = tmp_path / "double"
    result = torchrun(ranks, *train_arguments(dataset, double, *overrides))
    assert result.returncode == 0, result.stderr
    expected, got = losses(single), losses(double)
    assert sorted(got) == sorted(expected)
    tolerance = 1e-5 if dtype == "float32" else 1e-2
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=tolerance), step
    manifest = json.loads((double / "export" / "6" / "manifest.json").read_text())
    assert manifest["world_size"] == ranks
    assert len(list((double / "export" / "6").glob("rank_*.safetensors"))) == ranks
    ours, theirs = final_weights(double, 6), final_weights(single, 6)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=tolerance, atol=tolerance, msg=name)


def test_zero3_with_untied_head_recompute_stages_of_two_blocks_validation_and_hf_export(
    dataset: Path, tmp_path: Path
) -> None:
    overrides = (
        "model.base_model.tie_word_embeddings=false",
        "model.base_model.transformer.num_layers=3",
        "model.multi_stage.recompute=full",
        f"data.validation_path=[{dataset}]",
        "training.validation.interval=2",
        "training.validation.iterations=2",
        "training.train_iters=4",
        "training.export.interval=4",
        "training.export.format=starcoder2",
    )
    single = tmp_path / "single"
    assert run_cli(*train_arguments(dataset, single, *overrides)).returncode == 0
    sharded = tmp_path / "sharded"
    result = torchrun(
        2,
        *train_arguments(
            dataset,
            sharded,
            *overrides,
            "model.multi_stage.zero_stage=3",
            "model.multi_stage.layers_per_stage=2",
        ),
    )
    assert result.returncode == 0, result.stderr
    expected, got = records(single), records(sharded)
    assert [sorted(r) for r in got] == [sorted(r) for r in expected]
    for ours, theirs in zip(got, expected, strict=True):
        for key in ("loss", "validation_loss"):
            if key in theirs:
                assert ours[key] == pytest.approx(theirs[key], rel=1e-5), (theirs["step"], key)
    ours_hf, theirs_hf = (
        load_file(run / "export" / "4" / "model.safetensors") for run in (sharded, single)
    )
    for name, tensor in theirs_hf.items():
        torch.testing.assert_close(ours_hf[name], tensor, rtol=1e-5, atol=1e-5, msg=name)


def records(experiment: Path) -> list[dict]:
    lines = (experiment / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_a_four_rank_zero3_checkpoint_resumes_on_two_ranks_with_zero1(
    dataset: Path, tmp_path: Path
) -> None:
    straight = tmp_path / "straight"
    assert run_cli(*train_arguments(dataset, straight, "training.train_iters=6")).returncode == 0
    resharded = tmp_path / "resharded"
    zero3 = ("model.multi_stage.zero_stage=3", "model.multi_stage.layers_per_stage=2")
    result = torchrun(4, *train_arguments(dataset, resharded, "training.train_iters=3", *zero3))
    assert result.returncode == 0, result.stderr
    checkpoint = resharded / "checkpoint" / "3"
    assert len(list(checkpoint.glob("rank_*.safetensors"))) == 4
    shard = load_file(checkpoint / "rank_00003.safetensors")
    assert any(key.startswith("exp_avg.") for key in shard)
    result = torchrun(2, *train_arguments(dataset, resharded, "training.train_iters=6"))
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stdout
    expected, got = losses(straight), losses(resharded)
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=1e-5), step


def test_the_loss_is_the_mean_over_the_trained_tokens_of_the_whole_batch(
    dataset: Path, tmp_path: Path
) -> None:
    # Truncated sampling pads short documents (their padding is not trained on), so the
    # micro-batches train different numbers of tokens: one batch at once, 4 accumulated
    # micro-batches and 2 ranks with 2 each must still give the same losses and weights.
    overrides = (
        "data.sampling=truncated",
        "batch.sequence_length=256",
        "batch.batch_size=8",
        "training.train_iters=3",
        "training.export.interval=3",
        "training.export.format=distributed",
    )
    runs = {name: tmp_path / name for name in ("whole", "accumulated", "split")}
    result = run_cli(
        *train_arguments(dataset, runs["whole"], *overrides, "batch.micro_batch_size=8")
    )
    assert result.returncode == 0, result.stderr
    result = run_cli(*train_arguments(dataset, runs["accumulated"], *overrides))
    assert result.returncode == 0, result.stderr
    result = torchrun(2, *train_arguments(dataset, runs["split"], *overrides))
    assert result.returncode == 0, result.stderr
    expected = losses(runs["whole"])
    reference = final_weights(runs["whole"], 3)
    for name in ("accumulated", "split"):
        got = losses(runs[name])
        assert sorted(got) == sorted(expected)
        for step, loss in expected.items():
            assert got[step] == pytest.approx(loss, rel=1e-5), (name, step)
        weights = final_weights(runs[name], 3)
        for key, tensor in reference.items():
            torch.testing.assert_close(weights[key], tensor, rtol=1e-5, atol=1e-6, msg=key)


def test_mixture_of_experts_router_losses_and_load_match_one_process(
    dataset: Path, tmp_path: Path
) -> None:
    # Each rank accumulates 2 micro-batches of the 4 the single process does: the router's
    # losses (load balancing and z-loss, weighted by the micro-batches' token shares) and the
    # logged expert load (summed over the data ranks) must come out the same.
    moe = (
        "model.base_model.transformer.num_experts=4",
        "model.base_model.transformer.num_experts_per_token=2",
        "model.base_model.transformer.add_linear_biases=only_attn_qkv",
        "model.base_model.transformer.expert_auxiliary_loss_coefficient=0.1",
        "model.base_model.transformer.expert_z_loss_coefficient=0.01",
    )
    _assert_ranks_match_one_process(dataset, tmp_path, 2, "float32", *moe, "batch.batch_size=8")
    single, double = (
        [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("single", "double")
    )
    load = [(r["expert_tokens_max"], r["expert_tokens_mean"]) for r in single if "loss" in r]
    assert load == [
        (r["expert_tokens_max"], r["expert_tokens_mean"]) for r in double if "loss" in r
    ]
    # 8 sequences of 48 tokens, 2 experts each, over 4 experts.
    assert all(mean == 8 * 48 * 2 / 4 < most for most, mean in load)
