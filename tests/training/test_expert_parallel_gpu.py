"""Expert parallelism on GPUs in bf16 against one process of the same global batch: on one GPU
two ranks share it through Gloo (NCCL refuses two ranks on one device; the all-to-all goes
through host memory there), which checks the layout on the CUDA kernels (grouped matmuls);
on two GPUs over NCCL."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.training.test_expert_parallel import MOE
from tests.training.test_train_cli import assert_two_ranks_match_one_process

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]


OVERRIDES = (*MOE, "model.distributed.training_dtype=bfloat16")
LAYOUT = ("model.distributed.expert_parallel=2", "model.multi_stage.zero_stage=2")


def test_two_expert_ranks_on_one_gpu_match_one_process_in_bfloat16(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FASTLLM_DISTRIBUTED_BACKEND", "gloo")
    assert_two_ranks_match_one_process(dataset, tmp_path, OVERRIDES, LAYOUT)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_expert_ranks_over_nccl_match_one_process_in_bfloat16(
    dataset: Path, tmp_path: Path
) -> None:
    assert_two_ranks_match_one_process(dataset, tmp_path, OVERRIDES, LAYOUT)
