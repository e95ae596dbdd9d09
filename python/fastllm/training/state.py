"""Checkpoints, exports and resumption of a training run: where and when the loop writes the
engine's state (`engine.checkpointing` converts it), and the newest checkpoint resumed."""

from __future__ import annotations

import json
import shutil
import signal
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch.distributed as dist

from fastllm.checkpoint.compatibility import check_resume
from fastllm.checkpoint.distributed import SavedCheckpoint, Snapshot
from fastllm.checkpoint.errors import CheckpointWriteError, WriteStopped
from fastllm.checkpoint.formats import ModelSource, copy_tokenizer_files, write_model
from fastllm.checkpoint.saver import PARTIAL_SUFFIX, latest
from fastllm.config import ConfigError
from fastllm.config.model import FreezeConfig
from fastllm.config.resume_changes import resume_warning
from fastllm.engine import checkpointing

if TYPE_CHECKING:
    from fastllm.training.trainer import Trainer


def save_checkpoint(trainer: Trainer, directory: Path | None = None) -> Path:
    """Start writing a checkpoint of the full training state (default
    EXPERIMENT_DIR/checkpoint/STEP, pruned to `training.checkpoint.keep`)."""
    engine = trainer.engine
    snapshot = checkpointing.to_snapshot(engine.state_dict(), msgspec.to_builtins(trainer.config))
    final = directory or trainer.experiment_dir / "checkpoint" / str(engine.state.step)
    keep = trainer.config.training.checkpoint.keep if directory is None else None
    return trainer.checkpoints.save(snapshot, final, keep=keep)


def resume(trainer: Trainer) -> Path | None:
    found = latest(trainer.experiment_dir / "checkpoint")
    if found is None:
        return None
    directory, manifest, problems = found
    saved = _checked(trainer, directory, manifest)
    if trainer.distributed.is_main:
        for problem in problems:
            warnings.warn(f"skipping a bad checkpoint: {problem}", stacklevel=2)
        if changed := resume_warning(manifest["config"], msgspec.to_builtins(trainer.config)):
            warnings.warn(changed, stacklevel=2)
    checkpointing.load(trainer.engine, saved)
    return directory


def load_checkpoint(trainer: Trainer, directory: Path) -> None:
    """Restore the full training state, whatever tensor and data sizes wrote it."""
    checkpointing.load(trainer.engine, _checked(trainer, directory))


def _checked(trainer: Trainer, directory: Path, manifest: dict | None = None) -> SavedCheckpoint:
    """The checkpoint, refused (`ConfigError`, on every rank alike) when it was written by
    another architecture. `manifest` is given when the checkpoint was just verified."""
    saved = SavedCheckpoint(directory, manifest)
    model = trainer.config.model
    _check_same_freeze(saved, model.freeze)
    frozen = _frozen_names(trainer)
    check_resume(saved, model.base_model, frozen)
    return saved


def export(
    trainer: Trainer,
    directory: Path,
    output_format: str,
    stop: Callable[[], signal.Signals | None] | None = None,
) -> signal.Signals | None:
    """Write the model weights: `distributed` (fp32 shards, every rank, in the background like a
    checkpoint), else rank 0 writes the whole model in that format (fastllm or a Hugging Face
    architecture), asking `stop` (its signal, if it got one) before each tensor. Returns the
    signal that stopped the export, on every rank; the partial export is then removed.

    Nothing when the directory exists (a resumed run's earlier export): rank 0 decides for every
    rank, since it may have written the directory before another rank looks (which then
    skipped the export's collectives while rank 0 waited in them)."""
    exists = [directory.exists()]
    if trainer.distributed.world_size > 1:
        dist.broadcast_object_list(exists, src=0)
    if exists[0]:
        return None
    dataset = Path(trainer.config.data.path[0])  # its tokenizer files travel with the weights
    if output_format == "distributed":
        snapshot = Snapshot(
            kind="export",
            state=trainer.engine.sharded(("master",)),
            config=msgspec.to_builtins(trainer.config),
            counters={"step": trainer.engine.state.step},
        )
        trainer.checkpoints.save(
            snapshot,
            directory,
            before_commit=lambda partial: copy_tokenizer_files(dataset, partial),
        )
        return None
    # Every rank takes part (tensor slices are gathered, ZeRO-3 gathers each stage); rank 0
    # keeps the copies.
    main = trainer.distributed.is_main
    tensors = {
        name: t.detach().to("cpu", copy=True)
        for name, t in trainer.engine.whole_parameters()
        if main
    }
    failure: str | None = None
    stopped: signal.Signals | None = None
    if main:
        source = ModelSource(dataset, "fastllm", trainer.config.model.base_model, loaded=tensors)
        partial = directory.with_name(f".{directory.name}{PARTIAL_SUFFIX}")
        shutil.rmtree(partial, ignore_errors=True)
        asked = None if stop is None else lambda: stop() is not None
        try:
            write_model(source, partial, output_format, stop=asked)
            partial.rename(directory)
        except WriteStopped:
            shutil.rmtree(partial, ignore_errors=True)
            stopped = stop() if stop is not None else None
        except OSError as error:  # disk full, …: every rank stops, as for a checkpoint
            shutil.rmtree(partial, ignore_errors=True)
            failure = str(error)
    if trainer.distributed.world_size > 1:  # also holds the other ranks until it is written
        message = [(failure, stopped)]
        dist.broadcast_object_list(message, src=0)
        failure, stopped = message[0]
    if failure is not None:
        raise CheckpointWriteError(directory, failure)
    return stopped


def _frozen_names(trainer: Trainer) -> list[str]:
    frozen = trainer.engine.stages.frozen
    return [] if frozen is None else frozen.buffers.names


def _check_same_freeze(saved: SavedCheckpoint, freeze: FreezeConfig) -> None:
    """A checkpoint holds the parameters its run trained: another `model.freeze` is refused,
    naming the key (checkpoints written before `freeze` existed froze nothing)."""
    written = saved.manifest["config"].get("model", {}).get("freeze")
    before = msgspec.to_builtins(FreezeConfig() if written is None else written)
    now = msgspec.to_builtins(freeze)
    for key in now:
        if before.get(key) != now[key]:
            raise ConfigError(
                f"model.freeze.{key}",
                f"checkpoint {json.dumps(before.get(key))}, config {json.dumps(now[key])} (the "
                "checkpoint holds the parameters its run trained: set it back, or train in "
                "another run.experiment_dir)",
            )
