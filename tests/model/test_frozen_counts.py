"""The frozen parameters the config counts (the start-up summary, memory and MFU accounting)
are those `apply_freeze` marks in the model it builds."""

from __future__ import annotations

from typing import Any

import pytest

from fastllm.config import ModelConfig, build
from fastllm.model import GPTModel
from fastllm.model.freeze import apply_freeze
from fastllm.model.parameters import parameter_metas

TRANSFORMER = {
    "num_layers": 3,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "head_groups": 2,
    "ffn_hidden_size": 48,
}
MIXTURE = {
    **TRANSFORMER,
    "add_linear_biases": False,
    "num_experts": 4,
    "num_experts_per_token": 2,
    "first_dense_layers": 1,
}


@pytest.mark.parametrize(
    ("transformer", "extra"),
    [
        # a mixture whose first block is dense: blocks of two sizes
        (MIXTURE, {"freeze": {"blocks": [0, 2]}}),
        (MIXTURE, {"freeze": {"blocks": [1, 3], "norms": True}}),
        # the multi-token prediction modules' norms freeze with the others
        (
            TRANSFORMER,
            {"freeze": {"norms": True, "embeddings": True, "head": True}},
        ),
        (MIXTURE, {"freeze": {"norms": True}, "multi_token_prediction": {}}),
        # LoRA (attention only with a mixture), a frozen block's adapters frozen with it
        (MIXTURE, {"peft": {"type": "lora", "layers": ["query"]}, "freeze": {"blocks": [0, 1]}}),
        # the experts' adapters, and the dense first block's MLP adapted instead
        (
            MIXTURE,
            {
                "peft": {"type": "lora", "layers": ["experts_2", "mlp_1"], "freeze_others": False},
                "freeze": {"blocks": [0, 2]},
            },
        ),
        (
            MIXTURE,
            {
                "peft": {"type": "lora", "layers": ["experts_1", "mlp_2"]},
                "freeze": {"blocks": [1, 2]},
            },
        ),
    ],
)
def test_the_config_counts_the_parameters_the_model_freezes(
    transformer: dict[str, Any], extra: dict[str, Any]
) -> None:
    base: dict[str, Any] = {"transformer": transformer, "vocab_size": 31}
    if "multi_token_prediction" in extra:
        base["multi_token_prediction"] = extra["multi_token_prediction"]
    if "peft" in extra:
        base["peft"] = extra["peft"]
    config = build(ModelConfig, {"base_model": base, "freeze": extra.get("freeze", {})})
    model = GPTModel(config.base_model)
    apply_freeze(model, config.freeze, config.base_model.peft)
    frozen = {name for name, meta in parameter_metas(model).items() if meta.frozen}
    named = dict(model.named_parameters())
    assert sum(named[name].numel() for name in frozen) == config.num_frozen_parameters()


def test_frozen_norms_and_head_save_their_weight_gradients_in_the_prediction_modules_too() -> None:
    from fastllm.config.flops import flops_per_token
    from fastllm.config.model import FreezeConfig

    base = build(
        ModelConfig,
        {
            "base_model": {
                "transformer": TRANSFORMER,
                "vocab_size": 31,
                "multi_token_prediction": {},
            }
        },
    ).base_model
    counts, depth = base.parameter_counts(), 1
    head = base.vocab_size * TRANSFORMER["hidden_size"]
    frozen = FreezeConfig(norms=True, embeddings=True, head=True)
    norm_elements = (
        TRANSFORMER["num_layers"] * counts.block_norm_elements
        + counts.final_norm
        + depth * (counts.block_norm_elements + 3 * counts.final_norm)
    )
    # 2 × each frozen parameter's count: no weight gradient (the head in each module too)
    saved = 2 * norm_elements + 2 * head * (1 + depth)
    assert flops_per_token(base, 16) - flops_per_token(base, 16, frozen) == saved
