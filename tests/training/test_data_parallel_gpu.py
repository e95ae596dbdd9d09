"""ZeRO 1/2/3 over NCCL on two GPUs: the same losses, and each stage needs less memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.torchrun import torchrun
from tests.training.conftest import train_arguments

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


def test_zero_stages_agree_over_nccl_and_shard_memory(dataset: Path, tmp_path: Path) -> None:
    runs: dict[int, list[dict]] = {}
    for stage in (1, 2, 3):
        experiment = tmp_path / f"zero{stage}"
        arguments = train_arguments(
            dataset, experiment,
            "model.distributed.training_dtype=bfloat16", f"model.multi_stage.zero_stage={stage}",
            "model.base_model.transformer.hidden_size=1024", "model.base_model.transformer.num_layers=8",
            "model.base_model.transformer.ffn_hidden_size=4096", "model.base_model.transformer.num_attention_heads=8",
            "training.train_iters=4",
        )  # fmt: skip
        result = torchrun(2, *arguments)
        assert result.returncode == 0, result.stderr
        lines = (experiment / "metrics.jsonl").read_text().splitlines()
        runs[stage] = [json.loads(line) for line in lines]
    for stage in (2, 3):
        for ours, theirs in zip(runs[stage], runs[1], strict=True):
            assert ours["loss"] == pytest.approx(theirs["loss"], rel=2e-2), (stage, ours["step"])
    memory = {stage: max(r["memory_gib"] for r in records) for stage, records in runs.items()}
    assert memory[3] < memory[2] < memory[1], memory
