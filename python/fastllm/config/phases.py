"""`training.phases` resolved: which blend each step of a run reads, and the checks that span
the phases and `data`.

The run's first phase trains on `data.path` (with `data.weights`) from `model.distributed.seed`;
each phase of `training.phases` that sets `data` begins a new blend at its `begin_step`, drawn
from a seed of its own, so the samples of a phase depend on its datasets, weights, seed and
length only: never on where the run was stopped and resumed. Phases that set no `data` go on
with the blend before them."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastllm.config.section import ConfigError

if TYPE_CHECKING:
    from fastllm.config.trainer import TrainerConfig


@dataclass(frozen=True)
class DataPhase:
    """Steps `begin_step` + 1 … `end_step` (as logged) read one blend: sample i of this phase's
    stream is the i-th it trains on."""

    begin_step: int
    end_step: int
    key: str
    """The config key of `path` (data.path, or training.phases[i].data.path)."""
    path: list[str]
    weights: list[float] | None
    seed: int


def phase_seed(seed: int, begin_step: int) -> int:
    """The sampling seed of a phase that begins after `begin_step` steps of a run seeded with
    `seed` (a 64-bit draw from both: another shuffle than the phases before)."""
    digest = hashlib.blake2b(f"{seed}/{begin_step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def data_phases(config: TrainerConfig) -> list[DataPhase]:
    """The blends of the run in order, each to the next phase that sets `data` (or the end of
    training)."""
    data, seed = config.data, config.model.distributed.seed
    begins = [(0, "data.path", data.path, data.weights, seed)]
    for i, phase in enumerate(config.training.phases):
        if phase.data is None:
            continue
        _, key, path, _, _ = begins[-1]  # with no path of its own: the blend before, reweighted
        if phase.data.path is not None:
            key, path = f"training.phases[{i}].data.path", phase.data.path
        begin = phase.begin_step
        begins.append((begin, key, path, phase.data.weights, phase_seed(seed, begin)))
    ends = [begin for begin, *_ in begins[1:]] + [config.training.train_iters]
    return [
        DataPhase(begin, end, key, path, weights, seed)
        for (begin, key, path, weights, seed), end in zip(begins, ends, strict=True)
    ]


def check_phases(config: TrainerConfig) -> None:
    """A phase that weights the datasets of the phase before gives a weight to each; a run
    on a data source (`data.source`) has no blend for a phase to switch."""
    for i, phase in enumerate(config.training.phases):
        if phase.data is not None and config.data.source is not None:
            raise ConfigError(
                f"training.phases[{i}].data",
                "switching the data of a run on data.source is not supported yet",
            )
        if phase.data is None or phase.data.weights is None or phase.data.path is not None:
            continue
        (blend,) = [p for p in data_phases(config) if p.begin_step == phase.begin_step]
        if len(phase.data.weights) != len(blend.path):
            raise ConfigError(
                f"training.phases[{i}].data.weights",
                f"has {len(phase.data.weights)} entries but the datasets of the phase before "
                f"({blend.key}) are {len(blend.path)}",
            )
