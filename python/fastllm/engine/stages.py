"""Stage arithmetic: which model positions form a stage, which pipeline rank runs it, and which
stages' weights running one reads.

A stage is `layers_per_stage` blocks (the embedding joins the first, the final norm and the
head the last; a fraction spreads a reference model's blocks over the trained model's
stages): the unit of buffer layout, of data-parallel communication (one reduce-scatter, one
ZeRO-3 all-gather) and of pipeline placement (`config.layout.pipeline_rank_of`)."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING

from fastllm.config.layout import num_stages

if TYPE_CHECKING:  # the arithmetic imports no torch: the pipeline simulator (`fastllm --help`)
    import torch

    from fastllm.model import GPTModel


def stage_of_layer(layer: int, num_layers: int, layers_per_stage: int | Fraction = 1) -> int:
    """Model position `layer` (0 the embedding, 1 … num_layers the blocks, num_layers + 1 the
    final norm and the head): `layers_per_stage` blocks per stage (a fraction: block i on
    stage ⌊i / layers_per_stage⌋), the embedding with the first, the head with the last."""
    last = num_stages(num_layers, layers_per_stage) - 1
    return min(max(layer - 1, 0) // layers_per_stage, last)


def stage_positions(
    stage: int, num_layers: int, layers_per_stage: int | Fraction = 1
) -> tuple[int, int]:
    """The first and last model positions of `stage` (what `GPTModel.run_positions` takes)."""
    first = 0 if stage == 0 else math.ceil(stage * layers_per_stage) + 1
    last = min(math.ceil((stage + 1) * layers_per_stage), num_layers)
    if stage_of_layer(num_layers + 1, num_layers, layers_per_stage) == stage:
        last = num_layers + 1
    return first, last


def stage_modules(model: GPTModel, layers_per_stage: int | Fraction) -> list[list[torch.nn.Module]]:
    """The modules each stage's forward pass runs, in order (the head's weight is read by the
    loss after the final norm)."""
    positions = model.layer_modules()
    num_layers = len(positions) - 2
    stages: list[list[torch.nn.Module]] = []
    for layer, modules in enumerate(positions):
        stage = stage_of_layer(layer, num_layers, layers_per_stage)
        if stage == len(stages):
            stages.append([])
        stages[stage] += modules
    return stages


def slot(stage: int, pipeline_size: int) -> int:
    """Which of two buffers `stage` uses where the consecutive stages of one pipeline rank
    alternate (pooled ZeRO-2 gradients, reduce-scatter outputs)."""
    return (stage // pipeline_size) % 2


def stages_read(stage: int, num_stages: int, tied_here: bool) -> set[int]:
    """The stages whose weights running `stage` reads: itself, and for a head tied to the
    embedding on the same rank (`tied_here`) stage 0 too; a head on another rank than the
    embedding reads a copy of its own."""
    return {stage, 0} if tied_here and stage == num_stages - 1 else {stage}
