"""Running out of accelerator memory ends `fastllm train` in one line (exit 1): what was asked
for, what the parameter buffers hold by kind, and the settings that would use less among
those that compose with the run's config."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fastllm import cli
from fastllm.engine.engine import Engine
from fastllm.engine.memory import BufferMemory, buffer_memory
from fastllm.training import trainer
from tests.training.conftest import train_arguments
from tests.training.test_training_options import trainer as make_trainer

TORCH_MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB "
    "of which 1.06 GiB is free. Including non-PyTorch memory, this process has 138.74 GiB "
    "memory in use. Of the allocated memory 135.12 GiB is allocated by PyTorch."
)


def out_of_memory(*_: object, **__: object) -> None:
    raise torch.OutOfMemoryError(TORCH_MESSAGE)


def test_running_out_of_memory_in_a_step_is_one_line_with_the_memory_by_kind(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(Engine, "train_step", out_of_memory)
    arguments = train_arguments(dataset, tmp_path / "run", "training.train_iters=2")
    assert cli.main([*arguments, "batch.micro_batch_size=4"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        "fastllm: error: out of accelerator memory allocating 2.00 GiB (1.06 GiB free of "
        "139.81 GiB); this rank's buffers hold "
    ), line
    assert re.search(r"hold [\d.]+ MiB of weights, [\d.]+ MiB of gradients and [\d.]+ MiB", line)
    assert line.endswith(
        "to use less: model.multi_stage.recompute=selective (now elementwise), "
        "batch.micro_batch_size=2 (now 4), model.multi_stage.zero_stage=3 (now 1) with more "
        "data ranks, model.multi_stage.offload_activations=N (now 0: the first N blocks' stored "
        "activations in host memory), model.multi_stage.offload_optimizer=true (now false: the "
        "masters and Adam moments in host memory), model.base_model.peft={type: lora} (now "
        "none: adapters train, every other parameter is frozen)"
    ), line


def test_running_out_of_memory_while_building_offers_only_what_composes(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    # Compiled blocks cannot offload activations: that way out is not offered (LoRA, which
    # compiles, is).
    monkeypatch.setattr(trainer, "build", out_of_memory)
    arguments = train_arguments(
        dataset, tmp_path / "run", "training.train_iters=2", "training.compile=true",
        "model.multi_stage.recompute=full", "batch.micro_batch_size=2",
    )  # fmt: skip
    assert cli.main(arguments) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "fastllm: error: out of accelerator memory allocating 2.00 GiB (1.06 GiB free of "
        "139.81 GiB); while the model's buffers were being made; to use less: "
        "batch.micro_batch_size=1 (now 2), model.multi_stage.zero_stage=3 (now 1) with more "
        "data ranks, model.multi_stage.offload_optimizer=true (now false: the masters and Adam "
        "moments in host memory), model.base_model.peft={type: lora} (now none: adapters train, "
        "every other parameter is frozen)"
    )


def test_the_buffers_by_kind_count_every_element_of_this_rank(
    dataset: Path, tmp_path: Path
) -> None:
    # fp32 training: the masters are the weights, the gradients as large, two moments; bf16:
    # 2-byte weights, 2-byte low halves of the masters.
    for dtype, weight_bytes, optimizer_bytes in (("float32", 4, 8), ("bfloat16", 2, 10)):
        run = make_trainer(dataset, tmp_path / dtype, f"model.distributed.training_dtype={dtype}")
        elements = sum(
            run.engine.stages.dense.buffers.layout.stage_size(s)
            for s in run.engine.stages.dense.buffers.owned
        )
        assert buffer_memory(run.engine.stages, run.engine.optimizer) == BufferMemory(
            weights=weight_bytes * elements,
            gradients=4 * elements,
            optimizer=optimizer_bytes * elements,
        )


def test_the_buffers_by_kind_count_frozen_weights_as_weights(dataset: Path, tmp_path: Path) -> None:
    run = make_trainer(dataset, tmp_path / "run", "model.freeze.norms=true")
    dense, frozen = run.engine.stages.dense.buffers, run.engine.stages.frozen.buffers
    trained = sum(dense.layout.stage_size(s) for s in dense.owned)
    held = sum(frozen.layout.stage_size(s) for s in frozen.owned)
    assert buffer_memory(run.engine.stages, run.engine.optimizer) == BufferMemory(
        weights=4 * (trained + held), gradients=4 * trained, optimizer=8 * trained
    )
