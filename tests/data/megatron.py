"""An independent reader of Megatron's MMIDIDX v1 format (numpy only, none of fastllm's code),
so prepared datasets are checked against the format itself rather than against our reader."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
# megatron/core/datasets/indexed_dataset.py: DType
DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


def read_prefix(prefix: Path) -> list[np.ndarray]:
    """The documents of PREFIX.bin/.idx, checking every field of the index."""
    index = Path(f"{prefix}.idx").read_bytes()
    assert index[:9] == MAGIC
    (version,) = struct.unpack_from("<Q", index, 9)
    assert version == 1
    code, sequences, document_count = struct.unpack_from("<BQQ", index, 17)
    offset = 9 + 8 + 1 + 8 + 8
    lengths = np.frombuffer(index, "<i4", sequences, offset)
    offset += 4 * sequences
    pointers = np.frombuffer(index, "<i8", sequences, offset)
    offset += 8 * sequences
    documents = np.frombuffer(index, "<i8", document_count, offset)
    offset += 8 * document_count
    assert offset == len(index), "trailing bytes after the document indices"

    dtype = np.dtype(DTYPES[code]).newbyteorder("<")
    assert (lengths >= 0).all()
    expected_pointers = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1]])
    assert np.array_equal(pointers, expected_pointers[:sequences] * dtype.itemsize)
    # One sequence per document: 0, 1, ..., S.
    assert np.array_equal(documents, np.arange(sequences + 1))
    bin_path = Path(f"{prefix}.bin")
    assert bin_path.stat().st_size == int(lengths.sum()) * dtype.itemsize
    if bin_path.stat().st_size == 0:
        return [np.zeros(0, dtype) for _ in range(sequences)]
    tokens = np.memmap(bin_path, dtype=dtype, mode="r")
    return [
        np.array(tokens[pointer // dtype.itemsize :][:length])
        for pointer, length in zip(pointers, lengths, strict=True)
    ]


def read_dataset(path: Path) -> list[list[int]]:
    """The documents of a directory written by `fastllm prepare`: its shards in the order of
        metadata.json, which must list every shard on disk, count their documents and tokens and
    record their largest token id."""
    metadata = json.loads((path / "metadata.json").read_text())
    names = [shard["name"] for shard in metadata["shards"]]
    assert sorted(names) == sorted(index.stem for index in path.glob("*.idx"))
    documents: list[list[int]] = []
    for shard in metadata["shards"]:
        shard_documents = read_prefix(path / shard["name"])
        assert shard["documents"] == len(shard_documents)
        assert shard["tokens"] == sum(len(d) for d in shard_documents)
        tokens = [int(d.max()) for d in shard_documents if len(d)]
        assert shard["max_token_id"] == (max(tokens) if tokens else None)
        documents += [d.tolist() for d in shard_documents]
    assert metadata["documents"] == len(documents)
    assert metadata["tokens"] == sum(len(d) for d in documents)
    return documents
