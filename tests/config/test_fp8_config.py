from __future__ import annotations

import pytest

from fastllm.config import ConfigError, TrainerConfig, load_config

FP8 = ("model.distributed.fp8_linear=rowwise", "model.distributed.training_dtype=bfloat16")


@pytest.mark.parametrize(
    ("overrides", "path", "fragment"),
    [
        (
            ("model.distributed.fp8_linear=tensorwise",),
            "model.distributed.fp8_linear",
            "needs model.distributed.training_dtype bfloat16, got float32",
        ),
        (
            (*FP8, "model.distributed.tensor_parallel=2"),
            "model.distributed.fp8_linear",
            "model.distributed.tensor_parallel > 1",
        ),
        ((*FP8, "training.compile=true"), "training.compile", "fp8_linear=rowwise"),
        (
            (*FP8, "model.distributed.fp8_scaling=delayed"),
            "model.distributed.fp8_scaling",
            "needs fp8_linear=tensorwise, got fp8_linear=rowwise",
        ),
        (
            ("model.distributed.fp8_amax_history_length=0",),
            "model.distributed.fp8_amax_history_length",
            "must be positive",
        ),
        (
            ("model.distributed.fp8_linear=blockwise",),
            "model.distributed.fp8_linear",
            "expected one of none, tensorwise, rowwise",
        ),
    ],
)
def test_unsupported_fp8_combinations_are_refused_naming_the_keys(
    overrides: tuple[str, ...], path: str, fragment: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(TrainerConfig, overrides=list(overrides))
    assert caught.value.path == path
    assert fragment in caught.value.message


def test_fp8_with_bf16_validates() -> None:
    config = load_config(TrainerConfig, overrides=list(FP8))
    assert config.model.distributed.fp8_linear == "rowwise"
    config = load_config(TrainerConfig, overrides=[*FP8, "model.multi_stage.zero_stage=3"])
    assert config.model.multi_stage.zero_stage == 3
    for layout in ("pipeline_parallel", "sequence_data_parallel"):
        config = load_config(TrainerConfig, overrides=[*FP8, f"model.distributed.{layout}=2"])
        assert getattr(config.model.distributed, layout) == 2
