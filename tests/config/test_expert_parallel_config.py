from __future__ import annotations

import pytest

from fastllm.config import ConfigError, TrainerConfig, load_config

MOE = (
    "model.base_model.transformer.num_experts=4",
    "model.base_model.transformer.num_experts_per_token=2",
    "model.base_model.transformer.add_linear_biases=only_attn_qkv",
)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (("model.distributed.expert_parallel=2",), "must divide model.base_model.transformer"),
        ((*MOE, "model.distributed.expert_parallel=3"), "num_experts (4)"),
        ((*MOE, "model.distributed.expert_parallel=0"), "must be positive"),
    ],
)
def test_unsupported_expert_parallel_settings_are_refused_naming_the_keys(
    overrides: tuple[str, ...], fragment: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(TrainerConfig, overrides=list(overrides))
    assert caught.value.path == "model.distributed.expert_parallel"
    assert fragment in caught.value.message


def test_expert_parallel_must_divide_the_data_parallel_size() -> None:
    config = load_config(TrainerConfig, overrides=[*MOE, "model.distributed.expert_parallel=4"])
    with pytest.raises(ConfigError) as caught:
        config.model.distributed.data_parallel(2)
    assert caught.value.path == "model.distributed.expert_parallel"
    assert "data-parallel size (2" in caught.value.message
    assert config.model.distributed.data_parallel(8) == 8
