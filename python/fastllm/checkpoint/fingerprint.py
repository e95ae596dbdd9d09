"""Which weights a model directory holds, cheaply: a checkpoint of a run with frozen
parameters holds only the trained ones and names its base by this, so that a resume reading
the frozen weights again from another model is refused."""

from __future__ import annotations

from pathlib import Path

import xxhash

_SAMPLES, _SAMPLE_BYTES = 16, 64 * 2**10


def fingerprint(directory: Path) -> dict[str, str]:
    """For each file under `directory` (by relative path): its size and an xxh3-64 hash of its
    first 64 KiB and 16 evenly spaced 64 KiB samples. Two fine-tunes of one architecture
    differ in every sample; reading them costs milliseconds, not a pass over the weights."""
    prints = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        size = path.stat().st_size
        digest = xxhash.xxh3_64()
        with path.open("rb") as file:
            for index in range(_SAMPLES + 1):
                file.seek(index * max(size - _SAMPLE_BYTES, 0) // _SAMPLES)
                digest.update(file.read(_SAMPLE_BYTES))
        prints[str(path.relative_to(directory))] = f"{size}:{digest.hexdigest()}"
    return prints
