"""The parameters that do not train, marked in their metadata (`ParameterMeta.frozen`), from
which the engine lays them out in weights-only buffers: those `model.freeze` names and, under
LoRA with `freeze_others`, every parameter but the adapters'."""

from __future__ import annotations

from fastllm.config.model import FreezeConfig, LoRAConfig, NoPeftConfig
from fastllm.model.gpt import GPTModel
from fastllm.model.lora import Adapter
from fastllm.model.normalization import NormalizationLayer
from fastllm.model.parameters import freeze


def apply_freeze(
    model: GPTModel, config: FreezeConfig, peft: LoRAConfig | NoPeftConfig | None = None
) -> None:
    if isinstance(peft, LoRAConfig) and peft.freeze_others:
        adapters = {id(m) for m in model.modules() if isinstance(m, Adapter)}
        for module in model.modules():
            if id(module) not in adapters:
                freeze(module, recurse=False)
    if config.embeddings:
        freeze(model.embeddings)
    if config.head and model.head is not None:  # a tied head is the embedding
        freeze(model.head)
    for block in config.frozen_blocks():
        freeze(model.layers[block])
    if config.norms:
        for module in model.modules():
            if isinstance(module, NormalizationLayer):
                freeze(module)
