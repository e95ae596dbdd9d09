"""The one entry point from files and overrides to a typed config."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from fastllm.config.overrides import apply_override, merge
from fastllm.config.schema import build
from fastllm.config.section import Section
from fastllm.config.yaml_io import load_yaml_file

S = TypeVar("S", bound=Section)


def load_raw(files: Sequence[str | Path] = (), overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The files merged in order, then the overrides applied in order: later ones win."""
    raw: dict[str, Any] = {}
    for path in files:
        raw = merge(raw, load_yaml_file(path))
    for override in overrides:
        apply_override(raw, override)
    return raw


def load_config(cls: type[S], files: Sequence[str | Path] = (), overrides: Sequence[str] = ()) -> S:
    """A checked config of type `cls` from YAML files and `a.b.c=value` overrides."""
    return build(cls, load_raw(files, overrides))
