"""The `schedule` section: how a step's micro-batches split into breadth- and depth-first
ones, and the errors that name the keys."""

from __future__ import annotations

import pytest

from fastllm.config import ConfigError, TrainerConfig, load_config
from fastllm.config.schedule import ScheduleConfig


@pytest.mark.parametrize(
    ("breadth", "depth", "expected"),
    [(None, None, (1, 8)), (4, None, (4, 2)), (None, 4, (2, 4)), (2, 4, (2, 4))],
)
def test_micro_batches_follow_from_the_batch_when_left_unset(
    breadth: int | None, depth: int | None, expected: tuple[int, int]
) -> None:
    schedule = ScheduleConfig(breadth_first_micro_batches=breadth, depth_first_micro_batches=depth)
    assert schedule.micro_batches(per_rank=16, micro_batch_size=2) == expected


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["schedule.breadth_first_micro_batches=3"], "schedule.breadth_first_micro_batches"),
        (["schedule.depth_first_micro_batches=5"], "schedule.depth_first_micro_batches"),
        (
            ["schedule.breadth_first_micro_batches=2", "schedule.depth_first_micro_batches=3"],
            "schedule",
        ),
    ],
)
def test_micro_batches_that_do_not_fit_the_batch_name_their_keys(
    overrides: list[str], key: str
) -> None:
    config = load_config(TrainerConfig, [], ["batch.batch_size=8", "batch.micro_batch_size=2"])
    schedule = load_config(TrainerConfig, [], overrides).schedule
    with pytest.raises(ConfigError) as error:
        schedule.micro_batches(config.batch.batch_size, 2)
    assert error.value.path == key


def test_more_pipeline_ranks_than_stages_is_refused() -> None:
    overrides = [
        "model.base_model.transformer.num_layers=4",
        "model.multi_stage.layers_per_stage=2",
    ]
    with pytest.raises(
        ConfigError, match="pipeline_parallel: \\(3\\) is more than the model's stages \\(2"
    ):
        load_config(TrainerConfig, [], [*overrides, "model.distributed.pipeline_parallel=3"])
    load_config(TrainerConfig, [], [*overrides, "model.distributed.pipeline_parallel=2"])
