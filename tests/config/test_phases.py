"""`training.phases`: which blend each step reads, and the configs refused, naming the key."""

from __future__ import annotations

import re

import pytest

from fastllm.config import ConfigError, TrainerConfig, build, load_config
from fastllm.config.phases import DataPhase, data_phases, phase_seed
from fastllm.config.yaml_io import parse_yaml
from tests.conftest import ROOT


def config(*overrides: str) -> TrainerConfig:
    return load_config(
        TrainerConfig, overrides=["data.path=[a, b]", "training.train_iters=10", *overrides]
    )


def test_each_phase_that_sets_data_reads_its_blend_to_the_next_one() -> None:
    run = config(
        "data.weights=[3, 1]",
        "training.phases=[{begin_step: 4, data: {path: [c]}}, {begin_step: 6, learning_rate: {}},"
        " {begin_step: 8, data: {weights: [2]}}]",
    )
    seed = run.model.distributed.seed
    assert data_phases(run) == [
        DataPhase(0, 4, "data.path", ["a", "b"], [3.0, 1.0], seed),
        DataPhase(4, 8, "training.phases[0].data.path", ["c"], None, phase_seed(seed, 4)),
        DataPhase(8, 10, "training.phases[0].data.path", ["c"], [2.0], phase_seed(seed, 8)),
    ]
    assert len({seed, phase_seed(seed, 4), phase_seed(seed, 8), phase_seed(seed + 1, 4)}) == 4
    assert data_phases(config()) == [DataPhase(0, 10, "data.path", ["a", "b"], None, seed)]


@pytest.mark.parametrize(
    ("phases", "key", "message"),
    [
        (
            "[{begin_step: 4, data: {path: [c]}}, {begin_step: 4, learning_rate: {}}]",
            "training.phases[1].begin_step",
            "not after training.phases[0].begin_step (4)",
        ),
        (
            "[{begin_step: 6, data: {path: [c]}}, {begin_step: 3, learning_rate: {}}]",
            "training.phases[1].begin_step",
            "not after training.phases[0].begin_step (6)",
        ),
        (
            "[{begin_step: 10, learning_rate: {}}]",
            "training.phases[0].begin_step",
            "not before train_iters (10)",
        ),
        ("[{begin_step: 0, learning_rate: {}}]", "training.phases[0].begin_step", "positive"),
        ("[{begin_step: 3}]", "training.phases[0]", "neither data nor learning_rate"),
        ("[{begin_step: 3, data: {}}]", "training.phases[0].data", "neither path nor weights"),
        (
            "[{begin_step: 3, data: {weights: [1]}}]",
            "training.phases[0].data.weights",
            "1 entries but the datasets of the phase before (data.path) are 2",
        ),
        (
            "[{begin_step: 3, data: {path: [c], weights: [1, 2]}}]",
            "training.phases[0].data.weights",
            "2 entries but path has 1",
        ),
        (
            "[{begin_step: 3, data: {path: [c], weights: [0]}}]",
            "training.phases[0].data.weights[0]",
            "finite and positive",
        ),
        (
            "[{begin_step: 3, learning_rate: {base: 0.1, minimum: 0.2}}]",
            "training.phases[0].learning_rate.minimum",
            "between 0 and base",
        ),
        ("[{begin_step: 3, learning_rat: {}}]", "training.phases[0].learning_rat", "unknown"),
    ],
)
def test_a_bad_phase_is_refused_naming_its_key(phases: str, key: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        config(f"training.phases={phases}")
    assert error.value.path == key
    assert message in error.value.message


def test_the_annealing_example_of_the_data_page_loads() -> None:
    page = (ROOT / "docs" / "data.md").read_text()
    match = re.search(r"## Training phases.*?```yaml\n(.*?)```", page, re.S)
    assert match is not None
    run = build(TrainerConfig, parse_yaml(match.group(1), "docs/data.md"))
    (first, anneal) = data_phases(run)
    assert (first.path, first.end_step) == (["data/web"], 8000)
    assert (anneal.begin_step, anneal.weights) == (8000, [0.3, 0.7])
