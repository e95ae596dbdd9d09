from __future__ import annotations

import pytest

from fastllm.config import ConfigError, TrainerConfig, load_config
from fastllm.config.layout import resolve

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
    overrides = [*MOE, "model.distributed.expert_parallel=4", "batch.batch_size=8"]
    config = load_config(TrainerConfig, overrides=overrides)
    with pytest.raises(ConfigError) as caught:
        resolve(config, 2)
    assert caught.value.path == "model.distributed.expert_parallel"
    assert "data-parallel size (2" in caught.value.message
    assert resolve(config, 8).data == 8
