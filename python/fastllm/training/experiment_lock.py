"""One run per experiment directory: an exclusive `flock` on EXPERIMENT_DIR/.lock.

The operating system releases the lock when its holder exits, however it exits (kill -9
included), so a lock is never stale. Under torchrun rank 0 holds it for the whole job and tells
the other ranks whether it got it, so that every rank stops together. The file records the
holder (host and process id) for the message a second run shows. `flock` locks are local to
one host on some network file systems (NFS without lock support): there, two hosts may still
share a directory."""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from typing import IO

import torch.distributed as dist

from fastllm.config import ConfigError

LOCK_FILE = ".lock"


class ExperimentLock:
    """Held from `acquire` to `release` (or the end of the process)."""

    def __init__(self, file: IO[str] | None) -> None:
        self._file = file

    @classmethod
    def acquire(cls, directory: Path) -> ExperimentLock:
        """Lock `directory` for this run (rank 0 of the job holds it); every process of the job
        raises `ConfigError` naming the directory and the holder when another run holds it."""
        job = dist.group.WORLD if dist.is_initialized() else None
        main = job is None or dist.get_rank(job) == 0
        file, refusal = _try_lock(directory) if main else (None, None)
        if job is not None and dist.get_world_size(job) > 1:
            message = [refusal]
            dist.broadcast_object_list(message, src=0, group=job)
            refusal = message[0]
        if refusal is not None:
            raise ConfigError("run.experiment_dir", refusal)
        return cls(file)

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the descriptor releases the lock
            self._file = None


def _try_lock(directory: Path) -> tuple[IO[str] | None, str | None]:
    """The locked file, or why it could not be locked."""
    directory.mkdir(parents=True, exist_ok=True)
    # "a+": opening must not truncate what the holder wrote.
    file = (directory / LOCK_FILE).open("a+", encoding="utf-8")
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        holder = file.read().strip() or "a process that has not yet written its name"
        file.close()
        return None, (
            f"{directory} is in use by another run ({holder}); wait for it to end or choose "
            "another run.experiment_dir"
        )
    file.truncate(0)
    file.write(f"host {socket.gethostname()}, pid {os.getpid()}\n")
    file.flush()
    return file, None
