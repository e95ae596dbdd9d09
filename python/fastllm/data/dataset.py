"""Prepared token datasets: a directory written by `fastllm prepare` (shards + metadata.json)
or a single Megatron `.bin`/`.idx` prefix made elsewhere."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from fastllm import _native


class TokenDataset:
    """Documents of a prepared dataset, memory-mapped (a directory's shards read as one)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.prefixes = shard_prefixes(self.path)
        self._shards = [_native.TokenDataset(prefix) for prefix in self.prefixes]
        self._starts = np.cumsum([0] + [len(shard) for shard in self._shards])

    @cached_property
    def metadata(self) -> dict[str, Any]:
        """metadata.json of a prepared directory (empty for a bare prefix)."""
        file = self.path / "metadata.json"
        return json.loads(file.read_text()) if file.is_file() else {}

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def num_tokens(self) -> int:
        return sum(shard.num_tokens for shard in self._shards)

    @property
    def shard_tokens(self) -> list[int]:
        return [shard.num_tokens for shard in self._shards]

    @property
    def shard_has_loss_spans(self) -> list[bool]:
        return [shard.has_loss_spans for shard in self._shards]

    @property
    def has_loss_spans(self) -> bool:
        """Some shard has a `.spans` sidecar: tokens masked from the loss."""
        return any(self.shard_has_loss_spans)

    def loss_spans(self, index: int) -> list[tuple[int, int]]:
        """The masked token ranges (begin, end) of document `index`."""
        shard, local = self._locate(index)
        return self._shards[shard].loss_spans(local)

    def document_lengths(self) -> np.ndarray:
        return np.concatenate([shard.document_lengths() for shard in self._shards])

    def __getitem__(self, index: int) -> np.ndarray:
        shard, local = self._locate(index)
        return self._shards[shard].document(local)

    def _locate(self, index: int) -> tuple[int, int]:
        """The shard of document `index` and its index there."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"{self.path}: document {index} out of range ({len(self)} documents)")
        index %= len(self)
        shard = int(np.searchsorted(self._starts, index, side="right")) - 1
        return shard, index - int(self._starts[shard])


def shard_prefixes(path: Path) -> list[Path]:
    """The `.bin`/`.idx` prefixes of a dataset: a prepared directory's shards in order (from
    metadata.json), every `*.idx` of another directory, or `path` itself as a prefix."""
    if path.is_dir():
        metadata = path / "metadata.json"
        if metadata.is_file():
            shards = json.loads(metadata.read_text()).get("shards", [])
            names = [shard["name"] if isinstance(shard, dict) else shard for shard in shards]
            if names:
                return [path / name for name in names]
        prefixes = sorted(index.with_suffix("") for index in path.glob("*.idx"))
        if prefixes:
            return prefixes
        raise FileNotFoundError(f"{path}: no dataset shards (*.idx) found")
    if path.with_suffix(".idx").is_file():
        return [path]
    raise FileNotFoundError(f"{path}: no such dataset (neither a directory nor a .bin/.idx prefix)")
