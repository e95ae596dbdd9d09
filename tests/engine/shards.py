"""What the two-rank scripts that tests/engine runs under torchrun share: the flat model of a
reference on two data ranks, and the check of its summed shards."""

from __future__ import annotations

import torch

from fastllm.config import TrainerConfig
from fastllm.config.layout import resolve
from fastllm.engine.flat_model import FlatModel
from fastllm.model import GPTModel
from fastllm.parallel.mesh import build_mesh


def two_rank_flat(
    config: TrainerConfig, reference: GPTModel, rank: int, zero_stage: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[GPTModel, FlatModel]:  # fmt: skip
    """A model of `config` on this rank of two data ranks, its parameters `reference`'s."""
    with torch.device("meta"):
        model = GPTModel(config.model.base_model)
    mesh = build_mesh(resolve(config, 2), rank)
    cpu = torch.device("cpu")
    flat = FlatModel(model, compute_dtype=dtype, device=cpu, mesh=mesh, zero_stage=zero_stage)
    flat.load_full_parameters(reference.named_parameters())
    return model, flat


def assert_shard_gradients_double(
    flat: FlatModel, grads: dict[str, torch.Tensor], rank: int, **tolerances: float
) -> None:
    """Each shard's summed gradient is twice the unsharded model's `grads` (by name): both
    ranks ran the same batch."""
    for stage, shard in flat.shards.items():
        start, end = flat.layout.shard_range(stage, rank)
        full = torch.zeros(flat.layout.stage_size(stage))
        for index, name in enumerate(flat.names):
            s, offset, numel = flat.layout.parameter(index)
            if s == stage:
                full[offset : offset + numel] = grads[name].float().reshape(-1)
        torch.testing.assert_close(shard.grad, 2 * full[start:end], **tolerances)
