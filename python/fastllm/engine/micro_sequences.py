"""Micro-sequences: a micro-batch's sequences cut into pieces that run one after another, each
piece's attention reading the keys and values of the pieces before it (Fast-LLM's
`micro_batch_splits`). The keys and values stay in the autograd graph, so one backward pass
over the pieces' losses reaches the earlier pieces through them."""

from __future__ import annotations

import torch
from torch import Tensor


class KeyValueMemory:
    """The keys and values of the pieces run so far, per layer, as the model's `cache` (the
    `update` / `get_seq_length` of a transformers Cache, in its (batch, heads, seq, head)
    layout): `update` appends a piece's and returns all of them."""

    def __init__(self) -> None:
        self._layers: dict[int, tuple[Tensor, Tensor]] = {}

    def get_seq_length(self) -> int:
        """Positions of the pieces run so far (where the next piece starts)."""
        return self._layers[0][0].shape[2] if 0 in self._layers else 0

    def update(self, k: Tensor, v: Tensor, layer_index: int) -> tuple[Tensor, Tensor]:
        if layer_index in self._layers:
            earlier_k, earlier_v = self._layers[layer_index]
            k, v = torch.cat([earlier_k, k], dim=2), torch.cat([earlier_v, v], dim=2)
        self._layers[layer_index] = (k, v)
        return k, v
