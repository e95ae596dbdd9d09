"""`model.multi_stage.offload_optimizer`: the same training as with the optimizer state on the
device, in one process (bit for bit, LoRA's adapters too), with data (ZeRO-1, 2 and 3), tensor, pipeline and expert
parallelism under torchrun against the single-process run of the same global batch, and
checkpoints that resume exactly, with or without the offload."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastllm import cli
from fastllm.engine.engine import Engine
from fastllm.engine.memory import BufferMemory, buffer_memory
from fastllm.engine.offloaded_optimizer import CHUNK
from tests.data.conftest import run_cli
from tests.engine.test_offloaded_optimizer import assert_same_state
from tests.training.conftest import Launched, Layout, train_arguments
from tests.training.test_data_parallel import MOE, assert_ranks_match_one_process, final_weights
from tests.training.test_data_parallel import model as six_steps
from tests.training.test_lora_training import FOUR_STEPS, LORA_ARGS
from tests.training.test_out_of_memory import out_of_memory
from tests.training.test_tensor_parallel import assert_close_weights
from tests.training.test_train_cli import losses
from tests.training.test_training_options import trainer

OFFLOAD = "model.multi_stage.offload_optimizer=true"
STOPPED = ("training.train_iters=3", "training.export.interval=null")  # the exports are at 6
BF16, FP32 = six_steps("bfloat16"), six_steps("float32")
ACCUMULATED = six_steps("float32", "batch.batch_size=8")
EXPERTS = six_steps("float32", *MOE, "batch.batch_size=8")

# name: (what the one-process reference runs, the layout on two ranks on top of it)
LAYOUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "dp2-bf16-zero1": (BF16, ("model.multi_stage.zero_stage=1",)),
    "dp2-fp32-zero2": (FP32, ("model.multi_stage.zero_stage=2",)),
    "dp2-fp32-zero3": (FP32, ("model.multi_stage.zero_stage=3",)),
    "tp2-fp32": (
        FP32,
        (
            "model.distributed.tensor_parallel=2",
            "model.distributed.sequence_tensor_parallel=true",
            "model.multi_stage.debug_tensor_parallel=true",  # reads the offloaded masters
        ),
    ),
    # Two stages, one per rank, the tied head on the other rank than its embedding.
    "pp2-fp32": (
        ACCUMULATED,
        ("model.distributed.pipeline_parallel=2", "schedule.breadth_first_micro_batches=4"),
    ),
    "ep2-fp32": (EXPERTS, ("model.distributed.expert_parallel=2",)),
}


def layouts(dataset: Path, one_process: Callable[..., Path], root: Path) -> dict[str, Layout]:
    """Every layout of LAYOUTS, offloaded (trained for the fixture `launched`, see
    conftest.py)."""
    return {
        name: Layout(2, (*reference, *layout, OFFLOAD))
        for name, (reference, layout) in LAYOUTS.items()
    }


def test_two_ranks_with_offloaded_state_match_one_process(
    launched: dict[str, Launched], one_process: Callable[..., Path]
) -> None:
    for name, (reference, _) in LAYOUTS.items():
        run, single = launched[name].succeeded(), one_process(*reference)
        if reference == BF16:
            assert_ranks_match_one_process(run, single, 2, "bfloat16")
            continue
        expected, got = losses(single), losses(run)
        assert sorted(got) == sorted(expected) == list(range(1, 7)), name
        for step, loss in expected.items():
            assert got[step] == pytest.approx(loss, rel=1e-5), (name, step)
        assert_close_weights(final_weights(run, 6), final_weights(single, 6))


def test_offloaded_state_trains_as_on_the_device_bit_for_bit(
    one_process: Callable[..., Path],
) -> None:
    on_device, offloaded = one_process(*BF16), one_process(*BF16, OFFLOAD)
    assert losses(offloaded) == losses(on_device)
    ours, theirs = final_weights(offloaded, 6), final_weights(on_device, 6)
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def test_offloaded_lora_adapters_train_as_on_the_device_bit_for_bit(
    one_process: Callable[..., Path],
) -> None:
    # Only the adapters have optimizer state: theirs is offloaded.
    on_device, offloaded = (
        one_process(*LORA_ARGS, *FOUR_STEPS, *options) for options in ((), (OFFLOAD,))
    )
    assert losses(offloaded) == losses(on_device)
    ours, theirs = (
        load_file(run / "export" / "4" / "model.safetensors") for run in (offloaded, on_device)
    )
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def test_a_checkpoint_of_offloaded_state_resumes_exactly_with_or_without_offload(
    dataset: Path, tmp_path: Path, one_process: Callable[..., Path]
) -> None:
    # Steps 1-3 offloaded, then 4-6 resumed from its checkpoint offloaded and on the device:
    # the losses and weights of six uninterrupted steps.
    first = tmp_path / "first"
    result = run_cli(*train_arguments(dataset, first, *BF16, OFFLOAD, *STOPPED))
    assert result.returncode == 0, result.stderr
    uninterrupted = one_process(*BF16)
    for name, options in (("offloaded", (OFFLOAD,)), ("on-device", ())):
        resumed = tmp_path / name
        shutil.copytree(first / "checkpoint" / "3", resumed / "checkpoint" / "3")
        result = run_cli(*train_arguments(dataset, resumed, *BF16, *options))
        assert result.returncode == 0, result.stderr
        assert "resumed from" in result.stdout
        assert losses(first) | losses(resumed) == losses(uninterrupted), name
        ours, theirs = final_weights(resumed, 6), final_weights(uninterrupted, 6)
        for parameter, tensor in theirs.items():
            assert torch.equal(ours[parameter], tensor), (name, parameter)


def test_offloaded_state_counts_as_host_memory(dataset: Path, tmp_path: Path) -> None:
    # bf16: 2-byte weights, 4-byte gradients; the low halves of the masters and the moments,
    # 10 bytes, in host memory; two chunks of them on the device (a shard is less than one).
    run = trainer(dataset, tmp_path / "run", "model.distributed.training_dtype=bfloat16", OFFLOAD)
    buffers = run.engine.stages.dense.buffers
    sizes = [buffers.layout.stage_size(s) for s in buffers.owned]
    assert max(sizes) < CHUNK
    assert buffer_memory(run.engine.stages, run.engine.optimizer) == BufferMemory(
        weights=2 * sum(sizes),
        gradients=4 * sum(sizes),
        optimizer=2 * 10 * max(sizes),
        host_optimizer=10 * sum(sizes),
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_the_gpu_a_checkpoint_restores_the_offloaded_state_bit_for_bit(
    dataset: Path, tmp_path: Path
) -> None:
    # The checkpoint is written from the pinned host state itself (no copy), the save waiting.
    first = trainer(dataset, tmp_path / "first", *BF16, OFFLOAD, *STOPPED)
    assert first.distributed.device.type == "cuda"
    first.fit()
    restored = trainer(dataset, tmp_path / "restored", *BF16, OFFLOAD)
    restored.load_checkpoint(tmp_path / "first" / "checkpoint" / "3")
    assert_same_state(restored.engine.stages, first.engine.stages)
    for shard in restored.engine.stages.dense.buffers.shards.values():
        assert shard.exp_avg.is_pinned() and shard.exp_avg.abs().sum() > 0


def test_out_of_memory_with_offloaded_state_says_where_it_is_and_offers_it_no_more(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(Engine, "train_step", out_of_memory)
    arguments = train_arguments(dataset, tmp_path / "run", "training.train_iters=2", OFFLOAD)
    assert cli.main(arguments) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert re.search(
        r"[\d.]+ MiB of gradients and [\d.]+ MiB of optimizer chunks in flight \(the masters "
        r"and Adam moments, [\d.]+ MiB, are in host memory\);",
        line,
    ), line
    assert "offload_optimizer" not in line.split("to use less:")[1]
