"""Writing `distributed` checkpoints and exports without stalling training.

Saving stalls training only for the copy of this rank's shards to pinned host memory; Rust
(`fastllm._native.CheckpointWriter`) serializes, checksums and fsyncs on background threads.
Shards a GPU run keeps in host memory (`model.multi_stage.offload_optimizer`) are written from
where they are, the save then waiting for the write: a copy would double the host memory they
take, in the memory the host has least of.
Every rank of the job writes into `.NAME.partial/`; once every rank's file is written, rank 0
commits: manifest.json (with the checksums), then an atomic rename to `NAME/`. A partial or
corrupt checkpoint is never loaded. A write or commit that fails on any rank (disk full, …)
raises `CheckpointWriteError` on every rank, so that the job stops together, once the partial
directory is removed."""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fastllm import _native
from fastllm.checkpoint.distributed import Snapshot, rank_file
from fastllm.checkpoint.errors import CheckpointWriteError
from fastllm.config import ConfigError

PARTIAL_SUFFIX = ".partial"


@dataclass
class _Pending:
    partial: Path
    final: Path
    manifest: dict[str, Any]
    keep: int | None
    job: Any = None
    """The background write; None when it could not be submitted."""
    buffers: list[Any] = field(default_factory=list)
    failure: str | None = None
    """Why this rank could not start writing, reported to every rank at `wait`."""


class CheckpointSaver:
    """The checkpoints in flight of one job. `rank` and `world_size` count every rank of the
    job (all of them write a file); collectives run on the default group, which is all of
    them."""

    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self._writer: Any = None
        self._pending: list[_Pending] = []

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def save(
        self,
        snapshot: Snapshot,
        final: Path,
        *,
        keep: int | None = None,
        before_commit: Callable[[Path], None] | None = None,
    ) -> Path:
        """Start writing `snapshot` to `final` (replacing a stale directory of that name);
        `keep`: prune to that many numbered siblings once committed. `before_commit(partial)`
        runs on rank 0 to add files (the tokenizer's)."""
        self.wait()
        partial = final.with_name(f".{final.name}{PARTIAL_SUFFIX}")
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            if final.exists():  # one this run did not resume from: corrupt, or abandoned
                warnings.warn(f"replacing the checkpoint {final}", stacklevel=2)
                shutil.rmtree(final)
        self._barrier()
        pending = _Pending(partial, final, snapshot.manifest(), keep)
        in_place = False
        try:
            pending.job, pending.buffers, in_place = self._submit(snapshot, partial)
            if self.rank == 0 and before_commit is not None:
                before_commit(partial)
        except OSError as error:
            pending.failure = str(error)
        self._pending.append(pending)
        if in_place:  # training would change them under the writer
            self.wait()
        return final

    def _submit(self, snapshot: Snapshot, directory: Path) -> tuple[Any, list[Any], bool]:
        """Copy this rank's shards to host memory and hand them to the background writer;
        whether some are written from where they are."""
        if self._writer is None:
            self._writer = _native.CheckpointWriter()
        pin = self.device.type == "cuda"
        tensors: list[tuple[str, torch.Tensor]] = []
        in_place = False
        for key, tensor in snapshot.state.tensors():
            # Shards a GPU run holds in host memory (`offload_optimizer`) are not copied: a
            # copy would double the host memory they take.
            held = pin and tensor.device.type == "cpu"
            tensors.append((key, tensor if held else _staged(tensor, pin)))
            in_place = in_place or held
        tensors += [(name, _staged(t, pin)) for name, t in snapshot.extra.items()]
        if pin:
            torch.cuda.synchronize()
        arrays = [(name, t.numpy(), _dtype_name(t.dtype), list(t.shape)) for name, t in tensors]
        directory.mkdir(parents=True, exist_ok=True)
        file = rank_file(snapshot.state.rank)
        return self._writer.submit(str(directory), [(file, arrays, {})]), tensors, in_place

    def wait(self) -> None:
        """Finish every checkpoint in flight: wait for this rank's files, then rank 0 commits.
        Raises `CheckpointWriteError` on every rank when a write or the commit failed."""
        while self._pending:
            pending = self._pending.pop(0)
            reports, failure = [], pending.failure
            if pending.job is not None:  # waited for even after a failure: it writes into partial
                try:
                    reports = pending.job.wait()
                except OSError as error:
                    failure = failure or str(error)
            outcomes: list[Any] = [(reports, failure)]
            if self.world_size > 1:
                outcomes = [None] * self.world_size
                dist.all_gather_object(outcomes, (reports, failure))
            failures = [failure for _, failure in outcomes if failure is not None]
            if self.rank == 0 and not failures:
                try:
                    _native.commit_checkpoint(
                        str(pending.partial),
                        str(pending.final),
                        json.dumps(pending.manifest),
                        [report for rank_reports, _ in outcomes for report in rank_reports],
                    )
                except OSError as error:
                    failures = [str(error)]
                if not failures and pending.keep is not None:
                    _prune(pending.final.parent, pending.keep)
            if self.world_size > 1:  # also holds the other ranks until the commit is done
                message = [failures[0] if failures else None]
                dist.broadcast_object_list(message, src=0)
                failures = [message[0]] if message[0] is not None else []
            if failures:
                if self.rank == 0:
                    shutil.rmtree(pending.partial, ignore_errors=True)
                raise CheckpointWriteError(pending.final, failures[0])


def _staged(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
    copy.copy_(tensor, non_blocking=pin)
    return copy


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "F32", torch.uint8: "U8", torch.int64: "I64"}[dtype]


def _prune(root: Path, keep: int) -> None:
    steps = sorted((int(p.name), p) for p in root.iterdir() if p.is_dir() and p.name.isdigit())
    for _, directory in steps[:-keep]:
        shutil.rmtree(directory, ignore_errors=True)


def remove_partials(root: Path) -> None:
    """Delete the partial directories under `root` that a killed run left (call it only while
    holding the experiment's lock: a running job's are not leftovers)."""
    for partial in root.glob(f".*{PARTIAL_SUFFIX}"):
        if partial.is_dir():
            shutil.rmtree(partial, ignore_errors=True)


def latest(root: Path) -> tuple[Path, dict[str, Any], list[str]] | None:
    """The newest complete checkpoint under `root` (verified), its manifest, and the problems
    of the newer ones that were skipped. None when there is no checkpoint; `ConfigError`
    listing each one when none verifies (starting over would throw the run away)."""
    if not root.is_dir():
        return None
    try:
        found = _native.latest_checkpoint(str(root))
    except ValueError as error:  # the crate's NoValidCheckpoint: every one is corrupt
        raise ConfigError(
            "run.experiment_dir",
            f"{error}; remove them (or choose another directory) to start over",
        ) from None
    if found is None:
        return None
    _, directory, manifest, problems = found
    return Path(directory), json.loads(manifest), list(problems)
