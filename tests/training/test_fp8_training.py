"""Training with `model.distributed.fp8_linear`: on CPU the FP8 rounding is emulated (the GPU
computes the same products with `torch._scaled_mm`), so these tests pin the recipes' wiring."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from fastllm.checkpoint.distributed import rank_file
from fastllm.config import ConfigError
from fastllm.engine.checkpointing import FP8_PREFIX
from fastllm.model.parameters import meta_of, parameter_metas
from fastllm_kernels.fp8.amax_history import WEIGHT, AmaxHistories
from fastllm_kernels.fp8.quantize import E4M3, quantize
from tests.training.conftest import Launched, Layout
from tests.training.test_data_parallel import assert_ranks_match_one_process, model, zero
from tests.training.test_train_cli import losses
from tests.training.test_training_options import GATED, trainer

BF16 = ("model.distributed.training_dtype=bfloat16", *GATED)
RECIPES = {
    "tensorwise": ("model.distributed.fp8_linear=tensorwise",),
    "rowwise": ("model.distributed.fp8_linear=rowwise",),
    "delayed": (
        "model.distributed.fp8_linear=tensorwise",
        "model.distributed.fp8_scaling=delayed",
        "model.distributed.fp8_amax_history_length=2",
    ),
}


def step_losses(run, steps: int) -> list[float]:
    return [
        run.engine.train_step(batch)["loss"] for batch in itertools.islice(run.data_loader(), steps)
    ]


def resumed_after_two_steps(
    dataset: Path, tmp_path: Path, options: tuple[str, ...]
) -> tuple[list[float], Any, Any]:
    """The 4 losses of an uninterrupted run of `options`; a run stopped after 2 steps (their
    losses checked against the uninterrupted run's) and checkpointed; and a run that resumed
    from that checkpoint."""
    straight = step_losses(trainer(dataset, tmp_path / "straight", *options), 4)
    first = trainer(dataset, tmp_path / "first", *options)
    assert step_losses(first, 2) == straight[:2]
    first.wait_for_checkpoints()
    checkpoint = first.save_checkpoint()
    first.wait_for_checkpoints()
    resumed = trainer(dataset, tmp_path / "second", *options)
    resumed.load_checkpoint(checkpoint)
    return straight, first, resumed


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_recipes_train_close_to_bf16_but_not_identically(
    dataset: Path, tmp_path: Path, recipe: str
) -> None:
    options = ("training.train_iters=3", *BF16)
    bf16 = step_losses(trainer(dataset, tmp_path / "bf16", *options), 3)
    run = trainer(dataset, tmp_path / recipe, *options, *RECIPES[recipe])
    fp8 = step_losses(run, 3)
    assert fp8 != bf16, "the linear layers computed in FP8"
    assert fp8 == pytest.approx(bf16, rel=2e-2)


def test_fp8_weights_are_requantized_after_each_optimizer_step(
    dataset: Path, tmp_path: Path
) -> None:
    run = trainer(
        dataset, tmp_path / "run", "training.train_iters=2", *BF16,
        "model.distributed.fp8_linear=rowwise",
    )  # fmt: skip
    layer = run.engine.model.layers[0].mlp.layer_2
    weight, fp8 = layer.weight, meta_of(layer, "weight").recipe.fp8
    micro_batches = next(iter(run.data_loader()))
    run.engine.forward_backward([micro_batches[0]])
    first = fp8.rows(weight)
    run.engine.forward_backward([micro_batches[1]])
    assert fp8.rows(weight) is first, "one quantization per step, not per micro-batch"
    run.engine.optimizer_step()
    again = fp8.rows(weight)
    expected = quantize(weight.detach(), E4M3, tensorwise=False, rows=True)
    assert not torch.equal(again.data.float(), first.data.float())
    assert torch.equal(again.data.float(), expected.rows.data.float())


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_an_fp8_run_resumes_bit_for_bit(dataset: Path, tmp_path: Path, recipe: str) -> None:
    """Current scaling keeps no scale state: a restored run requantizes the restored weights.
    Delayed scaling restores the amax histories (after 2 steps, both entries are set)."""
    options = ("training.train_iters=4", *BF16, *RECIPES[recipe])
    straight, first, resumed = resumed_after_two_steps(dataset, tmp_path, options)
    if recipe == "delayed":
        saved, restored = first.engine.fp8_histories, resumed.engine.fp8_histories
        assert torch.all(saved.history > 0) and all(restored.primed)
        assert torch.equal(restored.history, saved.history)
        assert torch.equal(restored.current, saved.current)
    assert step_losses(resumed, 2) == straight[2:]


def test_delayed_scaling_resumes_histories_from_before_the_weights_and_refuses_other_lengths(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint of the input and gradient histories alone (written before the weights were
    delayed-scaled) resumes: the weights scale currently for a step, then from their history.
    One of another history length is refused, naming its entry."""
    options = ("training.train_iters=3", *BF16, *RECIPES["delayed"])
    first = trainer(dataset, tmp_path / "first", *options)
    step_losses(first, 1)
    first.wait_for_checkpoints()
    with monkeypatch.context() as patch:
        patch.setattr(
            AmaxHistories,
            "state",
            lambda self: {"history": self.history[:, :WEIGHT], "current": self.current[:, :WEIGHT]},
        )
        checkpoint = first.save_checkpoint()
        first.wait_for_checkpoints()
    resumed = trainer(dataset, tmp_path / "second", *options)
    resumed.load_checkpoint(checkpoint)
    histories = resumed.engine.fp8_histories
    assert histories.primed == [True, True, False]
    assert torch.equal(
        histories.history[:, :WEIGHT], first.engine.fp8_histories.history[:, :WEIGHT]
    )
    assert not histories.history[:, WEIGHT].any()
    step_losses(resumed, 1)
    assert all(histories.primed) and torch.all(histories.history[:, WEIGHT, 0] > 0)
    longer = trainer(
        dataset, tmp_path / "third", *options, "model.distributed.fp8_amax_history_length=3"
    )
    with pytest.raises(ConfigError, match=r"fp8\.history has shape .* by 3 steps"):
        longer.load_checkpoint(checkpoint)


def test_delayed_scaling_rolls_each_steps_amaxes_into_the_history(
    dataset: Path, tmp_path: Path
) -> None:
    run = trainer(dataset, tmp_path, "training.train_iters=3", *BF16, *RECIPES["delayed"])
    histories = run.engine.fp8_histories
    micro_batches = iter(run.data_loader())
    run.engine.train_step(next(micro_batches))
    first = histories.history[:, :, 0].clone()
    assert torch.all(first > 0) and not histories.current.any()
    run.engine.train_step(next(micro_batches))
    assert torch.equal(histories.history[:, :, 1], first)
    assert not torch.equal(histories.history[:, :, 0], first)


def test_fp8_refuses_float32_compute(dataset: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.distributed\.fp8_linear.*training_dtype"):
        trainer(dataset, tmp_path, "model.distributed.fp8_linear=rowwise")


def test_fp8_marks_the_block_projections_and_leaves_embedding_and_head_bf16(
    dataset: Path, tmp_path: Path
) -> None:
    run = trainer(dataset, tmp_path, *BF16, "model.distributed.fp8_linear=rowwise")
    metas = parameter_metas(run.engine.model)
    marked = {name for name, meta in metas.items() if meta.recipe and meta.recipe.fp8}
    projections = ("query_key_value", "dense", "layer_1", "layer_2")
    expected = {
        f"layers.{i}.{module}.{name}.weight"
        for i in range(len(run.engine.model.layers))
        for module, name in zip(("attention",) * 2 + ("mlp",) * 2, projections, strict=True)
    }
    assert marked == expected


DATA_PARALLEL = {  # name: (the one-process reference, the layout on two ranks)
    # The weight gradients reach the sharded buffers through autograd (not a gradient sink),
    # and each rank requantizes its weights after the all-gather of the new shards.
    "zero2-rowwise": (("model.distributed.fp8_linear=rowwise",), zero(2)),
    # Each rank quantizes its shard with the whole weights' scales; the stages are gathered
    # in FP8 (engine/fp8_gather.py), rowwise also column-scaled for the input gradient.
    "zero3-rowwise": (("model.distributed.fp8_linear=rowwise",), zero(3)),
    "zero3-delayed": (RECIPES["delayed"], zero(3)),
}


PIPELINE = {  # name: (ranks, the one-process reference, the layout on top of it)
    # Each rank's FP8 layers are its stage's; the histories, per rank, are its layers'.
    "pp2-delayed": (
        2,
        (*RECIPES["delayed"], "model.distributed.fp8_amax_history_length=6"),  # every step's
        ("model.distributed.pipeline_parallel=2",),
    ),
    # The stages' FP8 images gathered over the two data ranks of each pipeline rank.
    "pp2xdp2-zero3-rowwise": (
        4,
        ("model.distributed.fp8_linear=rowwise", "batch.micro_batch_size=1"),
        ("model.distributed.pipeline_parallel=2", zero(3)),
    ),
}
SEQUENCE_DATA = ("model.distributed.fp8_linear=rowwise",)
"""Two ranks sharing each sequence: rowwise scales each token's row by itself, so the first
step's forward pass is one process's exactly, q/k/v projection included."""


def layouts(dataset: Path, one_process: Callable[..., Path], root: Path) -> dict[str, Layout]:
    """The layouts of DATA_PARALLEL, PIPELINE and SEQUENCE_DATA (trained for the fixture
    `launched`, see conftest.py)."""
    # Two micro-batches a data rank, in breadth-first order over the two stages (one a rank).
    breadth_first = "schedule.breadth_first_micro_batches=2"
    return {
        **{
            name: Layout(2, (*model("bfloat16", *GATED, *recipe), layout))
            for name, (recipe, layout) in DATA_PARALLEL.items()
        },
        **{
            name: Layout(ranks, (*model("bfloat16", *GATED, *recipe), *layout, breadth_first))
            for name, (ranks, recipe, layout) in PIPELINE.items()
        },
        "sdp2-rowwise": Layout(
            2,
            (
                *model("bfloat16", *GATED, *SEQUENCE_DATA),
                "model.distributed.sequence_data_parallel=2",
            ),
        ),
    }


@pytest.mark.parametrize("name", DATA_PARALLEL)
def test_fp8_on_two_ranks_matches_one_process(
    launched: dict[str, Launched], one_process: Callable[..., Path], name: str
) -> None:
    reference = model("bfloat16", *GATED, *DATA_PARALLEL[name][0])
    run = launched[name].succeeded()
    assert_ranks_match_one_process(run, one_process(*reference), 2, "bfloat16")


@pytest.mark.parametrize("name", PIPELINE)
def test_fp8_with_pipeline_parallelism_matches_one_process(
    launched: dict[str, Launched], one_process: Callable[..., Path], name: str
) -> None:
    ranks, recipe, _ = PIPELINE[name]
    run = launched[name].succeeded()
    single = one_process(*model("bfloat16", *GATED, *recipe))
    assert_ranks_match_one_process(run, single, ranks, "bfloat16")


def test_pipeline_ranks_keep_the_amax_histories_of_their_own_layers(
    launched: dict[str, Launched], one_process: Callable[..., Path]
) -> None:
    """Each layer's history is recorded by the one rank whose stage runs it, and holds the
    amaxes one process records for that layer: the first step's exactly (the same products
    of the same weights), the later ones as closely as the runs agree (bf16 sums in another
    order)."""
    run = launched["pp2-delayed"].succeeded()
    single = one_process(*model("bfloat16", *GATED, *PIPELINE["pp2-delayed"][1]))
    ranks = torch.stack([rank_histories(run, rank) for rank in (0, 1)])  # rank, layer, kind, step
    expected = rank_histories(single, 0)
    recorded = ranks.flatten(2).abs().amax(dim=2) > 0  # rank, layer
    assert recorded.sum(dim=0).tolist() == [1] * len(expected), recorded
    assert recorded.any(dim=1).all(), "both ranks run FP8 layers"
    combined = ranks.sum(dim=0)  # each layer's one recording rank
    assert torch.equal(combined[..., -1], expected[..., -1])  # newest first: step 1 last
    torch.testing.assert_close(combined, expected, rtol=0.1, atol=0)


def test_fp8_with_sequence_data_parallelism_matches_one_process(
    launched: dict[str, Launched], one_process: Callable[..., Path]
) -> None:
    run = launched["sdp2-rowwise"].succeeded()
    single = one_process(*model("bfloat16", *GATED, *SEQUENCE_DATA))
    # 1e-5 as the layouts: the CPU's bf16 matmuls block a chunk's rows and the whole
    # sequence's differently, which moved this loss by 2.7e-6 on one host (1e-6 passed on others).
    assert losses(run)[1] == pytest.approx(losses(single)[1], rel=1e-5), "the same first step"
    assert_ranks_match_one_process(run, single, 2, "bfloat16")


def rank_histories(experiment: Path, rank: int) -> torch.Tensor:
    """Rank `rank`'s amax histories (layer, kind, step) in the run's last checkpoint."""
    checkpoint = max((experiment / "checkpoint").iterdir(), key=lambda path: int(path.name))
    with safe_open(checkpoint / rank_file(rank), "pt") as handle:
        return handle.get_tensor(f"{FP8_PREFIX}history")
