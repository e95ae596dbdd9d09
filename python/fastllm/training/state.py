"""Checkpoints, exports and resumption of a training run: where and when the loop writes the
engine's state (`engine.checkpointing` converts it), and the newest checkpoint resumed."""

from __future__ import annotations

import json
import shutil
import signal
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch.distributed as dist

from fastllm.checkpoint.compatibility import check_resume
from fastllm.checkpoint.distributed import SavedCheckpoint, Snapshot
from fastllm.checkpoint.errors import CheckpointWriteError, WriteStopped
from fastllm.checkpoint.fingerprint import fingerprint
from fastllm.checkpoint.formats import ModelSource, copy_tokenizer_files, open_model, write_model
from fastllm.checkpoint.saver import PARTIAL_SUFFIX, latest
from fastllm.config import ConfigError, TrainerConfig, build, registry
from fastllm.config.model import FreezeConfig
from fastllm.config.resume_changes import resume_warning
from fastllm.engine import checkpointing
from fastllm.model.lora import is_adapter

if TYPE_CHECKING:
    from fastllm.training.trainer import Trainer


def save_checkpoint(trainer: Trainer, directory: Path | None = None) -> Path:
    """Start writing a checkpoint of the full training state (default
    EXPERIMENT_DIR/checkpoint/STEP, pruned to `training.checkpoint.keep`)."""
    engine = trainer.engine
    if trainer.source_samples is not None:
        engine.state.data_source = trainer.source_samples.position(engine.state.consumed_samples)
    snapshot = checkpointing.to_snapshot(engine.state_dict(), msgspec.to_builtins(trainer.config))
    snapshot.components = registry.record(trainer.config)
    if _frozen_names(trainer):
        snapshot.counters["base"] = frozen_base(trainer)
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
        config, step = msgspec.to_builtins(trainer.config), saved.counters["step"]
        if changed := resume_warning(_filled(manifest["config"]), config, step):
            warnings.warn(changed, stacklevel=2)
    checkpointing.load(trainer.engine, saved)
    return directory


def _filled(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's config as today's config fills it (the defaults of keys added since it
    was written, which it did not change); as written if it no longer builds."""
    try:
        return msgspec.to_builtins(build(TrainerConfig, saved))
    except (ConfigError, TypeError):
        return saved


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
    if frozen and "base" in saved.manifest:  # written before bases were named: not checked
        _check_same_base(saved, frozen_base(trainer))
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
            components=registry.record(trainer.config),
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
    adapters_only = output_format == "peft"  # not a copy of the frozen base each time
    tensors = {
        name: t.detach().to("cpu", copy=True)
        for name, t in trainer.engine.whole_parameters()
        if main and (not adapters_only or is_adapter(name))
    }
    failure: str | None = None
    stopped: signal.Signals | None = None
    if main:
        source = ModelSource(dataset, "fastllm", trainer.config.model.base_model, loaded=tensors)
        pretrained = trainer.config.pretrained
        if output_format == "peft" and pretrained is not None:  # the names of its base's
            source.hf_config = open_model(pretrained.path, pretrained.format).hf_config
            source.base = pretrained.path
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
    return [name for group in trainer.engine.stages.frozen_groups for name in group.buffers.names]


def frozen_base(trainer: Trainer) -> dict[str, Any]:
    """Where a run's frozen weights come from, as its checkpoints name it: the fingerprint of
    `pretrained.path` (and of `pretrained.adapter`), or the seed they were drawn from."""
    if trainer.frozen_base is None:
        pretrained = trainer.config.pretrained
        if pretrained is None:
            trainer.frozen_base = {"seed": trainer.config.model.distributed.seed}
        else:
            trainer.frozen_base = {"pretrained": fingerprint(Path(pretrained.path))}
            if pretrained.adapter is not None:
                trainer.frozen_base["adapter"] = fingerprint(Path(pretrained.adapter))
    return trainer.frozen_base


def _check_same_base(saved: SavedCheckpoint, base: dict[str, Any]) -> None:
    """The frozen weights a checkpoint does not hold are read again as its run began: from
    the same files, or drawn from the same seed."""
    before = saved.manifest["base"]
    if before == base:
        return
    if "seed" in before or "seed" in base:
        key, was = "model.distributed.seed", before.get("seed", "a pretrained model")
        now = base.get("seed", "a pretrained model")
    else:
        key = (
            "pretrained.adapter"
            if before.get("pretrained") == base["pretrained"]
            else "pretrained.path"
        )
        was = now = None
    detail = f" (checkpoint {was}, config {now})" if was is not None else ""
    raise ConfigError(
        key,
        f"gives other frozen weights than the run of {saved.directory} had{detail}: its "
        "checkpoints hold the trained parameters only. Set it back, or train in another "
        "run.experiment_dir",
    )


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
