"""The `decoder` block: a mixer (attention) and an MLP, each added to the residual stream,
with norms before them, after them or both (`normalization_placement`).

The contract of the `block` components (config/registry.py): a block's implementation is built
as `Block(config, transformer, layer_index, mesh, lora)` and called as
`block(x, rotary, document_ids, cache, branch_ids)`: x (batch, seq, hidden) is the residual
stream, the rest what its mixer reads; it returns the new residual stream and its weighted
auxiliary loss or None. The contracts of the `mixer` and `mlp` components, whose layers the
block builds from their configs:
- a mixer's implementation is built as `Layer(config, transformer, layer_index, mesh, lora)`
  and called as `layer(x, norm, rotary, document_ids, cache, branch_ids)`: x (batch, seq,
  hidden) is the residual stream, `norm` the `NormalizationLayer` to read it through
  (`norm.project(x, weight, bias)` fuses it into a first projection), `rotary` the (cos, sin)
  tables or None; it returns (batch, seq, hidden), to be added to the residual stream.
- an MLP's implementation is built as `Layer(config, transformer, layer_index, mesh, lora)` and called as
  `layer(x, norm)`; it returns its output (batch, seq, hidden) and its auxiliary loss or None.
Both declare their parameters' metadata with `model.parameters.describe` (the engine lays out,
shards and saves from it alone) and, under tensor parallelism, enter and leave the tensor
group with `parallel.tensor.enter` / `leave` (or refuse the layout through their config's
`unsupported_settings`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fastllm.config import registry
from fastllm.config.model import DecoderBlockConfig, LoRAConfig, TransformerConfig
from fastllm.model.normalization import (
    InputNorm,
    NoNormalization,
    NormalizationLayer,
    normalization,
)
from fastllm.parallel.mesh import ParallelMesh


class TransformerBlock(torch.nn.Module):
    """norm_1 and norm_2 normalize the inputs of attention and of the MLP (their first
    projections fuse them); post_norm_1 and post_norm_2 their outputs, the residual stream as
    every tensor rank holds it."""

    def __init__(
        self,
        config: DecoderBlockConfig,
        transformer: TransformerConfig,
        layer_index: int,
        mesh: ParallelMesh | None = None,
        lora: LoRAConfig | None = None,
    ) -> None:
        super().__init__()
        t, mesh = transformer, mesh or ParallelMesh.single()
        self.norm_1 = _input_norm(t)
        self.attention = registry.implementation(t.mixer)(t.mixer, t, layer_index, mesh, lora)
        self.post_norm_1 = _output_norm(t)
        self.norm_2 = _input_norm(t)
        self.mlp = registry.implementation(t.mlp)(t.mlp, t, layer_index, mesh, lora)
        self.post_norm_2 = _output_norm(t)

    def forward(
        self,
        x: Tensor,
        rotary: tuple[Tensor, Tensor] | None,
        document_ids: Tensor | None = None,
        cache: Any = None,
        branch_ids: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The new residual stream and the block's auxiliary loss (MoE router), if any."""
        out = self.attention(x, self.norm_1, rotary, document_ids, cache, branch_ids)
        x = x + (out if self.post_norm_1 is None else self.post_norm_1(out))
        out, auxiliary = self.mlp(x, self.norm_2)
        return x + (out if self.post_norm_2 is None else self.post_norm_2(out)), auxiliary


def _input_norm(config: TransformerConfig) -> InputNorm:
    if not config.pre_norms:
        return NoNormalization()
    return normalization(config.normalization, config.hidden_size)


def _output_norm(config: TransformerConfig) -> NormalizationLayer | None:
    if not config.post_norms:
        return None
    return normalization(config.normalization, config.hidden_size, tensor_partial=False)
