"""What a resumed run changed in the config its checkpoint was written with.

A checkpoint's manifest holds the config of the run that wrote it. Resuming with another
learning rate, model, data or seed silently continues a different experiment, so the loader
warns, in one line, about every changed key outside those a resume may change: the length of
the run, logging, checkpoint/export/validation/profiling intervals, where files go, and how the
work is laid out (tensor, sequence and pipeline parallelism, ZeRO stage, stages, recomputation,
micro-batches, compilation, prefetch)."""

from __future__ import annotations

from typing import Any

from fastllm.config.overrides import format_key

MAY_CHANGE_ON_RESUME = (
    "run",
    "training.train_iters",
    "training.logs",
    "training.checkpoint",
    "training.export",
    "training.validation",
    "training.profile",
    "training.compile",
    "model.multi_stage",
    "model.distributed.tensor_parallel",
    "model.distributed.sequence_tensor_parallel",
    "model.distributed.pipeline_parallel",
    "batch.micro_batch_size",
    "schedule",
    "data.cache_dir",
    "data.prefetch",
    "data.validation_path",
)
"""Keys (and sections) a resumed run may set differently without a warning."""


def changed_keys(saved: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The full keys whose values differ between two configs (as `msgspec.to_builtins` gives
    them), except those under `MAY_CHANGE_ON_RESUME`; a section present in one config only
    counts as one key."""
    changes: list[str] = []
    _compare(saved, new, [], changes)
    return [key for key in changes if not _may_change(key)]


def resume_warning(saved: dict[str, Any], new: dict[str, Any]) -> str | None:
    """The one-line warning for a resume whose config differs in keys that may not change."""
    keys = changed_keys(saved, new)
    if not keys:
        return None
    return (
        "resuming with a config that differs from the checkpoint's in "
        f"{', '.join(keys)} (the checkpoint's values are in its manifest.json)"
    )


def _compare(saved: Any, new: Any, key: list[str | int], changes: list[str]) -> None:
    if isinstance(saved, dict) and isinstance(new, dict):
        for name in sorted(saved.keys() | new.keys(), key=str):
            if name not in saved or name not in new:
                changes.append(format_key([*key, name]))
            else:
                _compare(saved[name], new[name], [*key, name], changes)
    elif saved != new:
        changes.append(format_key(key))


def _may_change(key: str) -> bool:
    return any(key == allowed or key.startswith(allowed + ".") for allowed in MAY_CHANGE_ON_RESUME)
