"""Which weights a model directory holds, cheaply: a checkpoint of a run with frozen
parameters holds only the trained ones and names its base by this, so that a resume reading
the frozen weights again from another model is refused; DPO's precomputed reference
log-probabilities are keyed by the fingerprints of the reference and of the dataset."""

from __future__ import annotations

from pathlib import Path

import xxhash

_SAMPLES, _SAMPLE_BYTES = 16, 64 * 2**10


def fingerprint(directory: Path) -> dict[str, str]:
    """For each file under `directory` (by relative path): its `file_fingerprint`. Two
    fine-tunes of one architecture differ in every sample; reading them costs milliseconds,
    not a pass over the weights."""
    return {
        str(path.relative_to(directory)): file_fingerprint(path)
        for path in sorted(p for p in directory.rglob("*") if p.is_file())
    }


def file_fingerprint(path: Path) -> str:
    """SIZE:HASH, the hash an xxh3-64 of the file's first 64 KiB and 16 evenly spaced 64 KiB
    samples."""
    size = path.stat().st_size
    digest = xxhash.xxh3_64()
    with path.open("rb") as file:
        for index in range(_SAMPLES + 1):
            file.seek(index * max(size - _SAMPLE_BYTES, 0) // _SAMPLES)
            digest.update(file.read(_SAMPLE_BYTES))
    return f"{size}:{digest.hexdigest()}"
