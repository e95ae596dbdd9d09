"""Errors of checkpoint I/O that the command line shows as one line (no torch imported here,
so that `fastllm --help` stays instant)."""

from __future__ import annotations

from pathlib import Path

from fastllm.config import MachineError


class CheckpointWriteError(MachineError):
    """A checkpoint or export could not be written (disk full, permissions, any OS error): a
    failure of the machine, not of the input. Its partial directory was removed and the
    committed checkpoints were left as they were."""

    def __init__(self, directory: Path, reason: str) -> None:
        super().__init__(f"cannot write {directory}: {reason}")
        self.directory = directory
        self.reason = reason


class WriteStopped(Exception):
    """Writing a model was stopped at the caller's request (a training run's stop signal)
    between two tensors; the caller removes what was written."""
