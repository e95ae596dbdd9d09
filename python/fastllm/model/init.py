"""Initialization per config: normal(0, init_method_std) for weights, the output projections
of each block scaled down by sqrt(2 * num_layers) (GPT-2, Megatron), zero biases, unit norms
(zero weights of zero-centered ones, whose scale is 1 + weight);
LoRA adapters as PEFT draws them: A uniform in ±1/sqrt(in features) (Kaiming-uniform with
a = sqrt(5), torch.nn.Linear's default), B zero.

A layer of another package (a component, config/registry.py) says how its parameters start:
it defines `initializers(std, output_std, generator)`, the list of its parameters each with
the function that fills it (`output_std`: for a projection back into the residual stream)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fastllm.model.attention import Attention
from fastllm.model.gpt import GPTModel
from fastllm.model.latent_attention import LatentAttention
from fastllm.model.lora import Adapter
from fastllm.model.mlp import MLP, MixtureOfExperts
from fastllm.model.multi_token_prediction import PredictionModule
from fastllm.model.normalization import Normalization

Initializer = Callable[[torch.Tensor], None]


def initializers(
    model: GPTModel, generator: torch.Generator | None = None
) -> list[tuple[str, Initializer]]:
    """Each parameter's name and the function that fills it, in the order the random draws are
    made: running them in turn on tensors of the parameters' shapes (anywhere: one at a time,
    or on a model that lives on the meta device) gives exactly what `initialize` gives."""
    transformer = model.config.transformer
    std = transformer.init_method_std
    assert std is not None
    output_std = std / math.sqrt(2 * transformer.num_layers)
    names = {id(p): name for name, p in model.named_parameters()}
    plan: list[tuple[str, Initializer]] = []

    def normal(parameter: torch.Tensor, scale: float) -> None:
        plan.append((names[id(parameter)], lambda t: t.normal_(0.0, scale, generator=generator)))

    def constant(parameter: torch.Tensor | None, value: float) -> None:
        if parameter is not None:
            plan.append((names[id(parameter)], lambda t: t.fill_(value)))

    def input_and_output(first: torch.nn.Linear, second: torch.nn.Linear) -> None:
        """The projection into a sub-layer and the (scaled-down) one back to the residual."""
        normal(first.weight, std)
        normal(second.weight, output_std)
        for linear in (first, second):
            constant(linear.bias, 0.0)

    normal(model.embeddings.weight, std)
    if model.head is not None:
        normal(model.head.weight, std)
    for module in model.modules():
        if hasattr(module, "initializers"):
            for parameter, fill in module.initializers(std, output_std, generator):
                plan.append((names[id(parameter)], fill))
        elif isinstance(module, Normalization):
            constant(module.weight, 0.0 if module.zero_centered else 1.0)
            constant(module.bias, 0.0)
        elif isinstance(module, Attention):
            input_and_output(module.query_key_value, module.dense)
        elif isinstance(module, LatentAttention):
            for layer in (module.query_down, module.query_up, module.key_value_down):
                if layer is not None:
                    normal(layer.weight, std)
            normal(module.key_value_up.weight, std)
            normal(module.dense.weight, output_std)
        elif isinstance(module, MLP):
            input_and_output(module.layer_1, module.layer_2)
        elif isinstance(module, MixtureOfExperts):
            normal(module.router.weight, std)
            normal(module.layer_1, std)
            normal(module.layer_2, output_std)
            if module.shared_gate is not None:
                normal(module.shared_gate.weight, std)
            constant(module.expert_bias, 0.0)  # balanced from the first step's loads on
        elif isinstance(module, PredictionModule):
            normal(module.projection.weight, std)
        elif isinstance(module, Adapter):
            bound = module.in_features**-0.5
            plan.append(
                (names[id(module.a)], lambda t, b=bound: t.uniform_(-b, b, generator=generator))
            )
            constant(module.b, 0.0)
    missing = sorted(set(names.values()) - {name for name, _ in plan})
    if missing:
        raise TypeError(
            f"parameters no layer initializes: {missing[:5]} (a layer of another package "
            "defines initializers(std, output_std, generator))"
        )
    return plan


@torch.no_grad()
def initialize(model: GPTModel, generator: torch.Generator | None = None) -> None:
    parameters = dict(model.named_parameters())
    for name, fill in initializers(model, generator):
        fill(parameters[name])
