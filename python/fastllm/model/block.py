"""One transformer block: pre-norm attention and MLP, each added to the residual stream."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fastllm.config.model import LayerNormConfig, NormalizationConfig, TransformerConfig
from fastllm.engine.expert_parallel import ExpertParallel
from fastllm.engine.sequence_data_parallel import SequenceDataParallel
from fastllm.engine.tensor_parallel import TensorParallel
from fastllm.model.attention import Attention
from fastllm.model.mlp import MLP, MixtureOfExperts
from fastllm.model.parameters import describe
from fastllm_kernels.linear import linear
from fastllm_kernels.norm import layer_norm, rms_norm
from fastllm_kernels.norm_linear import norm_linear
from fastllm_kernels.recipe import WeightRecipe


class Normalization(torch.nn.Module):
    """RMSNorm (weight) or LayerNorm (weight and bias) through the fused kernels."""

    recompute = True
    """`project` recomputes the norm's output in the backward pass rather than storing it."""

    def __init__(self, config: NormalizationConfig, hidden_size: int) -> None:
        super().__init__()
        self.epsilon = config.epsilon
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        has_bias = isinstance(config, LayerNormConfig)
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size)) if has_bias else None
        # Replicated over tensor ranks; each sees only its columns of the projection after it.
        for name in ("weight", "bias"):
            describe(self, name, weight_decay=False, tensor_partial=True)

    def forward(self, x: Tensor) -> Tensor:
        if self.bias is None:
            return rms_norm(x, self.weight, self.epsilon)
        return layer_norm(x, self.weight, self.bias, self.epsilon)

    def project(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, recipe: WeightRecipe | None = None
    ) -> Tensor:
        """linear(self(x), weight, bias) under the weight's `recipe`; with `recompute`, storing x
        rather than self(x) for the backward pass."""
        if not self.recompute:
            return linear(self(x), weight, bias, recipe)
        rms = self.bias is None
        return norm_linear(x, self.weight, self.bias, self.epsilon, rms, weight, bias, recipe)


class TransformerBlock(torch.nn.Module):
    def __init__(
        self,
        config: TransformerConfig,
        layer_index: int,
        tp: TensorParallel,
        sdp: SequenceDataParallel | None = None,
        ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        self.norm_1 = Normalization(config.normalization, config.hidden_size)
        self.attention = Attention(config, layer_index, tp, sdp)
        self.norm_2 = Normalization(config.normalization, config.hidden_size)
        self.mlp: MLP | MixtureOfExperts = (
            MixtureOfExperts(config, tp, ep) if config.num_experts > 1 else MLP(config, tp)
        )

    def forward(
        self,
        x: Tensor,
        rotary: tuple[Tensor, Tensor] | None,
        document_ids: Tensor | None = None,
        cache: Any = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The new residual stream and the block's auxiliary loss (MoE router), if any."""
        x = x + self.attention(x, self.norm_1, rotary, document_ids, cache)
        out, auxiliary = self.mlp(x, self.norm_2)
        return x + out, auxiliary
