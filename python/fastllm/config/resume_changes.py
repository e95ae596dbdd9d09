"""What a resumed run changed in the config its checkpoint was written with.

A checkpoint's manifest holds the config of the run that wrote it. Its tensors mean nothing in
a model of other shapes, so a resume that changes a key of `model.base_model` that shapes them
is refused, naming each such key with both values (`architecture_changes`, checked by
`checkpoint.compatibility`). Resuming with another learning rate, data, seed or any other key
of the model silently continues a different experiment, so the loader warns, in one line,
about every changed key outside those a resume may change: the length of the run, logging,
checkpoint/export/validation/evaluation/profiling settings and held-out data, where files go,
and how the work is laid out (tensor, sequence and pipeline parallelism, ZeRO stage, stages,
recomputation, micro-batches, compilation, prefetch). Of `training.phases`, only the phases
that began before the checkpoint's step count: those after it (a phase planned, moved or
dropped) are what the run has still to train."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fastllm.config.overrides import format_key

ARCHITECTURE = "model.base_model"
"""The section that describes the model, whose keys shape a checkpoint's tensors."""

MAY_CHANGE_ON_RESUME = (
    "run",
    "training.train_iters",
    "training.logs",
    "training.checkpoint",
    "training.export",
    "training.validation",
    "training.evaluators",
    "training.profile",
    "training.compile",
    "model.multi_stage",
    "model.freeze",  # any change is refused before (training.state), never warned about
    "model.distributed.tensor_parallel",
    "model.distributed.sequence_tensor_parallel",
    "model.distributed.pipeline_parallel",
    "batch.micro_batch_size",
    "schedule",
    "data.cache_dir",
    "data.prefetch",
    "data.validation_path",
    "data.datasets",
)
"""Keys (and sections) a resumed run may set differently without a warning."""


@dataclass(frozen=True)
class Change:
    """A key whose value differs; `None` for a side where the key is not set at all."""

    key: str
    saved: Any
    new: Any

    def values(self) -> str:
        return f"checkpoint {_show(self.saved)}, config {_show(self.new)}"

    def describe(self) -> str:
        return f"{self.key}: {self.values()}"


def architecture_changes(saved: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """Every key of two `model.base_model` sections (as `msgspec.to_builtins` gives them) whose
    values differ, by full key, with both values, in the order of the config's fields (a key
    before those whose defaults derive from it: `hidden_size` before `kv_channels`)."""
    changes: list[Change] = []
    key: list[str | int] = [*ARCHITECTURE.split(".")]
    _compare(saved, new, key, changes)
    return changes


def changed_keys(saved: dict[str, Any], new: dict[str, Any], step: int) -> list[str]:
    """The full keys whose values differ between two configs (as `msgspec.to_builtins` gives
    them) of a run resumed after `step` steps, except those under `MAY_CHANGE_ON_RESUME` and
    those of the phases that begin after `step`; a section present in one config only counts
    as one key."""
    changes: list[Change] = []
    _compare(_begun(saved, step), _begun(new, step), [], changes)
    return sorted(change.key for change in changes if not _may_change(change.key))


def resume_warning(saved: dict[str, Any], new: dict[str, Any], step: int) -> str | None:
    """The one-line warning for a resume after `step` steps whose config differs in keys that
    may not change."""
    keys = changed_keys(saved, new, step)
    if not keys:
        return None
    return (
        "resuming with a config that differs from the checkpoint's in "
        f"{', '.join(keys)} (the checkpoint's values are in its manifest.json)"
    )


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    return value if isinstance(value, str) else json.dumps(value)


def _compare(saved: Any, new: Any, key: list[str | int], changes: list[Change]) -> None:
    if isinstance(saved, dict) and isinstance(new, dict):
        for name in [*saved, *(name for name in new if name not in saved)]:
            _compare(saved.get(name), new.get(name), [*key, name], changes)
    elif saved != new:
        changes.append(Change(format_key(key), saved, new))


def _begun(config: dict[str, Any], step: int) -> dict[str, Any]:
    """`config` with its `training.phases` cut to those that began before `step`, by index."""
    training = config.get("training")
    if not isinstance(training, dict):
        return config
    phases = training.get("phases") or []  # none in the configs of checkpoints before phases
    begun = {
        i: phase
        for i, phase in enumerate(phases)
        if not isinstance(phase, dict) or phase.get("begin_step", 0) < step
    }
    return {**config, "training": {**training, "phases": begun}}


def _may_change(key: str) -> bool:
    return any(key == allowed or key.startswith(allowed + ".") for allowed in MAY_CHANGE_ON_RESUME)
