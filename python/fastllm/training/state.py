"""Checkpoints, exports and resumption of a training run: the trainer's state as a snapshot
for `checkpoint/` to write, and what a checkpoint restores applied back to the trainer."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch
import torch.distributed as dist
from torch import Tensor

from fastllm.checkpoint.distributed import STATE_KINDS, SavedCheckpoint, ShardedState, Snapshot
from fastllm.checkpoint.errors import CheckpointWriteError
from fastllm.checkpoint.formats import ModelSource, copy_tokenizer_files, write_model
from fastllm.checkpoint.saver import PARTIAL_SUFFIX, latest
from fastllm.config import ConfigError
from fastllm.config.resume_changes import resume_warning
from fastllm.engine.buffers import ALIGNMENT, GroupBuffers, Shard
from fastllm.engine.data_parallel import gather_weights
from fastllm.engine.model_stages import ModelStages
from fastllm.engine.weights_io import whole_parameters

if TYPE_CHECKING:
    from fastllm.training.trainer import Trainer


def sharded_state(
    stages: ModelStages, kinds: tuple[str, ...], writable: bool = False
) -> ShardedState:
    """The engine's shards of `kinds`, as views (with expert parallelism, the experts' in
    `experts`); split masters as fp32 copies made now (`writable`, to restore into) or as
    they are saved (`_shard_state`)."""
    state = _group_state(stages.dense.buffers, kinds, writable)
    if stages.experts is not None:
        expert = stages.mesh.expert
        state.expert_size, state.expert_rank = expert.size, expert.rank
        state.experts = _group_state(stages.experts.buffers, kinds, writable)
    return state


def _group_state(buffers: GroupBuffers, kinds: tuple[str, ...], writable: bool) -> ShardedState:
    return ShardedState(
        specs=buffers.specs,
        shapes={name: tuple(buffers.shapes[name]) for name in buffers.names},
        splits={name: buffers.metas[name].tensor_split for name in buffers.names},
        alignment=ALIGNMENT,
        tensor_size=buffers.tensor.size,
        tensor_rank=buffers.tensor.rank,
        data_size=buffers.data.size,
        data_rank=buffers.data.rank,
        shards={
            stage: {kind: _shard_state(shard, kind, writable) for kind in kinds}
            for stage, shard in buffers.shards.items()
        },
        pipeline_size=buffers.pipeline.size,
        pipeline_rank=buffers.pipeline.rank,
    )


def _shard_state(shard: Shard, kind: str, writable: bool) -> Tensor | Callable[[], Tensor]:
    """A view of the shard's `kind`. Split masters have none: to be restored into, a new fp32
    tensor (`restore_split_masters` stores it back); to be saved, the function making it, so
    that a checkpoint holds one stage's at a time."""
    if kind != "master" or shard.master_low is None:
        return getattr(shard, kind)
    return shard.master_values() if writable else shard.master_values


def restore_split_masters(stages: ModelStages, state: ShardedState) -> None:
    """Store the restored masters of `state` (made `writable`) into the split shards."""
    for (part, _), group in zip(state.parts(), stages.groups, strict=True):
        for stage, shard in group.buffers.shards.items():
            if shard.master_low is not None and "master" in part.shards[stage]:
                masters = part.shards[stage]["master"]
                assert isinstance(masters, torch.Tensor)
                shard.set_master(0, masters)


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"rng.cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["rng.cuda"] = torch.cuda.get_rng_state(device)
    return state


FP8_PREFIX = "fp8."
"""The amax histories of delayed FP8 scaling, per rank (each scales its own activations)."""


def _fp8_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    histories = trainer.fp8_histories
    if histories is None:
        return {}
    return {FP8_PREFIX + key: t.detach().clone() for key, t in histories.state().items()}


def save_checkpoint(trainer: Trainer, directory: Path | None = None) -> Path:
    """Start writing a checkpoint of the full training state (default
    EXPERIMENT_DIR/checkpoint/STEP, pruned to `training.checkpoint.keep`)."""
    snapshot = Snapshot(
        kind="checkpoint",
        state=sharded_state(trainer.stages, STATE_KINDS),
        config=msgspec.to_builtins(trainer.config),
        counters={
            "step": trainer.step,
            "optimizer_steps": trainer.optimizer.step_count,
            "consumed_samples": trainer.consumed_samples,
            "skipped_steps": trainer.skipped_steps,
            "loss_scaler": trainer.scaler.state_dict(),
        },
        extra={**_rng_state(trainer.distributed.device), **_fp8_state(trainer)},
    )
    final = directory or trainer.experiment_dir / "checkpoint" / str(trainer.step)
    keep = trainer.config.training.checkpoint.keep if directory is None else None
    return trainer.checkpoints.save(snapshot, final, keep=keep)


def resume(trainer: Trainer) -> Path | None:
    found = latest(trainer.experiment_dir / "checkpoint")
    if found is None:
        return None
    directory, manifest, problems = found
    if trainer.distributed.is_main:
        for problem in problems:
            warnings.warn(f"skipping a bad checkpoint: {problem}", stacklevel=2)
        if changed := resume_warning(manifest["config"], msgspec.to_builtins(trainer.config)):
            warnings.warn(changed, stacklevel=2)
    load_checkpoint(trainer, directory, manifest)
    return directory


@torch.no_grad()
def load_checkpoint(trainer: Trainer, directory: Path, manifest: dict | None = None) -> None:
    """Restore the full training state, whatever tensor and data sizes wrote it. `manifest` is
    given when the checkpoint was just verified."""
    saved = SavedCheckpoint(directory, manifest)
    state = sharded_state(trainer.stages, STATE_KINDS, writable=True)
    saved.restore(state, STATE_KINDS)
    restore_split_masters(trainer.stages, state)
    trainer.stages.sync_weights_from_master()
    gather_weights(trainer.stages)  # the other ranks' shards of the compute weights
    counters = saved.counters
    trainer.step = counters["step"]
    trainer.optimizer.step_count = counters["optimizer_steps"]
    trainer.consumed_samples = counters["consumed_samples"]
    trainer.skipped_steps = counters["skipped_steps"]
    trainer.scaler.load_state_dict(counters["loss_scaler"])
    # RNG streams and amax histories are per rank: with another layout the histories start
    # afresh (a step of current scaling, then delayed again).
    if saved.same_layout(state):
        _load_fp8_state(trainer, saved, state.rank)
        device = trainer.distributed.device
        cpu = saved.rank_tensor(state.rank, "rng.cpu")
        if cpu is not None:
            torch.set_rng_state(cpu)
        cuda = saved.rank_tensor(state.rank, "rng.cuda")
        if device.type == "cuda" and cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


def _load_fp8_state(trainer: Trainer, saved: SavedCheckpoint, rank: int) -> None:
    histories = trainer.fp8_histories
    if histories is None:
        return
    loaded = {key: saved.rank_tensor(rank, FP8_PREFIX + key) for key in histories.state()}
    if all(t is not None for t in loaded.values()):
        try:
            histories.load_state(loaded)  # type: ignore[arg-type]
        except ValueError as error:
            raise ConfigError(
                str(saved.directory),
                f"{FP8_PREFIX}{error}: written with another model or "
                "model.distributed.fp8_amax_history_length",
            ) from None


def export(trainer: Trainer, directory: Path, output_format: str) -> None:
    """Write the model weights: `distributed` (fp32 shards, every rank), else rank 0 writes the
    whole model in that format (fastllm or a Hugging Face architecture)."""
    if directory.exists():
        return
    dataset = Path(trainer.config.data.path[0])  # its tokenizer files travel with the weights
    if output_format == "distributed":
        snapshot = Snapshot(
            kind="export",
            state=sharded_state(trainer.stages, ("master",)),
            config=msgspec.to_builtins(trainer.config),
            counters={"step": trainer.step},
        )
        trainer.checkpoints.save(
            snapshot,
            directory,
            before_commit=lambda partial: copy_tokenizer_files(dataset, partial),
        )
        trainer.checkpoints.wait()
        return
    # Every rank takes part (tensor slices are gathered, ZeRO-3 gathers each stage); rank 0
    # keeps the copies.
    main = trainer.distributed.is_main
    tensors = {
        name: t.detach().to("cpu", copy=True)
        for name, t in whole_parameters(trainer.stages)
        if main
    }
    failure: str | None = None
    if main:
        source = ModelSource(dataset, "fastllm", trainer.config.model.base_model, loaded=tensors)
        partial = directory.with_name(f".{directory.name}{PARTIAL_SUFFIX}")
        shutil.rmtree(partial, ignore_errors=True)
        try:
            write_model(source, partial, output_format)
            partial.rename(directory)
        except OSError as error:  # disk full, …: every rank stops, as for a checkpoint
            shutil.rmtree(partial, ignore_errors=True)
            failure = str(error)
    if trainer.distributed.world_size > 1:  # also holds the other ranks until it is written
        message = [failure]
        dist.broadcast_object_list(message, src=0)
        failure = message[0]
    if failure is not None:
        raise CheckpointWriteError(directory, failure)
