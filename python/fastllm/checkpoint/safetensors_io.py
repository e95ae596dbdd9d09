"""Sharded safetensors directories, read lazily and written shard by shard, so that a model
larger than memory converts with only a shard's worth of tensors in memory at once."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from fastllm.config import ConfigError

INDEX = "model.safetensors.index.json"
WEIGHT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
"""safetensors dtypes of weights that a model reads, converted to the run's precision."""


class SafetensorsReader:
    """Tensors of `model.safetensors` or of the shards listed by `model.safetensors.index.json`.
    A missing, truncated or invalid file is a `ConfigError` naming it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._handles: dict[str, Any] = {}
        index = directory / INDEX
        if index.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError):
                raise ConfigError(
                    str(index), "is not a safetensors index (no weight_map)"
                ) from None
        elif (directory / "model.safetensors").is_file():
            weight_map = dict.fromkeys(
                self._handle("model.safetensors").keys(), "model.safetensors"
            )
        else:
            raise ConfigError(str(directory), f"has neither model.safetensors nor {INDEX}")
        self.weight_map = weight_map

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            path = self.directory / file
            if not path.is_file():
                raise ConfigError(str(path), "is missing")
            try:
                self._handles[file] = safe_open(path, "pt")
            except SafetensorError as error:
                raise ConfigError(str(path), f"truncated or not safetensors ({error})") from None
        return self._handles[file]

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def shapes(self) -> dict[str, tuple[tuple[int, ...], Path]]:
        """Every tensor's shape and file, from the files' headers (no tensor is read). A
        tensor whose values are not of a dtype that converts to the model's exactly (integers,
        booleans, or FP8 that needs its scales) is a `ConfigError` naming it."""
        held = {file: set(self._handle(file).keys()) for file in set(self.weight_map.values())}
        found = {}
        for name, file in self.weight_map.items():
            if name not in held[file]:
                raise ConfigError(str(self.directory / file), f"lacks {name}, which {INDEX} lists")
            piece = self._handle(file).get_slice(name)
            if piece.get_dtype() not in WEIGHT_DTYPES:
                raise ConfigError(
                    str(self.directory / file),
                    f"{name} holds {piece.get_dtype()} values; weights are read from "
                    f"{', '.join(sorted(WEIGHT_DTYPES))} (quantized weights: dequantize first)",
                )
            found[name] = (tuple(piece.get_shape()), self.directory / file)
        return found

    def get(self, name: str) -> Tensor:
        try:
            file = self.weight_map[name]
        except KeyError:
            raise KeyError(f"{self.directory}: tensor {name!r} not found") from None
        return self._handle(file).get_tensor(name)


class ShardedWriter:
    """Collects tensors and writes a shard whenever `shard_bytes` is reached; `close` writes the
    index (only when there is more than one shard, as Hugging Face does)."""

    def __init__(
        self, directory: Path, shard_bytes: int = 2 * 2**30, metadata: dict[str, str] | None = None
    ) -> None:
        self.directory, self.shard_bytes = directory, shard_bytes
        self.metadata = metadata or {"format": "pt"}
        self._pending: dict[str, Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[dict[str, Tensor] | list[str]] = []
        self._total_bytes = 0

    def add(self, name: str, tensor: Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += size
        self._total_bytes += size

    def add_all(self, tensors: Iterable[tuple[str, Tensor]]) -> None:
        for name, tensor in tensors:
            self.add(name, tensor)

    def _flush(self) -> None:
        number = len(self._shards) + 1
        path = self.directory / f"shard-{number:05d}.safetensors"
        try:
            save_file(self._pending, path, self.metadata)
        except SafetensorError as error:  # how safetensors reports an I/O error (disk full, …)
            raise OSError(f"{path}: {error}") from None
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        if self._pending or not self._shards:
            self._flush()
        count = len(self._shards)
        names = [f"model-{n:05d}-of-{count:05d}.safetensors" for n in range(1, count + 1)]
        if count == 1:
            names = ["model.safetensors"]
        weight_map = {}
        for number, (name, keys) in enumerate(zip(names, self._shards, strict=True), start=1):
            os.replace(self.directory / f"shard-{number:05d}.safetensors", self.directory / name)
            weight_map.update(dict.fromkeys(keys, name))
        if count > 1:
            index = {"metadata": {"total_size": self._total_bytes}, "weight_map": weight_map}
            (self.directory / INDEX).write_text(json.dumps(index, indent=2))
