"""Whether saved weights fit the model a run builds, checked before any of them is loaded and
before the run writes anything: the same tensor names and whole shapes and, for a resume, the
same architecture (every key of `model.base_model`). A mismatch is a `ConfigError` naming the
config keys to blame with both values (`model.base_model.transformer.ffn_hidden_size:
checkpoint 512, config 256`), or, where no key explains it, a tensor and both shapes. Every
rank checks the same files against the same config, so under torchrun they all refuse
together, before any collective."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
from torch import Tensor

from fastllm.checkpoint.distributed import SavedCheckpoint
from fastllm.checkpoint.formats import ModelSource, parameter_shapes
from fastllm.config import BaseModelConfig, ConfigError, build
from fastllm.config.overrides import parse_key
from fastllm.config.resume_changes import ARCHITECTURE, Change, architecture_changes

Shapes = dict[str, tuple[int, ...]]


def check_resume(saved: SavedCheckpoint, config: BaseModelConfig) -> None:
    """A checkpoint resumes only into the model that wrote it: any changed key of
    `model.base_model` is refused, then any tensor whose name or whole shape differs."""
    changes = architecture_changes(_saved_architecture(saved), msgspec.to_builtins(config))
    if changes:
        raise _refusal(
            changes,
            f"a resume keeps the architecture of {saved.directory}: set it back, or train in "
            "another run.experiment_dir",
        )
    _check_tensors(saved.whole_shapes(), parameter_shapes(config), str(saved.directory))


def pretrained_tensors(
    source: ModelSource, config: BaseModelConfig
) -> Iterator[tuple[str, Tensor]]:
    """The tensors of `source` for a model of `config`, checked first: the architecture may
    differ where the shapes do not (rotary scaling, window, …); a shape that differs is
    refused, naming the keys of `model.base_model` that make it differ."""
    expected = parameter_shapes(config)
    found = (
        source.distributed.whole_shapes()
        if source.distributed is not None
        else parameter_shapes(source.config)
    )
    where = str(source.directory)
    if found != expected:
        changes = architecture_changes(
            msgspec.to_builtins(source.config), msgspec.to_builtins(config)
        )
        if blamed := [change for change in changes if _shapes_depend_on(change, config, expected)]:
            raise _refusal(blamed, f"pretrained.path {where} holds a model of other shapes")
        _check_tensors(found, expected, where)
    return _of_expected_shapes(source.tensors(), expected, where)


def _saved_architecture(saved: SavedCheckpoint) -> dict[str, Any]:
    """The checkpoint's `model.base_model` as today's config fills it (defaults of keys added
    since it was written); as written if it no longer builds."""
    try:
        return msgspec.to_builtins(saved.model_config())
    except ConfigError:
        return saved.manifest["config"]["model"]["base_model"]


def _shapes_depend_on(change: Change, config: BaseModelConfig, expected: Shapes) -> bool:
    """Whether `config` with the checkpoint's value of this one key has other tensors (a key
    that makes no valid config alone is not blamed: the tensors are named instead)."""
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
        return parameter_shapes(build(BaseModelConfig, raw)) != expected
    except ConfigError:
        return False


def _refusal(changes: list[Change], what: str) -> ConfigError:
    first, *others = changes
    also = "".join(f"; {change.describe()}" for change in others)
    return ConfigError(first.key, f"{first.values()}{also} ({what})")


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


def _of_expected_shapes(
    tensors: Iterator[tuple[str, Tensor]], expected: Shapes, where: str
) -> Iterator[tuple[str, Tensor]]:
    """The tensors as they are read, each checked (a file that does not match its own
    config)."""
    for name, tensor in tensors:
        shape = tuple(tensor.shape)
        if name in expected and shape != expected[name]:
            raise ConfigError(
                where, f"{name}: checkpoint {list(shape)}, model {list(expected[name])}"
            )
        yield name, tensor
