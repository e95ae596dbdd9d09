"""The parallel block: a `block` component. It builds the transformer's mixer and MLP through
their contracts, as fastllm's block does, and its one norm, so that the engine finds every
parameter's metadata in them."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fastllm.config import registry
from fastllm.config.model import LoRAConfig, TransformerConfig
from fastllm.model.normalization import normalization
from fastllm.parallel.mesh import ParallelMesh
from fastllm_example_plugin.config import ParallelBlockConfig


class ParallelBlock(torch.nn.Module):
    """`norm` normalizes the input of both the mixer and the MLP (their first projections
    fuse it); under tensor parallelism each enters and leaves the tensor group itself."""

    def __init__(
        self,
        config: ParallelBlockConfig,
        transformer: TransformerConfig,
        layer_index: int,
        mesh: ParallelMesh,
        lora: LoRAConfig | None,
    ) -> None:
        super().__init__()
        t = transformer
        self.norm = normalization(t.normalization, t.hidden_size)
        self.mixer = registry.implementation(t.mixer)(t.mixer, t, layer_index, mesh, lora)
        self.mlp = registry.implementation(t.mlp)(t.mlp, t, layer_index, mesh, lora)

    def forward(
        self,
        x: Tensor,
        rotary: tuple[Tensor, Tensor] | None,
        document_ids: Tensor | None,
        cache: Any,
        branch_ids: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        """The new residual stream and the MLP's auxiliary loss."""
        mixed = self.mixer(x, self.norm, rotary, document_ids, cache, branch_ids)
        out, auxiliary = self.mlp(x, self.norm)
        return x + mixed + out, auxiliary
