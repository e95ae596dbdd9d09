"""Records that Python reads for `prepare` and sends to the Rust pipeline (`PrepareJob.feed`),
which parses and tokenizes them on all cores as it does the records of files: the rows of a
Hugging Face dataset, and the records of any input passed through a transform."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from fastllm.config import ConfigError
from fastllm.config.prepare import HuggingfaceInputConfig
from fastllm.data.huggingface_dataset import HuggingfaceDataset
from fastllm.data.record_transform import Kind, Transform, apply


@dataclass
class FedBatch:
    """The keyword arguments of one `PrepareJob.feed` call."""

    input: int
    file: str
    kind: Literal["text", "json"]
    rows: list[int]
    values: list[str | None]
    reasons: list[str] = field(default_factory=list)
    skipped: int = 0
    bytes: int = 0

    def send(self, job: Any) -> bool:
        return job.feed(**vars(self))


@dataclass
class FedStrings:
    """The keyword arguments of one `PrepareJob.feed_strings` call: the texts of an Arrow
    string array, handed over as its buffers (no Python string made)."""

    input: int
    file: str
    first_row: int
    validity: Any
    offsets: Any
    data: Any
    offset: int
    length: int
    large: bool
    bytes: int

    def send(self, job: Any) -> bool:
        return job.feed_strings(**vars(self))


@dataclass
class RecordChunk:
    """Consecutive records of one input for a transform: a dict each, or None for a record that
    could not be read, whose reason is the next of `reasons`."""

    input: int
    file: str
    rows: list[int]
    records: list[dict[str, Any] | None]
    reasons: list[str] = field(default_factory=list)
    skipped: int = 0
    bytes: int = 0


@dataclass
class FedInput:
    """What a fed `prepare` job starts with: its sources (name, bytes), how its JSON records
    are read, the record fields they use, and the batches to send."""

    inputs: list[tuple[str, int]]
    format: Kind
    fields: dict[str, str | None]
    batches: Iterator[FedBatch | FedStrings]


# The fields of the documents a transform makes (see record_transform.apply).
TRANSFORM_FIELDS: dict[str, str | None] = {
    "field": "text",
    "messages_field": "messages",
    "loss_masking_spans": None,
    "prompt_text": "prompt",
    "chosen_text": "chosen",
    "rejected_text": "rejected",
}


def transformed(
    transform: Transform, inputs: list[tuple[str, int]], chunks: Iterable[RecordChunk]
) -> FedInput:
    """The documents `transform` makes of each record; the first one's kind is the dataset's
    (the first chunk is transformed here, to know it)."""
    kind: Kind | None = None

    def batches() -> Iterator[FedBatch]:
        nonlocal kind
        for chunk in chunks:
            values: list[str | None] = []
            for row, record in zip(chunk.rows, chunk.records, strict=True):
                if record is None:
                    values.append(None)
                    continue
                location = f"{chunk.file}:{row}" if row else chunk.file
                kind, value = apply(transform, record, location, kind)
                values.append(value)
            yield FedBatch(
                chunk.input,
                chunk.file,
                "text" if kind in (None, "jsonl") else "json",
                chunk.rows,
                values,
                chunk.reasons,
                chunk.skipped,
                chunk.bytes,
            )

    stream = batches()
    first = next(stream, None)
    head = [] if first is None else [first]
    return FedInput(inputs, kind or "jsonl", TRANSFORM_FIELDS, _chain(head, stream))


def _chain(head: list[FedBatch], rest: Iterator[FedBatch]) -> Iterator[FedBatch]:
    yield from head
    yield from rest


def huggingface_input(
    config: HuggingfaceInputConfig, dataset: HuggingfaceDataset, transform: Transform | None
) -> FedInput:
    inputs = [(dataset.name, dataset.bytes)]
    if transform is not None:
        chunks = (
            RecordChunk(
                0,
                dataset.name,
                list(range(first, first + table.num_rows)),
                table.to_pylist(),
                bytes=size,
            )
            for first, table, size in dataset.tables()
        )
        return transformed(transform, inputs, chunks)
    format = _dataset_format(config, dataset)
    fields: dict[str, str | None] = {
        "field": config.field,
        "messages_field": config.messages_field,
        "loss_masking_spans": config.loss_masking_spans,
        "prompt_text": config.prompt_text,
        "chosen_text": config.chosen_text,
        "rejected_text": config.rejected_text,
    }
    if format == "jsonl" and config.loss_masking_spans is None:
        return FedInput(inputs, format, fields, _text_batches(config.field, dataset))
    columns = {
        "jsonl": [config.field, config.loss_masking_spans],
        "chat": [config.messages_field],
        "preference": [config.prompt_text, config.chosen_text, config.rejected_text],
    }[format]
    present = [c for c in columns if c is not None and c in dataset.columns]
    return FedInput(inputs, format, fields, _json_batches(present, dataset))


def _dataset_format(config: HuggingfaceInputConfig, dataset: HuggingfaceDataset) -> Kind:
    """The kind of record the columns hold; a column the format needs and the dataset lacks
    is an error naming its key."""
    columns = dataset.columns
    format: Kind
    if config.format == "auto":
        if config.loss_masking_spans is not None:
            format = "jsonl"
        elif config.chosen_text in columns and config.rejected_text in columns:
            format = "preference"
        elif config.messages_field in columns and config.field not in columns:
            format = "chat"
        else:
            format = "jsonl"
    else:
        format = {"text": "jsonl", "chat": "chat", "preference": "preference"}[config.format]
    needed = {
        "jsonl": ["field", "loss_masking_spans"],
        "chat": ["messages_field"],
        "preference": ["chosen_text", "rejected_text"],
    }[format]
    for key in needed:
        column = getattr(config, key)
        if column is not None and column not in columns:
            raise ConfigError(
                f"input.{key}",
                f"{dataset.name} has no column {column!r}; its columns: {', '.join(columns)}",
            )
    return format


def _text_batches(column: str, dataset: HuggingfaceDataset) -> Iterator[FedStrings]:
    """The fast path: a string column's values, as Arrow holds them."""
    import pyarrow as pa

    for first, table, size in dataset.tables():
        kind = table.schema.field(column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise ConfigError(
                "input.field", f"{dataset.name}: column {column!r} holds {kind}, not strings"
            )
        row = first
        for chunk in table.column(column).chunks:
            validity, offsets, data = chunk.buffers()
            yield FedStrings(
                0,
                dataset.name,
                row,
                validity,
                offsets,
                data,
                chunk.offset,
                len(chunk),
                pa.types.is_large_string(kind),
                size * len(chunk) // max(table.num_rows, 1),
            )
            row += len(chunk)


def _json_batches(columns: list[str], dataset: HuggingfaceDataset) -> Iterator[FedBatch]:
    """Conversations, pairs and texts with spans: the columns read, as JSON objects."""
    for first, table, size in dataset.tables():
        values = []
        for row, record in enumerate(table.select(columns).to_pylist(), start=first):
            try:
                values.append(json.dumps(record, ensure_ascii=False))
            except (TypeError, ValueError) as error:
                raise ConfigError(
                    "input.path",
                    f"{dataset.name}:{row}: columns {', '.join(columns)} hold what JSON "
                    f"cannot: {error}",
                ) from None
        yield FedBatch(
            0,
            dataset.name,
            "json",
            list(range(first, first + table.num_rows)),
            values,
            bytes=size,
        )
