"""The normalization layers: RMSNorm or LayerNorm, fused with the projection that reads them."""

from __future__ import annotations

import torch
from torch import Tensor

from fastllm.config.model import LayerNormConfig, NormalizationConfig
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
