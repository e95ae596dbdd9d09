"""QK-norm: the queries' or the keys' norm between their projection and rotary, over each head
(Qwen3, Gemma 3) or over all the heads of the projection together (OLMo 2)."""

from __future__ import annotations

import torch
from torch import Tensor

from fastllm.config.model import NormalizationConfig, QueryKeyNormScope
from fastllm.model.normalization import Normalization
from fastllm.model.parameters import TensorSplit, describe
from fastllm.parallel.tensor import TensorDimension, summed
from fastllm_kernels.norm import rms_norm


def query_key_norm(
    config: NormalizationConfig | None,
    scope: QueryKeyNormScope,
    heads: int,
    head_size: int,
    tensor: TensorDimension,
) -> Normalization | None:
    """The norm of the `heads` query or key heads this tensor rank holds, each (batch, seq,
    heads, head_size) in and out; None without one."""
    if config is None:
        return None
    if scope == "head":  # replicated; each tensor rank's gradient covers only its heads
        return Normalization(config, head_size)
    return AllHeadsRMSNorm(config, heads, head_size, tensor)


class AllHeadsRMSNorm(Normalization):
    """RMSNorm over all the heads of a projection at once, with one weight over all of them:
    each tensor rank holds its heads' slice of the weight, and sums the squares of its heads
    with the other ranks' for their mean."""

    def __init__(
        self, config: NormalizationConfig, heads: int, head_size: int, tensor: TensorDimension
    ) -> None:
        super().__init__(config, heads * head_size)
        self.tensor = tensor
        self.width = tensor.size * heads * head_size
        describe(self, "weight", weight_decay=False, tensor_split=TensorSplit(0, (self.width,)))

    def forward(self, x: Tensor) -> Tensor:
        flat = x.flatten(-2)
        if not self.tensor.split:
            return rms_norm(flat, self.scale, self.epsilon).view_as(x)
        x32 = flat.float()
        squares = summed(x32.square().sum(-1, keepdim=True), self.tensor)
        normed = x32 * torch.rsqrt(squares / self.width + self.epsilon) * self.scale.float()
        return normed.to(x.dtype).view_as(x)
