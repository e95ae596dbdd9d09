"""`metrics.jsonl`: one strict JSON object per logged step, whole lines only.

- A crash (kill -9, disk full) can leave a partial last line; the next run cuts it before
  appending, so every line stays valid JSON.
- A resumed run replays the steps after its checkpoint: the records of those steps, written by
  the run that did not reach its next checkpoint, are dropped at start, so each step appears
  once and the file reads as one uninterrupted run.
- Non-finite values (a NaN loss, an infinite gradient norm) are written as `null`, and the
  record then counts them in `non_finite`: no `NaN`/`Infinity` literals, which strict JSON
  readers reject.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Any

from fastllm.config import MachineError

METRICS_FILE = "metrics.jsonl"


class MetricsFile:
    def __init__(self, directory: Path, start_step: int) -> None:
        """Opens DIRECTORY/metrics.jsonl for appending the records after `start_step`."""
        self.path = directory / METRICS_FILE
        self.dropped = _keep_whole_records_up_to(self.path, start_step)
        """Records of steps after `start_step` dropped at opening."""
        self._file = self.path.open("a", encoding="utf-8")
        self._failed = False

    def write(self, record: dict[str, Any]) -> None:
        """Raises `MachineError` when the line cannot be written (disk full, I/O error)."""
        try:
            self._file.write(json.dumps(strict_record(record), allow_nan=False) + "\n")
            self._file.flush()
        except OSError as error:
            self._failed = True
            raise MachineError(f"cannot write {self.path}: {error.strerror}") from None

    def close(self) -> None:
        # After a failed write the unwritten line is still buffered: closing fails again on
        # it, and that failure was reported already.
        with contextlib.suppress(OSError) if self._failed else contextlib.nullcontext():
            self._file.close()


def strict_record(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with non-finite floats as None, plus their count as `non_finite` if any."""
    non_finite = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if not non_finite:
        return record
    return {**record, **dict.fromkeys(non_finite), "non_finite": len(non_finite)}


def _keep_whole_records_up_to(path: Path, last_step: int) -> int:
    """Cuts a partial last line and the records of steps after `last_step`, in place and
    atomically (a crash meanwhile leaves the old file or the new one); returns how many
    records were dropped."""
    if not path.is_file():
        return 0
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    lines = whole.splitlines(keepends=True)
    kept = [line for line in lines if (step := _step(line)) is None or step <= last_step]
    if len(whole) == len(data) and len(kept) == len(lines):
        return 0
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    with staging.open("wb") as file:
        file.writelines(kept)
        file.flush()
        os.fsync(file.fileno())
    os.replace(staging, path)
    return len(lines) - len(kept)


def _step(line: bytes) -> int | None:
    """The step of a record; None for a line that is not one (kept as it is)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None
