"""Tensor parallelism on a GPU in bf16 against one process of the same global batch: two ranks
share the GPU through Gloo (NCCL refuses two ranks on one device), so one GPU checks the
layout's arithmetic on the CUDA kernels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_cli import fastllm as run_cli
from tests.torchrun import torchrun
from tests.training.conftest import train_arguments
from tests.training.test_train_cli import assert_same_losses

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sequence-parallel"])
def test_two_tensor_ranks_on_one_gpu_match_one_process_in_bfloat16(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sequence_parallel: bool
) -> None:
    overrides = (
        "model.distributed.training_dtype=bfloat16",
        "training.train_iters=10",
        "batch.batch_size=8",
        "model.multi_stage.zero_stage=2",
    )
    single = tmp_path / "single"
    result = run_cli(*train_arguments(dataset, single, *overrides))
    assert result.returncode == 0, result.stderr
    monkeypatch.setenv("FASTLLM_DISTRIBUTED_BACKEND", "gloo")
    split = tmp_path / "split"
    layout = (
        "model.distributed.tensor_parallel=2",
        f"model.distributed.sequence_tensor_parallel={str(sequence_parallel).lower()}",
        "model.multi_stage.debug_tensor_parallel=true",
    )
    result = torchrun(2, *train_arguments(dataset, split, *overrides, *layout))
    assert result.returncode == 0, result.stderr
    assert_same_losses(single, split, 10, rel=1e-2)
