"""Pipeline parallelism on a GPU in bf16 against one process of the same global batch: two
pipeline ranks share the GPU through Gloo (NCCL refuses two ranks on one device; transfers go
through host memory then), so one GPU checks the runner on the CUDA kernels."""

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


@pytest.mark.parametrize(
    "order", ["breadth_first", "depth_first"], ids=["breadth-first", "depth-first"]
)
def test_two_pipeline_ranks_on_one_gpu_match_one_process_in_bfloat16(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    overrides = (
        "model.distributed.training_dtype=bfloat16",
        "model.base_model.transformer.num_layers=4",
        "training.train_iters=10",
        "batch.batch_size=8",
    )
    single = tmp_path / "single"
    result = run_cli(*train_arguments(dataset, single, *overrides))
    assert result.returncode == 0, result.stderr
    monkeypatch.setenv("FASTLLM_DISTRIBUTED_BACKEND", "gloo")
    split = tmp_path / "split"
    layout = (
        "model.distributed.pipeline_parallel=2",
        "schedule.breadth_first_micro_batches=4",
        f"schedule.order={order}",
    )
    result = torchrun(2, *train_arguments(dataset, split, *overrides, *layout))
    assert result.returncode == 0, result.stderr
    assert_same_losses(single, split, 10, rel=1e-2)
