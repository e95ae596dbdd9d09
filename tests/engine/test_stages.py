"""Stage arithmetic, and the stages the engine builds from it: each holds the buffers of
exactly the parameters its model positions run."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from fastllm.config.layout import num_stages, pipeline_rank_of, pipeline_stages
from fastllm.engine.model_stages import ModelStages
from fastllm.engine.stages import slot, stage_of_layer, stage_positions
from fastllm.model import GPTModel
from tests.engine.test_stage_buffers import tiny_config


@pytest.mark.parametrize(
    ("num_layers", "layers_per_stage"),
    [(1, 1), (4, 1), (5, 2), (6, 3), (3, Fraction(3, 2)), (5, Fraction(5, 4)), (7, Fraction(7, 3))],
)
def test_each_model_position_is_in_the_one_stage_whose_positions_span_it(
    num_layers: int, layers_per_stage: int | Fraction
) -> None:
    stages = num_stages(num_layers, layers_per_stage)
    spans = [stage_positions(s, num_layers, layers_per_stage) for s in range(stages)]
    covered = [p for first, last in spans for p in range(first, last + 1)]
    assert covered == list(range(num_layers + 2))  # the embedding … the head, once each
    for stage, (first, last) in enumerate(spans):
        for position in range(first, last + 1):
            assert stage_of_layer(position, num_layers, layers_per_stage) == stage


def test_a_reference_models_blocks_spread_over_the_trained_models_stages() -> None:
    # Seven blocks over three stages: 3, 2 and 2 of them, the embedding with the first and the
    # head with the last.
    spread = Fraction(7, 3)
    assert num_stages(7, spread) == 3
    assert [stage_positions(s, 7, spread) for s in range(3)] == [(0, 3), (4, 5), (6, 8)]


def test_pipeline_ranks_share_the_stages_in_turn_and_alternate_their_slots() -> None:
    runs = [pipeline_stages(7, 3, rank) for rank in range(3)]
    assert runs == [[0, 3, 6], [1, 4], [2, 5]]
    assert all(pipeline_rank_of(s, 3) == rank for rank, mine in enumerate(runs) for s in mine)
    # A rank's consecutive stages use the two buffers in turn.
    assert [slot(s, 3) for s in runs[0]] == [0, 1, 0]


def test_a_stage_holds_the_views_of_the_parameters_its_positions_run() -> None:
    config = tiny_config("model.base_model.transformer.num_layers=3")
    with torch.device("meta"):
        model = GPTModel(config.model.base_model)
    stages = ModelStages(
        model, compute_dtype=torch.float32, device=torch.device("cpu"), layers_per_stage=2
    )
    positions = model.layer_modules()
    assert [stage.positions for stage in stages.stages] == [(0, 2), (3, 4)]
    for stage in stages.stages:
        first, last = stage.positions
        expected = {
            id(p)
            for modules in positions[first : last + 1]
            for module in modules
            for p in module.parameters()
        }
        (buffer,) = stage.buffers  # no expert parallelism: one group
        assert {id(view) for view in buffer.views.values()} == expected
        for view in buffer.views.values():
            assert view.untyped_storage().data_ptr() == buffer.weights.untyped_storage().data_ptr()
