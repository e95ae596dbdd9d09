"""Pipeline parallelism on a GPU in bf16 and FP8 against one process of the same global batch:
two pipeline ranks share the GPU through Gloo (NCCL refuses two ranks on one device; transfers
go through host memory then), so one GPU checks the runner on the CUDA kernels."""

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
    "order", ["breadth_first", "depth_first"], ids=["breadth-first", "depth-first"]
)
def test_two_pipeline_ranks_on_one_gpu_match_one_process_in_bfloat16(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    overrides = (
        "model.distributed.training_dtype=bfloat16",
        "model.base_model.transformer.num_layers=4",
        "batch.batch_size=8",
    )
    monkeypatch.setenv("FASTLLM_DISTRIBUTED_BACKEND", "gloo")
    layout = (
        "model.distributed.pipeline_parallel=2",
        "schedule.breadth_first_micro_batches=4",
        f"schedule.order={order}",
    )
    assert_two_ranks_match_one_process(dataset, tmp_path, overrides, layout)


def test_two_pipeline_ranks_on_one_gpu_match_one_process_in_fp8(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Delayed tensorwise FP8 (`torch._scaled_mm` and the fused FP8 kernels) on each rank's
    stages; the dense MLPs gated, so the fused FP8 MLP runs once the histories are primed."""
    overrides = (
        "model.distributed.training_dtype=bfloat16",
        "model.base_model.transformer.num_layers=4",
        "model.base_model.transformer.gated=true",
        "model.base_model.transformer.activation_type=silu",
        "model.distributed.fp8_linear=tensorwise",
        "model.distributed.fp8_scaling=delayed",
        "batch.batch_size=8",
    )
    monkeypatch.setenv("FASTLLM_DISTRIBUTED_BACKEND", "gloo")
    layout = ("model.distributed.pipeline_parallel=2", "schedule.breadth_first_micro_batches=4")
    assert_two_ranks_match_one_process(dataset, tmp_path, overrides, layout)
