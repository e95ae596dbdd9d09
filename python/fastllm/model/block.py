"""One transformer block: attention and MLP, each added to the residual stream, with norms
before them, after them or both (`normalization_placement`)."""

from __future__ import annotations

from typing import Any

import msgspec
import torch
from torch import Tensor

from fastllm.config.model import LoRAConfig, TransformerConfig
from fastllm.model.attention import Attention
from fastllm.model.latent_attention import LatentAttention
from fastllm.model.mlp import MLP, MixtureOfExperts
from fastllm.model.normalization import InputNorm, NoNormalization, Normalization
from fastllm.parallel.mesh import ParallelMesh


class TransformerBlock(torch.nn.Module):
    """norm_1 and norm_2 normalize the inputs of attention and of the MLP (their first
    projections fuse them); post_norm_1 and post_norm_2 their outputs, the residual stream as
    every tensor rank holds it."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_index: int,
        mesh: ParallelMesh | None = None,
        lora: LoRAConfig | None = None,
    ) -> None:
        super().__init__()
        mesh = mesh or ParallelMesh.single()
        self.norm_1 = _input_norm(config)
        self.attention: Attention | LatentAttention = (
            Attention(config, layer_index, mesh.tensor, mesh.sequence_data, lora)
            if config.latent_attention is None
            else LatentAttention(config, layer_index, mesh.tensor, mesh.sequence_data)
        )
        self.post_norm_1 = _output_norm(config)
        self.norm_2 = _input_norm(config)
        self.mlp: MLP | MixtureOfExperts = (
            MixtureOfExperts(config, mesh.tensor, mesh.expert)
            if config.has_experts(layer_index)
            else MLP(_dense(config), mesh.tensor, lora)
        )
        self.post_norm_2 = _output_norm(config)

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
    return Normalization(config.normalization, config.hidden_size)


def _output_norm(config: TransformerConfig) -> Normalization | None:
    if not config.post_norms:
        return None
    return Normalization(config.normalization, config.hidden_size, tensor_partial=False)


def _dense(config: TransformerConfig) -> TransformerConfig:
    """`config` for a dense MLP: a mixture-of-experts model's first dense layers are
    `dense_ffn_width` wide."""
    if config.num_experts == 1:
        return config
    return msgspec.structs.replace(config, ffn_hidden_size=config.dense_ffn_width, num_experts=1)
