"""Data parallelism under torchrun (2 and 4 Gloo CPU processes) against the single-process run of
the same global batch, and resharded resumption."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.training.conftest import Launched, Layout
from tests.training.test_train_cli import losses


def final_weights(experiment: Path, step: int) -> dict[str, torch.Tensor]:
    import fastllm

    return dict(fastllm.load_model(experiment / "export" / str(step)).state_dict())


SIX_STEPS = (
    "training.train_iters=6",
    "training.export.interval=6",
    "training.export.format=distributed",
)
MOE = (
    "model.base_model.transformer.num_experts=4",
    "model.base_model.transformer.num_experts_per_token=2",
    "model.base_model.transformer.add_linear_biases=only_attn_qkv",
    "model.base_model.transformer.expert_auxiliary_loss_coefficient=0.1",
    "model.base_model.transformer.expert_z_loss_coefficient=0.01",
)
UNTIED = (  # untied head, recomputed blocks, validation, a Hugging Face export
    "model.base_model.tie_word_embeddings=false",
    "model.base_model.transformer.num_layers=3",
    "model.multi_stage.recompute=full",
    "training.validation.interval=2",
    "training.validation.iterations=2",
    "training.train_iters=4",
    "training.export.interval=4",
    "training.export.format=starcoder2",
)
ZERO3_TWO_BLOCKS = ("model.multi_stage.zero_stage=3", "model.multi_stage.layers_per_stage=2")
# Truncated sampling pads short documents (their padding is not trained on), so the
# micro-batches train different numbers of tokens.
UNEVEN = (
    "data.sampling=truncated",
    "batch.sequence_length=256",
    "batch.batch_size=8",
    "training.train_iters=3",
    "training.export.interval=3",
    "training.export.format=distributed",
)


def model(dtype: str, *overrides: str) -> tuple[str, ...]:
    return (f"model.distributed.training_dtype={dtype}", *overrides, *SIX_STEPS)


def zero(stage: int) -> str:
    return f"model.multi_stage.zero_stage={stage}"


# name: (ranks, what the one-process reference runs, the layout on top of it)
LAYOUTS: dict[str, tuple[int, tuple[str, ...], tuple[str, ...]]] = {
    **{
        f"{ranks}-{dtype}-zero{stage}": (ranks, model(dtype), (zero(stage),))
        for ranks, dtypes in ((2, ("float32", "bfloat16")), (4, ("float32",)))
        for stage in (1, 2, 3)
        for dtype in dtypes
    },
    # 8 sequences over 2 ranks in micro-batches of 2: each rank accumulates 2, and ZeRO-1 sums
    # over ranks during the second backward pass only.
    **{
        f"accumulated-zero{stage}": (2, model("float32", "batch.batch_size=8"), (zero(stage),))
        for stage in (1, 2)
    },
    "moe": (2, model("float32", *MOE, "batch.batch_size=8"), ()),
    "uneven-tokens": (2, UNEVEN, ()),
    "untied-zero3-two-blocks": (2, UNTIED, ZERO3_TWO_BLOCKS),
    "zero3-three-steps": (4, (), ("training.train_iters=3", *ZERO3_TWO_BLOCKS)),
    # Resumes the step-3 checkpoint of zero3-three-steps (copied) with ZeRO-1, to step 6.
    "resumed-on-two": (2, (), ("training.train_iters=6",)),
}


def layouts(dataset: Path, one_process: Callable[..., Path], root: Path) -> dict[str, Layout]:
    """Every layout of LAYOUTS (trained for the fixture `launched`, see conftest.py)."""
    layouts = {
        name: Layout(ranks, (*reference, *layout, *validated(dataset, name)))
        for name, (ranks, reference, layout) in LAYOUTS.items()
    }
    checkpoint = root / "zero3-three-steps" / "checkpoint" / "3"
    layouts["resumed-on-two"] = replace(layouts["resumed-on-two"], resumes=checkpoint)
    return layouts


def validated(dataset: Path, name: str) -> tuple[str, ...]:
    return (f"data.validation_path=[{dataset}]",) if name.startswith("untied") else ()


@pytest.mark.parametrize(
    ("ranks", "dtype", "zero_stage"),
    [
        *((2, dtype, stage) for stage in (1, 2, 3) for dtype in ("float32", "bfloat16")),
        *((4, "float32", stage) for stage in (1, 2, 3)),
    ],
)
def test_ranks_match_one_process_on_the_same_global_batch(
    launched: dict[str, Launched],
    one_process: Callable[..., Path],
    ranks: int,
    dtype: str,
    zero_stage: int,
) -> None:
    assert_layout_matches_one_process(launched, one_process, f"{ranks}-{dtype}-zero{zero_stage}")


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_accumulated_micro_batches_match_one_process(
    launched: dict[str, Launched], one_process: Callable[..., Path], zero_stage: int
) -> None:
    assert_layout_matches_one_process(launched, one_process, f"accumulated-zero{zero_stage}")


def assert_layout_matches_one_process(
    launched: dict[str, Launched], one_process: Callable[..., Path], name: str
) -> None:
    ranks, reference, _ = LAYOUTS[name]
    dtype = "bfloat16" if "model.distributed.training_dtype=bfloat16" in reference else "float32"
    assert_ranks_match_one_process(
        launched[name].succeeded(), one_process(*reference), ranks, dtype
    )


def assert_ranks_match_one_process(double: Path, single: Path, ranks: int, dtype: str) -> None:
    """Losses and final weights of a six-step run on `ranks` against one process's."""
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
    dataset: Path, launched: dict[str, Launched], one_process: Callable[..., Path]
) -> None:
    single = one_process(*UNTIED, *validated(dataset, "untied-zero3-two-blocks"))
    sharded = launched["untied-zero3-two-blocks"].succeeded()
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
    launched: dict[str, Launched], one_process: Callable[..., Path]
) -> None:
    checkpoint = launched["zero3-three-steps"].succeeded() / "checkpoint" / "3"
    assert len(list(checkpoint.glob("rank_*.safetensors"))) == 4
    shard = load_file(checkpoint / "rank_00003.safetensors")
    assert any(key.startswith("exp_avg.") for key in shard)
    resumed = launched["resumed-on-two"]
    assert "resumed from" in resumed.result.stdout
    # Steps 1-3 on four ranks, 4-6 resumed on two: the losses of one process's six steps.
    got = losses(launched["zero3-three-steps"].experiment) | losses(resumed.succeeded())
    expected = losses(one_process("training.train_iters=6"))
    assert sorted(got) == sorted(expected) == list(range(1, 7))
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=1e-5), step


def test_the_loss_is_the_mean_over_the_trained_tokens_of_the_whole_batch(
    launched: dict[str, Launched], one_process: Callable[..., Path]
) -> None:
    # The micro-batches train different numbers of tokens: one batch at once, 4 accumulated
    # micro-batches and 2 ranks with 2 each must still give the same losses and weights.
    whole = one_process(*UNEVEN, "batch.micro_batch_size=8")
    runs = {"accumulated": one_process(*UNEVEN), "split": launched["uneven-tokens"].succeeded()}
    expected = losses(whole)
    reference = final_weights(whole, 3)
    for name, run in runs.items():
        got = losses(run)
        assert sorted(got) == sorted(expected)
        for step, loss in expected.items():
            assert got[step] == pytest.approx(loss, rel=1e-5), (name, step)
        weights = final_weights(run, 3)
        for key, tensor in reference.items():
            torch.testing.assert_close(weights[key], tensor, rtol=1e-5, atol=1e-6, msg=key)


def test_mixture_of_experts_router_losses_and_load_match_one_process(
    launched: dict[str, Launched], one_process: Callable[..., Path]
) -> None:
    # Each rank accumulates 2 micro-batches of the 4 the single process does: the router's
    # losses (load balancing and z-loss, weighted by the micro-batches' token shares) and the
    # logged expert load (summed over the data ranks) must come out the same.
    assert_layout_matches_one_process(launched, one_process, "moe")
    single, double = (
        records(run) for run in (one_process(*LAYOUTS["moe"][1]), launched["moe"].experiment)
    )
    load = [(r["expert_tokens_max"], r["expert_tokens_mean"]) for r in single if "loss" in r]
    assert load == [
        (r["expert_tokens_max"], r["expert_tokens_mean"]) for r in double if "loss" in r
    ]
    # 8 sequences of 48 tokens, 2 experts each, over 4 experts.
    assert all(mean == 8 * 48 * 2 / 4 < most for most, mean in load)
