"""The records of local files as dicts, for a record transform: a JSON object per line, a row
per Parquet row, {text, path} per text file or file of a source tree. The files are those the
Rust reader would read (its own expansion of globs and directories)."""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Iterator
from typing import IO

from fastllm import _native
from fastllm.config import ConfigError
from fastllm.config.prepare import InputConfig
from fastllm.data.fed_records import RecordChunk
from fastllm.data.huggingface_dataset import TABLE_BYTES


def file_chunks(config: InputConfig) -> tuple[list[tuple[str, int]], Iterator[RecordChunk]]:
    """The inputs of `config` (expanded as `prepare` expands them) and their records as dicts:
    a JSON object per line, a row per Parquet row, {text, path} per text file."""
    try:
        reader = _native.DocumentReader(
            paths=config.path,
            format=config.format,
            field=config.field,
            extensions=config.extensions,
        )
    except ValueError as error:
        raise ConfigError("input.path", str(error)) from None
    files = [(str(path), format, str(file), size) for path, format, file, size in reader.files()]
    inputs: dict[str, int] = {}
    for path, _, _, size in files:
        inputs[path] = inputs.get(path, 0) + size
    index = {path: i for i, path in enumerate(inputs)}

    def chunks() -> Iterator[RecordChunk]:
        for path, format, file, size in files:
            if format in ("jsonl", "chat", "preference"):
                yield from _json_lines(index[path], file)
            elif format == "parquet":
                yield from _parquet_rows(index[path], file, size)
            else:
                yield _whole_file(index[path], file, size, skip_binary=format == "files")

    return list(inputs.items()), chunks()


def _open_text(file: str) -> IO[bytes]:
    if file.endswith(".gz"):
        return gzip.open(file, "rb")
    if file.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise ConfigError(
                "input.transform", f"{file}: reading .zst in Python needs the zstandard package"
            ) from None
        return zstandard.ZstdDecompressor().stream_reader(open(file, "rb"), closefd=True)
    return open(file, "rb")


def _json_lines(input: int, file: str) -> Iterator[RecordChunk]:
    chunk = RecordChunk(input, file, [], [])
    with _open_text(file) as raw:
        for number, line in enumerate(io.BufferedReader(raw), start=1):  # type: ignore[arg-type]
            if not line.strip():
                continue
            chunk.rows.append(number)
            chunk.bytes += len(line)
            try:
                record = json.loads(line)
            except (ValueError, UnicodeDecodeError) as error:
                record, reason = None, f"invalid JSON: {error}"
            else:
                reason = "" if isinstance(record, dict) else "not a JSON object"
            if reason:
                chunk.records.append(None)
                chunk.reasons.append(reason)
            else:
                chunk.records.append(record)
            if chunk.bytes >= TABLE_BYTES:
                yield chunk
                chunk = RecordChunk(input, file, [], [])
    if chunk.rows:
        yield chunk


def _parquet_rows(input: int, file: str, size: int) -> Iterator[RecordChunk]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(file)
    rows = max(parquet.metadata.num_rows, 1)
    first = 1
    for batch in parquet.iter_batches(batch_size=1024):
        yield RecordChunk(
            input,
            file,
            list(range(first, first + batch.num_rows)),
            batch.to_pylist(),
            bytes=size * batch.num_rows // rows,
        )
        first += batch.num_rows


def _whole_file(input: int, file: str, size: int, *, skip_binary: bool) -> RecordChunk:
    with open(file, "rb") as handle:
        data = handle.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if skip_binary and (text is None or "\0" in text):
        return RecordChunk(input, file, [], [], skipped=1, bytes=size)
    if text is None:
        return RecordChunk(input, file, [0], [None], ["invalid UTF-8"], bytes=size)
    return RecordChunk(input, file, [0], [{"text": text, "path": os.fspath(file)}], bytes=size)
