"""Prepared token datasets: a directory written by `fastllm prepare` (shards + metadata.json)
or a single Megatron `.bin`/`.idx` prefix made elsewhere."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from fastllm import _native


class TokenDataset:
    """Documents of a prepared dataset, memory-mapped (a directory's shards read as one)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.metadata = read_metadata(self.path)
        """metadata.json of a prepared directory (empty for a bare prefix or a directory
        without one)."""
        self.prefixes = shard_prefixes(self.path, self.metadata)
        self._shards = [_native.TokenDataset(prefix) for prefix in self.prefixes]
        self._starts = np.cumsum([0] + [len(shard) for shard in self._shards])

    def check_token_range(self, vocab_size: int, cache_dir: str | Path) -> None:
        """Raise `_native.TokenRangeError` naming the first shard and document with an id
        outside `0..vocab_size`. Each shard's id range is scanned (memory-mapped, in Rust) and
        cached in `cache_dir` per file size and modification time; metadata.json is not trusted
        for it, since a `.bin` damaged after prepare still matches its metadata."""
        for shard in self._shards:
            shard.check_token_range(vocab_size, str(cache_dir))

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def num_tokens(self) -> int:
        return sum(shard.num_tokens for shard in self._shards)

    @property
    def shard_tokens(self) -> list[int]:
        return [shard.num_tokens for shard in self._shards]

    @property
    def shard_documents(self) -> list[int]:
        return [len(shard) for shard in self._shards]

    @property
    def files(self) -> list[Path]:
        """The files it is read from: metadata.json, if any, and each shard's `.bin`, `.idx`
        and sidecars (`.spans`, `.preference`)."""
        found = [self.path / "metadata.json"] if self.metadata else []
        for prefix in self.prefixes:
            for suffix in (".bin", ".idx", ".spans", ".preference"):
                file = prefix.with_name(prefix.name + suffix)
                if file.is_file():
                    found.append(file)
        return found

    @property
    def shard_has_loss_spans(self) -> list[bool]:
        return [shard.has_loss_spans for shard in self._shards]

    @property
    def has_loss_spans(self) -> bool:
        """Some shard has a `.spans` sidecar: tokens masked from the loss."""
        return any(self.shard_has_loss_spans)

    @property
    def is_preference(self) -> bool:
        """A dataset of preference pairs (metadata.json `format: preference`, or `.preference`
        sidecars): each document is a prompt, then its chosen answer, then its rejected one.
        Training on it needs a preference loss (DPO), and a preference loss needs it."""
        return self.metadata.get("format") == PREFERENCE_FORMAT or any(
            shard.is_preference for shard in self._shards
        )

    @property
    def shard_is_preference(self) -> list[bool]:
        return [shard.is_preference for shard in self._shards]

    def preference_spans(self, index: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The chosen and rejected token ranges `((begin, end), (begin, end))` of pair `index`;
        its prompt is tokens `0..chosen begin`."""
        shard, local = self._locate(index)
        spans = self._shards[shard].preference_spans(local)
        if spans is None:
            raise ValueError(f"{self.prefixes[shard]}: not a dataset of preference pairs")
        return spans

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


PREFERENCE_FORMAT = "preference"
"""metadata.json `format` of a dataset of preference pairs."""


def is_preference_dataset(path: str | Path) -> bool:
    """Whether `path` (a prepared directory) holds preference pairs, from its metadata.json
    alone: quick enough to refuse a config at start-up."""
    return read_metadata(Path(path)).get("format") == PREFERENCE_FORMAT


def read_metadata(path: Path) -> dict[str, Any]:
    """`path`/metadata.json, checked to be a JSON object whose `shards` name files; empty when
    there is none. A damaged one is an error naming it."""
    file = path / "metadata.json"
    if not file.is_file():
        return {}
    try:
        metadata = json.loads(file.read_bytes())
    except ValueError as error:  # invalid JSON or UTF-8
        raise ValueError(f"{file}: invalid metadata ({error})") from None
    if not isinstance(metadata, dict):
        raise ValueError(f"{file}: invalid metadata (not a JSON object)")
    shards = metadata.get("shards", [])
    if not isinstance(shards, list) or not all(
        isinstance(shard, str) or (isinstance(shard, dict) and isinstance(shard.get("name"), str))
        for shard in shards
    ):
        raise ValueError(f"{file}: invalid metadata (shards must be a list of names)")
    return metadata


def shard_prefixes(path: Path, metadata: dict[str, Any]) -> list[Path]:
    """The `.bin`/`.idx` prefixes of a dataset: a prepared directory's shards in order (from
    its `metadata`), every `*.idx` of another directory, or `path` itself as a prefix."""
    if path.is_dir():
        shards = metadata.get("shards", [])
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
