"""Initialization per config: normal(0, init_method_std) for weights, the output projections
of each block scaled down by sqrt(2 * num_layers) (GPT-2, Megatron), zero biases, unit norms."""

from __future__ import annotations

import math

import torch

from fastllm.model.attention import Attention
from fastllm.model.block import Normalization
from fastllm.model.gpt import GPTModel
from fastllm.model.mlp import MLP, MixtureOfExperts


@torch.no_grad()
def initialize(model: GPTModel, generator: torch.Generator | None = None) -> None:
    transformer = model.config.transformer
    std = transformer.init_method_std
    assert std is not None
    output_std = std / math.sqrt(2 * transformer.num_layers)

    def normal(tensor: torch.Tensor, scale: float) -> None:
        tensor.normal_(0.0, scale, generator=generator)

    def input_and_output(first: torch.nn.Linear, second: torch.nn.Linear) -> None:
        """The projection into a sub-layer and the (scaled-down) one back to the residual."""
        normal(first.weight, std)
        normal(second.weight, output_std)
        for linear in (first, second):
            if linear.bias is not None:
                linear.bias.zero_()

    normal(model.embeddings.weight, std)
    if model.head is not None:
        normal(model.head.weight, std)
    for module in model.modules():
        if isinstance(module, Normalization):
            module.weight.fill_(1.0)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, Attention):
            input_and_output(module.query_key_value, module.dense)
        elif isinstance(module, MLP):
            input_and_output(module.layer_1, module.layer_2)
        elif isinstance(module, MixtureOfExperts):
            normal(module.router.weight, std)
            normal(module.layer_1, std)
            normal(module.layer_2, output_std)
