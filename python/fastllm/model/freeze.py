"""`model.freeze`: the parameters that do not train, marked in their metadata
(`ParameterMeta.frozen`), from which the engine lays them out in weights-only buffers."""

from __future__ import annotations

from fastllm.config.model import FreezeConfig
from fastllm.model.gpt import GPTModel
from fastllm.model.normalization import Normalization
from fastllm.model.parameters import freeze


def apply_freeze(model: GPTModel, config: FreezeConfig) -> None:
    if config.embeddings:
        freeze(model.embeddings)
    if config.head and model.head is not None:  # a tied head is the embedding
        freeze(model.head)
    for block in config.frozen_blocks():
        freeze(model.layers[block])
    if config.norms:
        for module in model.modules():
            if isinstance(module, Normalization):
                freeze(module)
