"""A training config whose `training.export.format` cannot express its model is refused when it
is loaded, not at the first export of the run."""

from __future__ import annotations

import pytest

from fastllm.config import ConfigError, TrainerConfig, load_config
from tests.conftest import ROOT

MOE = (
    "model.base_model.transformer.num_experts=4",
    "model.base_model.transformer.num_experts_per_token=2",
)


@pytest.mark.parametrize(
    ("example", "overrides", "export", "reason"),
    [
        ("mixtral-8x7b", (), "llama", "num_experts is 8 (llama has no experts)"),
        ("llama3-8b", (), "mixtral", "num_experts is 1 (mixtral has experts)"),
        ("tiny", (), "mistral", "normalization.type is 'layer_norm' (mistral has rms_norm)"),
        ("mistral-7b", (), "llama", "window_size is 4096 (llama has no sliding window)"),
        ("mistral-7b", (), "starcoder2", "normalization.type is 'rms_norm'"),
        (
            "llama3-8b",
            ("model.base_model.transformer.rotary={type: none}",),
            "llama",
            "rotary.type",
        ),
        (
            "qwen2-7b",
            ("model.base_model.transformer.add_linear_biases=true",),
            "qwen2",
            "add_linear_biases is True (qwen2 has biases only_attn_qkv)",
        ),
        (
            "mixtral-8x7b",
            ("model.base_model.transformer.expert_renormalize=false",),
            "mixtral",
            "expert_renormalize is False",
        ),
        ("mixtral-8x7b", (), "qwen2_moe", "num_shared_experts is 0 (qwen2_moe has shared"),
        (
            "llama3-8b",
            (*MOE, "model.base_model.transformer.num_shared_experts=1"),
            "qwen2_moe",
            "shared_expert_gate is False (qwen2_moe has gated shared experts)",
        ),
        ("qwen3-8b", (), "llama", "query_norm is 'rms_norm' (llama has no QK-norm)"),
        ("qwen3-30b-a3b", (), "qwen2_moe", "num_shared_experts is 0 (qwen2_moe has shared"),
        ("qwen3-8b", (), "gemma3_text", "normalization_placement is 'pre' (gemma3_text has"),
        (
            "gemma3-4b",
            ("model.base_model.transformer.normalization_placement=pre",),
            "qwen3",
            "normalization.zero_centered is True (qwen3 has none of Gemma's options)",
        ),
        (
            "gemma3-4b",
            ("model.base_model.transformer.key_norm.zero_centered=false",),
            "gemma3_text",
            "key_norm.zero_centered is False (gemma3_text has Gemma's options)",
        ),
        (
            "gemma3-4b",
            ("model.base_model.transformer.window_rotary={type: linear, scale_factor: 2}",),
            "gemma3_text",
            "window_rotary.type is 'linear' (gemma3_text has a plain (default) rotary in its",
        ),
        (
            "gemma3-4b",
            ("model.base_model.transformer.activation_type=silu",),
            "gemma3_text",
            "activation_type is 'silu' (gemma3_text has tanh GELU (GeGLU))",
        ),
        (
            "gemma3-4b",
            ("model.base_model.transformer.attention_scale=0.07",),
            "gemma3_text",
            "attention_scale is 0.07 (gemma3_text has n ** -0.5 for a whole n)",
        ),
        (
            "mistral-7b",
            ("model.base_model.transformer.global_attention_interval=2",),
            "mistral",
            "global_attention_interval is 2 (mistral has none of Gemma's options)",
        ),
        ("llama3-8b", (), "qwen3", "query_norm is 'none' (qwen3 has an rms_norm of the queries"),
        (
            "olmo2-7b",
            ("model.base_model.transformer.normalization_placement=pre",),
            "qwen3",
            "query_key_norm_scope is 'projection' (qwen3 has an rms_norm of the queries and of "
            "the keys over each head)",
        ),
        (
            "qwen3-8b",
            ("model.base_model.transformer.key_norm.epsilon=1e-5",),
            "qwen3",
            "key_norm.epsilon is 1e-05 (qwen3 has one epsilon, normalization.epsilon 1e-06)",
        ),
        (
            "qwen3-8b",
            ("model.base_model.transformer.normalization_placement=post",),
            "qwen3",
            "normalization_placement is 'post' (qwen3 has pre-norm blocks)",
        ),
        (
            "olmo2-7b",
            ("model.base_model.transformer.normalization_placement=sandwich",),
            "olmo2",
            "normalization_placement is 'sandwich' (olmo2 has post-norm blocks)",
        ),
    ],
)
def test_an_export_format_that_cannot_express_the_model_is_refused_when_loaded(
    example: str, overrides: tuple[str, ...], export: str, reason: str
) -> None:
    path = ROOT / "examples" / f"{example}.yaml"
    with pytest.raises(ConfigError) as refused:
        load_config(TrainerConfig, [path], [*overrides, f"training.export.format={export}"])
    assert refused.value.path == "training.export.format"
    assert refused.value.message.startswith(f"{export} cannot express the model: ")
    assert f"model.base_model.transformer.{reason}" in refused.value.message


@pytest.mark.parametrize(
    ("example", "export"),
    [
        ("llama3-8b", "llama"),
        ("mistral-7b", "mistral"),
        ("mixtral-8x7b", "mixtral"),
        ("qwen2-7b", "qwen2"),
        ("qwen3-8b", "qwen3"),
        ("olmo2-7b", "olmo2"),
        ("qwen3-30b-a3b", "qwen3_moe"),
        ("gemma3-4b", "gemma3_text"),
        ("starcoder2-3b", "starcoder2"),
        ("tiny", "starcoder2"),
        ("mixtral-8x7b", "fastllm"),
    ],
)
def test_each_example_exports_to_its_own_architecture(example: str, export: str) -> None:
    path = ROOT / "examples" / f"{example}.yaml"
    load_config(TrainerConfig, [path], [f"training.export.format={export}"])
