"""The parallel layouts over NCCL on two GPUs, in bf16, against one GPU running the same global
batch: tensor (with sequence parallelism), pipeline (breadth-first), sequence-data and expert
parallelism, and FP8 with ZeRO-3. The CPU suite checks each layout's arithmetic against one process in fp32; this
checks the NCCL paths (streams, device collectives) end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.training.test_expert_parallel import MOE_MODEL
from tests.training.test_train_cli import assert_two_ranks_match_one_process
from tests.training.test_training_options import GATED

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

FP8_DELAYED = (  # the FP8 weights gathered in FP8 (engine/fp8_gather.py), the MLPs fused
    *GATED,
    "model.base_model.transformer.add_linear_biases=false",
    "model.distributed.fp8_linear=tensorwise",
    "model.distributed.fp8_scaling=delayed",
)
BASE = (
    "model.distributed.training_dtype=bfloat16",
    "model.base_model.transformer.num_layers=4",
    "batch.batch_size=8",
)


@pytest.mark.parametrize(
    ("model", "layout"),
    [
        (
            (),
            (
                "model.distributed.tensor_parallel=2",
                "model.distributed.sequence_tensor_parallel=true",
            ),
        ),
        (
            (),
            (
                "model.distributed.pipeline_parallel=2",
                "schedule.breadth_first_micro_batches=4",
                "model.multi_stage.zero_stage=1",
            ),
        ),
        ((), ("model.distributed.sequence_data_parallel=2", "model.multi_stage.zero_stage=3")),
        (MOE_MODEL, ("model.distributed.expert_parallel=2", "model.multi_stage.zero_stage=2")),
        (FP8_DELAYED, ("model.multi_stage.zero_stage=3",)),
    ],
    ids=["tp2-sequence-parallel", "pp2-breadth-first", "sdp2-zero3", "ep2-zero2", "fp8-zero3"],
)
def test_two_gpus_over_nccl_match_one_gpu_in_bfloat16(
    dataset: Path, tmp_path: Path, model: tuple[str, ...], layout: tuple[str, ...]
) -> None:
    assert_two_ranks_match_one_process(dataset, tmp_path, (*BASE, *model), layout)
