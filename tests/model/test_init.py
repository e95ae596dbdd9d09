"""Initialization parameter by parameter (how the trainer draws a model too big to hold whole)
gives exactly the whole-model initialization, and covers every parameter of every example."""

from __future__ import annotations

import pytest
import torch

from fastllm.config import TrainerConfig, load_config
from fastllm.model import GPTModel, initialize
from fastllm.model.init import initializers
from tests.conftest import ROOT

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.stem for e in EXAMPLES])
def test_every_parameter_is_initialized_once(example) -> None:
    config = load_config(TrainerConfig, [example], [])
    with torch.device("meta"):
        model = GPTModel(config.model.base_model)
    names = [name for name, _ in initializers(model)]
    assert sorted(names) == sorted(name for name, _ in model.named_parameters())


def test_one_parameter_at_a_time_equals_the_whole_model() -> None:
    overrides = [
        "model.base_model.transformer.num_layers=2",
        "model.base_model.transformer.hidden_size=32",
        "model.base_model.transformer.num_attention_heads=4",
        "model.base_model.transformer.ffn_hidden_size=48",
        "model.base_model.transformer.num_experts=2",
        "model.base_model.transformer.num_shared_experts=1",
        "model.base_model.transformer.shared_expert_gate=true",
        "model.base_model.transformer.add_linear_biases=false",
        "model.base_model.vocab_size=61",
        "model.base_model.tie_word_embeddings=false",
    ]
    config = load_config(TrainerConfig, [ROOT / "examples" / "tiny.yaml"], overrides)
    whole = GPTModel(config.model.base_model)
    initialize(whole, torch.Generator().manual_seed(3))
    shapes = {name: p.shape for name, p in whole.named_parameters()}
    generator = torch.Generator().manual_seed(3)
    for name, fill in initializers(whole, generator):
        tensor = torch.empty(shapes[name])
        fill(tensor)
        assert torch.equal(tensor, dict(whole.named_parameters())[name]), name
