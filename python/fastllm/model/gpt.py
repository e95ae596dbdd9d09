"""The one transformer: embedding, blocks, final norm, head (logits or fused loss)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fastllm.config.model import BaseModelConfig, NoRotaryConfig
from fastllm.model.block import Normalization, TransformerBlock
from fastllm.model.rotary import RotaryTables, positions_in_documents
from fastllm_kernels.cross_entropy import linear_cross_entropy


class GPTModel(torch.nn.Module):
    """A decoder-only transformer configured by `model.base_model`.

    `forward(input_ids)` returns logits; `loss(input_ids, labels)` returns the mean
    next-token cross-entropy (labels -100 are ignored) plus the router losses, without ever
    materializing the logits."""

    def __init__(self, config: BaseModelConfig) -> None:
        super().__init__()
        transformer = config.transformer
        assert transformer.kv_channels is not None, "validate the config first"
        self.config = config
        self.embeddings = torch.nn.Embedding(config.vocab_size, transformer.hidden_size)
        self.layers = torch.nn.ModuleList(
            TransformerBlock(transformer, i) for i in range(transformer.num_layers)
        )
        self.final_norm = Normalization(transformer.normalization, transformer.hidden_size)
        self.head = (
            None
            if config.tie_word_embeddings
            else torch.nn.Linear(transformer.hidden_size, config.vocab_size, bias=False)
        )
        self.rotary = (
            None
            if isinstance(transformer.rotary, NoRotaryConfig)
            else RotaryTables(transformer.rotary, transformer.kv_channels)
        )

    @property
    def head_weight(self) -> Tensor:
        return self.embeddings.weight if self.head is None else self.head.weight

    def hidden_states(
        self,
        input_ids: Tensor,
        *,
        document_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: Any = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The final-normed hidden states (batch, seq, hidden) and the summed auxiliary loss.

        `document_ids` (batch, seq) keeps attention inside documents of packed samples, and
        positions restart with each document unless `position_ids` are given."""
        if position_ids is None:
            if document_ids is not None:
                position_ids = positions_in_documents(document_ids)
            else:
                start = cache.get_seq_length() if cache is not None else 0
                position_ids = torch.arange(
                    start, start + input_ids.shape[1], device=input_ids.device
                )
        rotary = None if self.rotary is None else self.rotary(position_ids)
        x = self.embeddings(input_ids)
        auxiliary: Tensor | None = None
        for layer in self.layers:
            x, layer_auxiliary = layer(x, rotary, document_ids, cache)
            if layer_auxiliary is not None:
                auxiliary = layer_auxiliary if auxiliary is None else auxiliary + layer_auxiliary
        return self.final_norm(x), auxiliary

    def forward(self, input_ids: Tensor, **kwargs: Any) -> Tensor:
        hidden, _ = self.hidden_states(input_ids, **kwargs)
        return F.linear(hidden, self.head_weight)

    def loss(self, input_ids: Tensor, labels: Tensor, **kwargs: Any) -> Tensor:
        hidden, auxiliary = self.hidden_states(input_ids, **kwargs)
        loss = linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), self.head_weight, labels.reshape(-1)
        )
        return loss if auxiliary is None else loss + auxiliary
