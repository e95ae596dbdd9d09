"""Tensor parallelism on a GPU in bf16 against one process of the same global batch: two ranks
share the GPU through Gloo (NCCL refuses two ranks on one device), so one GPU checks the
layout's arithmetic on the CUDA kernels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.training.test_train_cli import assert_two_ranks_match_one_process

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]


@pytest.mark.parametrize(
    "sequence_tensor_parallel", [False, True], ids=["tp2", "tp2-sequence-parallel"]
)
def test_two_tensor_ranks_on_one_gpu_match_one_process_in_bfloat16(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sequence_tensor_parallel: bool
) -> None:
    overrides = (
        "model.distributed.training_dtype=bfloat16",
        "batch.batch_size=8",
        "model.multi_stage.zero_stage=2",
    )
    monkeypatch.setenv("FASTLLM_DISTRIBUTED_BACKEND", "gloo")
    layout = (
        "model.distributed.tensor_parallel=2",
        f"model.distributed.sequence_tensor_parallel={str(sequence_tensor_parallel).lower()}",
        "model.multi_stage.debug_tensor_parallel=true",
    )
    assert_two_ranks_match_one_process(dataset, tmp_path, overrides, layout)
