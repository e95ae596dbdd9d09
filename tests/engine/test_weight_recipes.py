"""The engine reaches the kernels through the recipes the layers declare (`ParameterMeta.recipe`):
the engine's stages give each one a gradient sink, and the ops a layer calls with a weight get its
recipe."""

from __future__ import annotations

import torch

from fastllm.model import GPTModel, initialize
from fastllm.model.parameters import parameter_metas
from tests.engine.test_stage_buffers import model_stages, tiny_config

PROJECTIONS = ("attention.query_key_value", "attention.dense", "mlp.layer_1", "mlp.layer_2")


def test_the_stages_sink_the_gradients_of_the_declared_projections() -> None:
    config = tiny_config("model.base_model.tie_word_embeddings=false")
    reference = GPTModel(config.model.base_model)
    model, _ = model_stages(config, reference, torch.float32)
    sunk = {
        name
        for name, meta in parameter_metas(model).items()
        if meta.recipe is not None and meta.recipe.gradient_sink is not None
    }
    blocks = {f"layers.{i}.{p}.weight" for i in range(len(model.layers)) for p in PROJECTIONS}
    assert sunk == {*blocks, "head.weight"}


def test_a_projection_hands_its_weight_gradient_to_the_sink_of_its_recipe() -> None:
    config = tiny_config()
    reference = GPTModel(config.model.base_model)
    initialize(reference, torch.Generator().manual_seed(0))
    model, stages = model_stages(config, reference, torch.float32)
    recipe = model.layers[0].attention.dense_recipe
    calls = []
    sink = recipe.gradient_sink
    assert sink is not None
    recipe.gradient_sink = lambda product: (calls.append(product), sink(product))
    tokens = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(tokens, -1, dims=1)
    model.loss(tokens, labels).backward()
    stages.finish_backward()
    assert len(calls) == 1
    reference.loss(tokens, labels).backward()
    buffers = stages.dense.buffers
    index = buffers.names.index("layers.0.attention.dense.weight")
    torch.testing.assert_close(
        buffers.gradients.views[index],
        reference.layers[0].attention.dense.weight.grad,
        rtol=1e-5,
        atol=1e-6,
    )
