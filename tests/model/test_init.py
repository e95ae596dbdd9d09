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


def test_zero_centered_norms_start_at_the_identity_scale() -> None:
    """A zero-centered norm's weight starts at 0, so its scale 1 + weight starts at 1, as a
    plain norm's weight does: the model computes what it would with plain norms at init."""
    example = ROOT / "examples" / "gemma3-4b.yaml"
    small = [
        f"model.base_model.transformer.{key}"
        for key in ("num_layers=2", "hidden_size=32", "ffn_hidden_size=48", "kv_channels=8")
    ] + ["model.base_model.vocab_size=61"]
    centered = load_config(TrainerConfig, [example], small).model.base_model
    plain = load_config(
        TrainerConfig,
        [example],
        [
            *small,
            *(
                f"model.base_model.transformer.{norm}.zero_centered=false"
                for norm in ("normalization", "query_norm", "key_norm")
            ),
        ],
    ).model.base_model
    models = []
    for config in (centered, plain):
        model = GPTModel(config)
        initialize(model, torch.Generator().manual_seed(5))
        models.append(model)
    weights = [p for n, p in models[0].named_parameters() if "norm" in n]
    assert weights and all(torch.equal(w, torch.zeros_like(w)) for w in weights)
    input_ids = torch.randint(0, 61, (1, 9), generator=torch.Generator().manual_seed(6))
    assert torch.equal(models[0](input_ids), models[1](input_ids))
