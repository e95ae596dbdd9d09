"""One transformer block: pre-norm attention and MLP, each added to the residual stream."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fastllm.config.model import LoRAConfig, TransformerConfig
from fastllm.model.attention import Attention
from fastllm.model.mlp import MLP, MixtureOfExperts
from fastllm.model.normalization import Normalization
from fastllm.parallel.mesh import ParallelMesh


class TransformerBlock(torch.nn.Module):
    def __init__(
        self,
        config: TransformerConfig,
        layer_index: int,
        mesh: ParallelMesh | None = None,
        lora: LoRAConfig | None = None,
    ) -> None:
        super().__init__()
        mesh = mesh or ParallelMesh.single()
        self.norm_1 = Normalization(config.normalization, config.hidden_size)
        self.attention = Attention(config, layer_index, mesh.tensor, mesh.sequence_data, lora)
        self.norm_2 = Normalization(config.normalization, config.hidden_size)
        self.mlp: MLP | MixtureOfExperts = (
            MixtureOfExperts(config, mesh.tensor, mesh.expert)
            if config.num_experts > 1
            else MLP(config, mesh.tensor, lora)
        )

    def forward(
        self,
        x: Tensor,
        rotary: tuple[Tensor, Tensor] | None,
        document_ids: Tensor | None = None,
        cache: Any = None,
        branch_ids: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The new residual stream and the block's auxiliary loss (MoE router), if any."""
        x = x + self.attention(x, self.norm_1, rotary, document_ids, cache, branch_ids)
        out, auxiliary = self.mlp(x, self.norm_2)
        return x + out, auxiliary
