"""A learning-rate schedule of another package (a `learning_rate` component): chosen by
`decay_style` like fastllm's, its own keys checked, its rate used after the shared warmup."""

from __future__ import annotations

import pytest

from fastllm.config import ConfigError, TrainerConfig, build
from fastllm.config.section import check_positive
from fastllm.config.training import LearningRateConfig
from fastllm.engine.learning_rate import learning_rate


class StepDecayConfig(LearningRateConfig, tag="test_step_decay"):
    """base times factor every `every` steps after the warmup."""

    implementation = "tests.engine.test_learning_rate_component:step_decay"

    factor: float = 0.5
    """What each drop multiplies the rate by."""
    every: int = 2
    """Steps between two drops."""

    def validate(self) -> None:
        super().validate()
        check_positive(self.every, "every")


def step_decay(config: StepDecayConfig, step: int, train_iters: int) -> float:
    drops = (step - config.warmup_iterations) // config.every
    return config.base * config.factor**drops


def schedule(**keys: object) -> LearningRateConfig:
    raw = {"optimizer": {"learning_rate": {"decay_style": "test_step_decay", **keys}}}
    return build(TrainerConfig, raw).optimizer.learning_rate


def test_a_schedule_of_another_package_follows_the_shared_warmup() -> None:
    config = schedule(base=1.0, warmup_iterations=2, factor=0.1)
    assert isinstance(config, StepDecayConfig)
    rates = [learning_rate(config, step, 8) for step in range(8)]
    assert rates == pytest.approx([0.5, 1.0, 1.0, 1.0, 0.1, 0.1, 0.01, 0.01])


def test_its_keys_are_checked_at_their_full_key() -> None:
    with pytest.raises(ConfigError, match=r"^optimizer\.learning_rate\.every: must be positive"):
        schedule(every=0)
    with pytest.raises(ConfigError, match=r"^optimizer\.learning_rate\.minimum: must be between"):
        schedule(base=1.0, minimum=2.0)
    with pytest.raises(ConfigError, match=r"^optimizer\.learning_rate\.decay_style: unknown type"):
        build(TrainerConfig, {"optimizer": {"learning_rate": {"decay_style": "cosin"}}})
