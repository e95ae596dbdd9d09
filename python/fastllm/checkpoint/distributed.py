"""The `distributed` format: what training writes, one safetensors file per data-parallel rank
holding that rank's shards of the flat fp32 master weights (and, in checkpoints, of the Adam
moments), plus `manifest.json` describing the layout. Any number of ranks can read it back
(resharding), and `fastllm convert input.format=distributed` merges it into whole tensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from fastllm import _native
from fastllm.config import BaseModelConfig, ConfigError, build

MANIFEST = "manifest.json"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def stage_key(kind: str, stage: int) -> str:
    return f"{kind}.stage_{stage:05d}"


def read_manifest(directory: Path) -> dict[str, Any]:
    file = directory / MANIFEST
    if not file.is_file():
        raise ConfigError(
            str(directory), f"has no {MANIFEST}: not a distributed checkpoint or export"
        )
    return json.loads(file.read_text())


class SavedLayout:
    """The flat layout a checkpoint was written with, rebuilt from its manifest."""

    def __init__(self, manifest: dict[str, Any]) -> None:
        self.parameters = [tuple(p) for p in manifest["parameters"]]
        self.shapes = {name: tuple(shape) for name, shape in manifest["shapes"].items()}
        self.world_size = manifest["world_size"]
        self.layout = _native.Layout(
            self.parameters, alignment=manifest["alignment"], world_size=self.world_size
        )
        self.index = {p[0]: i for i, p in enumerate(self.parameters)}

    def pieces(self, name: str) -> Iterator[tuple[int, int, int, int, int, int]]:
        """(rank, stage, parameter start, parameter end, shard start, shard end) of every saved
        piece of parameter `name`."""
        index = self.index[name]
        stage, _, _ = self.layout.parameter(index)
        for rank in range(self.world_size):
            for i, p0, p1, s0, s1 in self.layout.shard_parameters(stage, rank):
                if i == index:
                    yield rank, stage, p0, p1, s0, s1


class ShardFiles:
    """Lazy readers of a directory's rank files."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._handles: dict[int, Any] = {}

    def piece(self, rank: int, kind: str, stage: int, start: int, end: int) -> Tensor:
        if rank not in self._handles:
            self._handles[rank] = safe_open(self.directory / rank_file(rank), "pt")
        return self._handles[rank].get_slice(stage_key(kind, stage))[start:end]


def full_tensors(directory: Path, kind: str = "master") -> Iterator[tuple[str, Tensor]]:
    """Whole fp32 tensors of every parameter, merged from the rank files."""
    saved, files = SavedLayout(read_manifest(directory)), ShardFiles(directory)
    for name, numel, *_ in saved.parameters:
        flat = torch.empty(numel, dtype=torch.float32)
        for rank, stage, p0, p1, s0, s1 in saved.pieces(name):
            flat[p0:p1] = files.piece(rank, kind, stage, s0, s1)
        yield name, flat.view(saved.shapes[name])


def model_config(directory: Path) -> BaseModelConfig:
    manifest = read_manifest(directory)
    return build(BaseModelConfig, manifest["config"]["model"]["base_model"])
