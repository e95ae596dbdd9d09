"""What the config says a model has and costs against the model it builds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastllm.config import ConfigError, TrainerConfig, load_config
from fastllm.config.flops import flops_per_token
from fastllm.model import GPTModel
from fastllm.model.mlp import MixtureOfExperts

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "model.base_model.transformer.num_layers=2",
    "model.base_model.transformer.hidden_size=32",
    "model.base_model.transformer.num_attention_heads=4",
    "model.base_model.transformer.ffn_hidden_size=48",
    "model.base_model.vocab_size=61",
]
MOE_VARIANTS = {
    "moe-gated-qkv-biases": ["num_experts=8", "num_experts_per_token=2", "gated=true",
                             "add_linear_biases=only_attn_qkv"],
    "moe-plain-no-biases": ["num_experts=4", "num_experts_per_token=1", "add_linear_biases=false"],
    "moe-shared-gated": ["num_experts=16", "num_experts_per_token=4", "gated=true",
                         "add_linear_biases=false", "num_shared_experts=2", "shared_expert_gate=true"],
    "deepseek-v3": ["num_experts=8", "num_experts_per_token=2", "gated=true", "window_size=null",
                    "add_linear_biases=false", "num_shared_experts=1", "expert_bias=true",
                    "expert_score_function=sigmoid", "expert_auxiliary_loss_coefficient=0",
                    "first_dense_layers=1", "dense_ffn_hidden_size=40", "head_groups=4",
                    "mixer={type: latent_attention, q_lora_rank: 12, kv_lora_rank: 10, qk_head_dim: 6, "
                    "qk_pos_emb_head_dim: 4, v_head_dim: 8}"],
}  # fmt: skip

NORM_VARIANTS = {
    "qk-norm-per-head": ["query_norm={type: rms_norm}", "key_norm={type: rms_norm}"],
    "qk-layer-norm-per-head": ["query_norm={type: layer_norm}", "key_norm={type: layer_norm}"],
    "qk-norm-over-projection": ["query_norm={}", "key_norm={}", "head_groups=2",
                                "query_key_norm_scope=projection"],
    "key-norm-alone": ["key_norm={}"],
    "post-norms": ["normalization_placement=post"],
    "sandwich-norms": ["normalization_placement=sandwich"],
}  # fmt: skip


def config_of(example: str, overrides: list[str]) -> TrainerConfig:
    return load_config(TrainerConfig, [ROOT / "examples" / f"{example}.yaml"], overrides)


def sizes(config: TrainerConfig) -> tuple[int, int]:
    """(parameters, those a token does not use) of the model the config builds."""
    with torch.device("meta"):
        model = GPTModel(config.model.base_model)
    unused = 0
    for module in model.modules():
        if isinstance(module, MixtureOfExperts):
            routed = module.layer_1.numel() + module.layer_2.numel()
            unused += routed * (module.num_experts - module.top_k) // module.num_experts
    return sum(p.numel() for p in model.parameters()), unused


@pytest.mark.parametrize("example", sorted(p.stem for p in (ROOT / "examples").glob("*.yaml")))
def test_num_parameters_is_the_size_of_every_example_model(example: str) -> None:
    config = config_of(example, [])
    with torch.device("meta"):
        model = GPTModel(config.model.base_model)
    total = sum(p.numel() for p in model.parameters())
    assert config.model.base_model.num_parameters() == total


@pytest.mark.parametrize("variant", sorted(MOE_VARIANTS))
def test_num_parameters_counts_all_and_active_experts(variant: str) -> None:
    overrides = [f"model.base_model.transformer.{o}" for o in MOE_VARIANTS[variant]]
    config = config_of("tiny", SMALL + overrides)
    total, unused = sizes(config)
    base = config.model.base_model
    assert base.num_parameters() == total
    assert base.num_parameters(active=True) == total - unused > 0
    assert unused > 0


@pytest.mark.parametrize("variant", sorted(NORM_VARIANTS))
def test_num_parameters_counts_every_norm(variant: str) -> None:
    overrides = [f"model.base_model.transformer.{o}" for o in NORM_VARIANTS[variant]]
    config = config_of("tiny", SMALL + overrides)
    assert config.model.base_model.num_parameters() == sizes(config)[0]


@pytest.mark.parametrize("scope", ["head", "projection"])
def test_flops_per_token_count_a_query_key_norm_over_every_head(scope: str) -> None:
    """A norm counts 6 FLOPs per element it scales, as the block's norms do per hidden
    element: per head, its one weight of a head's size scales all heads."""

    def flops(*overrides: str) -> float:
        transformer = ["head_groups=2", *overrides]
        config = config_of(
            "tiny", [*SMALL, *(f"model.base_model.transformer.{o}" for o in transformer)]
        )
        return flops_per_token(config.model.base_model, 64)

    norms = ("query_norm={}", "key_norm={}", f"query_key_norm_scope={scope}")
    layers, heads, head_groups, kv_channels = 2, 4, 2, 8
    assert flops(*norms) - flops() == 6 * layers * (heads + head_groups) * kv_channels


def test_flops_per_token_count_only_the_routed_experts() -> None:
    def flops(experts: int) -> float:
        overrides = [
            f"model.base_model.transformer.{o}" for o in MOE_VARIANTS["moe-gated-qkv-biases"]
        ]
        config = config_of(
            "tiny", [*SMALL, *overrides, f"model.base_model.transformer.num_experts={experts}"]
        )
        return flops_per_token(config.model.base_model, 64)

    # More experts at the same top-k cost only their wider router: 6 FLOPs per weight.
    assert flops(8) - flops(2) == 6 * 2 * 32 * (8 - 2)


def test_flops_per_token_count_a_sliding_blocks_attention_over_its_window() -> None:
    """Each query of a sliding block attends to the window's keys where the sequence is
    longer; the global blocks of global_attention_interval to the whole sequence."""

    def flops(sequence: int, *overrides: str) -> float:
        transformer = [f"model.base_model.transformer.{o}" for o in overrides]
        return flops_per_token(config_of("tiny", [*SMALL, *transformer]).model.base_model, sequence)

    heads, kv_channels = 4, 8
    one_layer = 12 * heads * kv_channels
    # Two blocks, the second global: the first attends to 16 keys of 64.
    window = ("window_size=16", "global_attention_interval=2")
    assert flops(64) - flops(64, *window) == one_layer * (64 - 16)
    assert flops(64) - flops(64, "window_size=16") == 2 * one_layer * (64 - 16)
    assert flops(12, *window) == flops(12)  # a window longer than the sequence


def test_expert_biases_are_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="add_linear_biases"):
        config_of("tiny", [*SMALL, "model.base_model.transformer.num_experts=4"])


def test_flops_per_token_count_latent_attention_as_a_token_computes_it() -> None:
    """Each of latent attention's projections multiplies once per token: 6 FLOPs per weight
    and per latent norm element; attention 6 × heads × (query + value head size) per key."""
    overrides = [f"model.base_model.transformer.{o}" for o in MOE_VARIANTS["deepseek-v3"]]
    config = config_of("tiny", [*SMALL, *overrides])
    base = config.model.base_model
    with torch.device("meta"):
        model = GPTModel(base)
    attention = model.layers[0].attention
    weights = sum(p.numel() for p in attention.parameters())
    dense_mlp = sum(p.numel() for p in model.layers[0].mlp.parameters())
    routed = model.layers[1].mlp
    active_mlp = (
        routed.router.weight.numel()
        + routed.expert_bias.numel()
        + sum(p.numel() for p in routed.shared.parameters())
        + (routed.layer_1.numel() + routed.layer_2.numel()) * 2 // 8
    )
    norms = 2 * 2 * (2 * 32) + 2 * 32  # the blocks' layer norms and the final one
    sequence = 64
    expected = 6 * (
        2 * weights + dense_mlp + active_mlp + norms + 61 * 32
    ) + 2 * 6 * 4 * sequence * ((6 + 4) + 8)
    assert flops_per_token(base, sequence) == expected
