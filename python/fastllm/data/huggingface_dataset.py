"""A Hugging Face dataset as `prepare` reads it: opened from a `save_to_disk` directory
(memory-mapped) or by `load_dataset` (streaming by default), and read as Arrow tables of a few
rows at a time, so that it is never whole in memory. `datasets` is imported here only, when a
config asks for it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastllm.config import ConfigError
from fastllm.config.prepare import HuggingfaceInputConfig

if TYPE_CHECKING:
    import pyarrow as pa

# Text per table read: large enough for the tokenizer threads to share, small enough to hold.
TABLE_BYTES = 1 << 20
# Rows read first, to learn their size.
FIRST_ROWS = 64
MAX_ROWS = 1 << 16
# A streamed dataset is read in batches of a fixed number of rows (learning their size first
# would read its first file twice).
STREAMED_ROWS = 1024


@dataclass
class HuggingfaceDataset:
    name: str
    """How locations and the report name it: the directory read, or `path[split]`."""
    dataset: Any
    """A `datasets.Dataset` (memory-mapped) or `datasets.IterableDataset` (streamed)."""
    columns: list[str]
    bytes: int
    """Size on disk, for progress; 0 when unknown (streamed)."""

    def tables(self) -> Iterator[tuple[int, pa.Table, int]]:
        """(row of the first record, counted from 1; the rows; the bytes on disk they stand for,
        for progress) in order, about `TABLE_BYTES` at a time."""
        import datasets

        arrow = self.dataset.with_format("arrow")
        if isinstance(self.dataset, datasets.IterableDataset):
            first = 1
            for table in arrow.iter(batch_size=STREAMED_ROWS):
                yield first, table, table.nbytes
                first += table.num_rows
            return
        start, rows, total = 0, FIRST_ROWS, len(self.dataset)
        while start < total:
            table = arrow[start : start + rows]
            yield start + 1, table, self.bytes * table.num_rows // total
            start += table.num_rows
            # At most twice as many: a few short rows say little of those that follow.
            rows = min(_rows(table, TABLE_BYTES), 2 * table.num_rows)


def _rows(table: pa.Table, target_bytes: int) -> int:
    """Rows of the size of those of `table` that make about `target_bytes`."""
    row_bytes = max(table.nbytes / max(table.num_rows, 1), 1.0)
    return max(1, min(MAX_ROWS, int(target_bytes / row_bytes)))


def open_dataset(config: HuggingfaceInputConfig) -> HuggingfaceDataset:
    """The split `config` names; errors name the key at fault."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            "input.type", "huggingface needs the datasets package: pip install 'datasets>=4'"
        ) from None

    path = config.path
    saved = os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, name)) for name in ("state.json", "dataset_dict.json")
    )
    if saved:
        for key in ("config_name", "data_directory", "data_files"):
            if getattr(config, key) is not None:
                raise ConfigError(
                    f"input.{key}", f"is for load_dataset; {path} is a save_to_disk directory"
                )
        try:
            loaded = datasets.load_from_disk(path)
        except Exception as error:
            raise ConfigError("input.path", f"{path}: {type(error).__name__}: {error}") from error
        if isinstance(loaded, datasets.DatasetDict):
            if config.split not in loaded:
                raise ConfigError(
                    "input.split",
                    f"{path} has no split {config.split!r}; it has: {', '.join(loaded)}",
                )
            dataset, name = loaded[config.split], os.path.join(path, config.split)
        else:
            dataset, name = loaded, path
        size = sum(os.path.getsize(f["filename"]) for f in dataset.cache_files)
        return HuggingfaceDataset(name, dataset, list(dataset.column_names), size)
    if os.path.isfile(path):
        raise ConfigError(
            "input.path",
            f"{path} is a file, not a dataset: name its builder and the file (path: json, "
            f"data_files: [{path}]), or read it with type: files",
        )
    try:
        dataset = datasets.load_dataset(
            path,
            name=config.config_name,
            data_dir=config.data_directory,
            data_files=config.data_files,
            split=config.split,
            streaming=config.streaming,
        )
    except Exception as error:
        key = "input.split" if "split" in str(error).lower() else "input.path"
        raise ConfigError(
            key, f"load_dataset({path!r}) failed: {type(error).__name__}: {error}"
        ) from error
    name = f"{path}[{config.split}]"
    if isinstance(dataset, datasets.IterableDataset):
        columns = dataset.column_names
        if columns is None:  # features unknown until read: the first rows say
            first = next(iter(dataset.with_format("arrow").iter(batch_size=1)), None)
            columns = [] if first is None else first.column_names
        return HuggingfaceDataset(name, dataset, list(columns), 0)
    size = sum(os.path.getsize(f["filename"]) for f in dataset.cache_files)
    return HuggingfaceDataset(name, dataset, list(dataset.column_names), size)
