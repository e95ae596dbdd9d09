"""FP8 with ZeRO-3 on the GPU: two ranks sharing one GPU through Gloo (NCCL refuses two ranks on
one device) against one process of the same global batch, in bf16 with delayed scaling: the
CUDA path of the FP8 weight gathers (engine/fp8_gather.py) and of the fused MLP. Two GPUs over
NCCL: tests/training/test_layouts_nccl_gpu.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.training.test_layouts_nccl_gpu import FP8_DELAYED
from tests.training.test_train_cli import assert_two_ranks_match_one_process

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]

OVERRIDES = (*FP8_DELAYED, "model.distributed.training_dtype=bfloat16")


def test_fp8_zero3_on_two_ranks_of_one_gpu_matches_one_process(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FASTLLM_DISTRIBUTED_BACKEND", "gloo")
    assert_two_ranks_match_one_process(
        dataset, tmp_path, OVERRIDES, ("model.multi_stage.zero_stage=3",)
    )
