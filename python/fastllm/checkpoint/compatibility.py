"""Whether saved weights fit the model a run builds, checked before any of them is loaded and
before the run writes anything: the same tensor names and whole shapes, and values of a
floating-point dtype (fp32 for a checkpoint's state, any float for weights to convert). A mismatch is a
`ConfigError` naming the keys of `model.base_model` that shape the tensors differently, each
with both values (`model.base_model.transformer.ffn_hidden_size: checkpoint 512, config 256`),
or, where no key explains it, a tensor and both shapes. (Keys that leave the tensors as they
are, such as the rotary scaling or the window, may change: a resume warns of them with the
other changed keys.) Every rank checks the same files against the same config, so under
torchrun they all refuse together, before any collective."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Any

import msgspec
from torch import Tensor

from fastllm.checkpoint.distributed import SavedCheckpoint
from fastllm.checkpoint.formats import ModelSource, parameter_shapes
from fastllm.config import BaseModelConfig, ConfigError, build
from fastllm.config.overrides import parse_key
from fastllm.config.resume_changes import ARCHITECTURE, Change, architecture_changes
from fastllm.model.lora import is_adapter

Shapes = dict[str, tuple[int, ...]]


def check_resume(
    saved: SavedCheckpoint, config: BaseModelConfig, frozen: Collection[str] = ()
) -> None:
    """A checkpoint resumes only into a model of its tensors: those of `config`'s model but
    the `frozen` ones, which checkpoints do not hold."""
    where = str(saved.directory)
    saved.check_dtypes()
    _check_fits(
        saved.whole_shapes(),
        _saved_architecture(saved),
        config,
        where,
        f"a resume keeps the tensors of {where}: set it back, or train in another "
        "run.experiment_dir",
        omit=frozenset(frozen),
    )


def pretrained_tensors(
    source: ModelSource, config: BaseModelConfig
) -> tuple[Iterator[tuple[str, Tensor]], list[str]]:
    """The tensors of `source` for a model of `config`, and the names of the model's LoRA
    adapters it lacks (all of them, or none: a base model to fine-tune with new adapters, or
    a model with its adapters). Its config's tensors (the manifest's shapes for a
    `distributed` directory) must be the model's, and `source.tensors()` checks its files
    against its config before reading any."""
    found = (
        source.distributed.whole_shapes()
        if source.distributed is not None
        else parameter_shapes(source.config)
    )
    adapters = [name for name in parameter_shapes(config) if is_adapter(name)]
    missing = [] if any(name in found for name in adapters) else adapters
    where = str(source.directory)
    _check_fits(
        found,
        msgspec.to_builtins(source.config),
        config,
        where,
        f"pretrained.path {where} holds tensors of other shapes",
        omit=frozenset(missing),
    )
    return source.tensors(), missing


def _check_fits(
    found: Shapes,
    saved: dict[str, Any],
    config: BaseModelConfig,
    where: str,
    what: str,
    omit: frozenset[str] = frozenset(),
) -> Shapes:
    """The tensors of `config`'s model, when they are those `found` in `where`; else the
    refusal naming the changed keys of the saved architecture `saved` that shape them (all
    changed keys when no one alone does; `what` says why they cannot change), or the first
    tensor that differs. `omit`: tensors `config`'s model has that `found` need not."""
    expected = {n: s for n, s in parameter_shapes(config).items() if n not in omit}
    if found == expected:
        return expected
    changes = architecture_changes(saved, msgspec.to_builtins(config))
    if changes:
        depend = [c for c in changes if _shapes_depend_on(c, config, expected, omit)]
        first, *others = depend or changes
        also = "".join(f"; {change.describe()}" for change in others)
        raise ConfigError(first.key, f"{first.values()}{also} ({what})")
    _check_tensors(found, expected, where)
    return expected


def _saved_architecture(saved: SavedCheckpoint) -> dict[str, Any]:
    """The checkpoint's `model.base_model` as today's config fills it (defaults of keys added
    since it was written); as written if it no longer builds."""
    try:
        return msgspec.to_builtins(saved.model_config())
    except ConfigError:
        return saved.manifest["config"]["model"]["base_model"]


def _shapes_depend_on(
    change: Change, config: BaseModelConfig, expected: Shapes, omit: frozenset[str]
) -> bool:
    """Whether `config` with the checkpoint's value of this one key has other tensors (not
    when that makes no valid config: such a key is blamed only with all the others)."""
    raw = msgspec.to_builtins(config)
    *parents, last = parse_key(change.key)[len(ARCHITECTURE.split(".")) :]
    section = raw
    for name in parents:
        section = section.setdefault(name, {})
    if change.saved is None:
        section.pop(last, None)
    else:
        section[last] = change.saved
    try:
        shapes = parameter_shapes(build(BaseModelConfig, raw))
        return {n: s for n, s in shapes.items() if n not in omit} != expected
    except ConfigError:
        return False


def _check_tensors(found: Shapes, expected: Shapes, where: str) -> None:
    for what, names in (
        ("lacks the model's tensors", sorted(expected.keys() - found.keys())),
        ("holds tensors the model lacks", sorted(found.keys() - expected.keys())),
    ):
        if names:
            raise ConfigError(
                where, f"{what}: {', '.join(names[:5])}{' …' if len(names) > 5 else ''}"
            )
    for name, shape in expected.items():
        if found[name] != shape:
            raise ConfigError(where, f"{name}: checkpoint {list(found[name])}, model {list(shape)}")
