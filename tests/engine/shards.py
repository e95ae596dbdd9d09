"""What the two-rank scripts that tests/engine runs under torchrun share: the model of a
reference on flat buffers over two data ranks, and the check of its summed shards."""

from __future__ import annotations

from typing import Any

import torch

from fastllm.config import TrainerConfig
from fastllm.config.layout import resolve
from fastllm.engine.buffers import GroupBuffers
from fastllm.engine.model_stages import ModelStages
from fastllm.engine.weights_io import load_full_parameters
from fastllm.model import GPTModel
from fastllm.parallel.mesh import build_mesh


def two_rank_stages(
    config: TrainerConfig, reference: GPTModel, rank: int, zero_stage: int,
    dtype: torch.dtype = torch.float32, **options: Any,
) -> tuple[GPTModel, ModelStages]:  # fmt: skip
    """A model of `config` on this rank of two data ranks, its parameters `reference`'s
    (`options`: ModelStages's)."""
    with torch.device("meta"):
        model = GPTModel(config.model.base_model)
    mesh = build_mesh(resolve(config, 2), rank)
    cpu = torch.device("cpu")
    stages = ModelStages(
        model, compute_dtype=dtype, device=cpu, mesh=mesh, zero_stage=zero_stage, **options
    )
    load_full_parameters(stages, reference.named_parameters())
    return model, stages


def assert_shard_gradients_double(
    buffers: GroupBuffers, grads: dict[str, torch.Tensor], rank: int, **tolerances: float
) -> None:
    """Each shard's summed gradient is twice the unsharded model's `grads` (by name): both
    ranks ran the same batch."""
    for stage, shard in buffers.shards.items():
        start, end = buffers.layout.shard_range(stage, rank)
        full = torch.zeros(buffers.layout.stage_size(stage))
        for index, name in enumerate(buffers.names):
            s, offset, numel = buffers.layout.parameter(index)
            if s == stage:
                full[offset : offset + numel] = grads[name].float().reshape(-1)
        torch.testing.assert_close(shard.grad, 2 * full[start:end], **tolerances)
