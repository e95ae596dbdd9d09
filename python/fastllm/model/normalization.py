"""The normalization layers: RMSNorm or LayerNorm, fused with the projection that reads them,
and the absent norm of a block that normalizes only the outputs of its layers.

The contract of a `normalization` component (config/registry.py): its implementation is a
`NormalizationLayer` built as `Layer(config, size, tensor_partial=…)` that maps (…, size) to
(…, size), declares its parameters with `describe` (`tensor_partial` and
`sequence_tensor_parallel_replicated` as `Normalization` passes them), and may fuse itself
into the projection that reads it (`project`)."""

from __future__ import annotations

import torch
from torch import Tensor

from fastllm.config import registry
from fastllm.config.model import LayerNormConfig, NormalizationConfig
from fastllm.model.parameters import describe
from fastllm_kernels.linear import linear
from fastllm_kernels.norm import layer_norm, rms_norm
from fastllm_kernels.norm_linear import norm_linear
from fastllm_kernels.recipe import WeightRecipe


class NormalizationLayer(torch.nn.Module):
    """What attention and the MLP read their input through: `forward(x)` normalizes the last
    dimension, `project` is linear(self(x), …), which a layer may fuse."""

    def project(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, recipe: WeightRecipe | None = None
    ) -> Tensor:
        """linear(self(x), weight, bias) under the weight's `recipe` (the kernels' FP8 and
        gradient-sink options, which `linear` applies)."""
        return linear(self(x), weight, bias, recipe)


def normalization(
    config: NormalizationConfig, size: int, *, tensor_partial: bool = True
) -> NormalizationLayer:
    """The layer of `config`'s component over `size` features (`tensor_partial`: as
    `Normalization` says)."""
    layer = registry.implementation(config)(config, size, tensor_partial=tensor_partial)
    if not isinstance(layer, NormalizationLayer):
        raise TypeError(
            f"normalization type {registry.name_of(type(config))!r} built a "
            f"{type(layer).__qualname__}, not a NormalizationLayer (model/normalization.py)"
        )
    return layer


class Normalization(NormalizationLayer):
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


class NoNormalization(NormalizationLayer):
    """The input left as it is: what attention and the MLP read in a block whose norms come
    after them (`normalization_placement: post`)."""

    def forward(self, x: Tensor) -> Tensor:
        return x


InputNorm = NormalizationLayer
"""What attention and the MLP apply to the residual stream before their first projection."""
