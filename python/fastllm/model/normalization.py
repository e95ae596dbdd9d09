"""The normalization layers: RMSNorm or LayerNorm, fused with the projection that reads them,
and the absent norm of a block that normalizes only the outputs of its layers."""

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
    """RMSNorm (weight) or LayerNorm (weight and bias) through the fused kernels, over the last
    dimension of its input."""

    recompute = True
    """`project` recomputes the norm's output in the backward pass rather than storing it."""

    def __init__(
        self, config: NormalizationConfig, size: int, *, tensor_partial: bool = True
    ) -> None:
        """`tensor_partial`: replicated over the tensor ranks, each of which computes only its
        part of the gradient (a norm feeding split projections sees only this rank's columns
        of them; one over each head sees only this rank's heads); else a norm of the residual
        stream itself, whose gradient every tensor rank computes whole (under sequence-tensor
        parallelism, for its chunk of the sequence)."""
        super().__init__()
        self.epsilon, self.zero_centered = config.epsilon, config.zero_centered
        self.weight = torch.nn.Parameter(
            torch.zeros(size) if self.zero_centered else torch.ones(size)
        )
        has_bias = isinstance(config, LayerNormConfig)
        self.bias = torch.nn.Parameter(torch.zeros(size)) if has_bias else None
        for name in ("weight", "bias"):
            describe(
                self,
                name,
                weight_decay=False,
                tensor_partial=tensor_partial,
                sequence_tensor_parallel_replicated=not tensor_partial,
            )

    @property
    def scale(self) -> Tensor:
        """What multiplies the normalized input: the weight, or with `zero_centered` 1 + the
        weight in fp32 (so that a bf16 weight's small offset keeps its bits, as Gemma adds)."""
        return self.weight.float() + 1.0 if self.zero_centered else self.weight

    def forward(self, x: Tensor) -> Tensor:
        if self.bias is None:
            return rms_norm(x, self.scale, self.epsilon)
        return layer_norm(x, self.scale, self.bias, self.epsilon)

    def project(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, recipe: WeightRecipe | None = None
    ) -> Tensor:
        """linear(self(x), weight, bias) under the weight's `recipe`; with `recompute`, storing x
        rather than self(x) for the backward pass."""
        if not self.recompute:
            return linear(self(x), weight, bias, recipe)
        rms = self.bias is None
        return norm_linear(x, self.scale, self.bias, self.epsilon, rms, weight, bias, recipe)


class NoNormalization(torch.nn.Module):
    """`Normalization`'s interface with the input left as it is: what attention and the MLP
    read in a block whose norms come after them (`normalization_placement: post`)."""

    def forward(self, x: Tensor) -> Tensor:
        return x

    def project(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, recipe: WeightRecipe | None = None
    ) -> Tensor:
        return linear(x, weight, bias, recipe)


InputNorm = Normalization | NoNormalization
"""What attention and the MLP apply to the residual stream before their first projection."""
