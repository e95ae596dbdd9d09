"""A check shared by the ZeRO-3 scripts that tests/engine runs under torchrun."""

from __future__ import annotations

import torch

from fastllm.engine.flat_model import FlatModel


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
