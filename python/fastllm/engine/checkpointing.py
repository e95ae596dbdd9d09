"""The engine's state as plain data and as a checkpoint: `TrainingState` (the counters a run
advances), `EngineState` (those, the loss scale, the per-rank RNG streams and FP8 amax histories,
and the sharded tensors), and their conversion to and from the checkpoint format's `Snapshot`
and `SavedCheckpoint`. The format is `checkpoint/`'s; the loop (`training/`) only says when."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fastllm.checkpoint.distributed import STATE_KINDS, SavedCheckpoint, ShardedState, Snapshot
from fastllm.config import ConfigError
from fastllm.engine.buffers import ALIGNMENT, GroupBuffers, Shard
from fastllm.engine.model_stages import ModelStages

if TYPE_CHECKING:
    from fastllm.engine.engine import Engine


@dataclass
class TrainingState:
    """Where a run is: plain numbers, advanced by `Engine.train_step`."""

    step: int = 0
    """Optimizer steps completed (skipped ones included)."""
    consumed_samples: int = 0
    """Samples of the training data trained on (where the data loader resumes)."""
    skipped_steps: int = 0
    """Steps whose update was skipped (a gradient that was not finite)."""
    data_source: dict[str, Any] | None = None
    """Where `data.source` is after `consumed_samples` (plain data; None without one)."""


@dataclass
class EngineState:
    """What `Engine.state_dict` gives and `Engine.load_state_dict` takes."""

    training: TrainingState
    optimizer_steps: int
    """AdamW's update count (its bias correction)."""
    loss_scaler: dict[str, Any]
    per_rank: dict[str, Tensor]
    """This rank's RNG streams (`rng.*`) and FP8 amax histories (`fp8.*`); what a checkpoint
    written with another layout lacks stays as it is."""
    sharded: ShardedState
    """The flat buffers' shards (views, or writable copies to restore into)."""


FP8_PREFIX = "fp8."
"""The amax histories of delayed FP8 scaling, per rank (each scales its own activations)."""


def sharded_state(
    stages: ModelStages, kinds: tuple[str, ...], writable: bool = False
) -> ShardedState:
    """The engine's shards of `kinds`, as views (with expert parallelism, the experts' in
    `experts`); split masters as fp32 copies made now (`writable`, to restore into) or as
    they are saved (`_shard_state`). The last offloaded update is done first: its copies
    back, and the weights it wrote."""
    stages.fence.wait_for_state()
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


def to_snapshot(state: EngineState, config: dict[str, Any]) -> Snapshot:
    """A checkpoint of `state` (`config`: the run's, as plain data) for `CheckpointSaver`."""
    training = state.training
    return Snapshot(
        kind="checkpoint",
        state=state.sharded,
        config=config,
        counters={
            "step": training.step,
            "optimizer_steps": state.optimizer_steps,
            "consumed_samples": training.consumed_samples,
            "skipped_steps": training.skipped_steps,
            "loss_scaler": state.loss_scaler,
            **({} if training.data_source is None else {"data_source": training.data_source}),
        },
        extra=state.per_rank,
    )


@torch.no_grad()
def load(engine: Engine, saved: SavedCheckpoint) -> None:
    """Restore `engine` from a checkpoint, whatever tensor and data sizes wrote it. RNG streams
    and amax histories are per rank: with another layout they are left as they are (the
    histories then start afresh: a step of current scaling, then delayed again)."""
    state = engine.state_dict(writable=True)
    saved.restore(state.sharded, STATE_KINDS)
    counters = saved.counters
    state.training = TrainingState(
        step=counters["step"],
        consumed_samples=counters["consumed_samples"],
        skipped_steps=counters["skipped_steps"],
        data_source=counters.get("data_source"),
    )
    state.optimizer_steps = counters["optimizer_steps"]
    state.loss_scaler = counters["loss_scaler"]
    per_rank: dict[str, Tensor] = {}
    if saved.same_layout(state.sharded):
        for key in state.per_rank:
            tensor = saved.rank_tensor(state.sharded.rank, key)
            if tensor is not None:
                per_rank[key] = tensor
    state.per_rank = per_rank
    try:
        engine.load_state_dict(state)
    except ValueError as error:
        raise ConfigError(
            str(saved.directory),
            f"{FP8_PREFIX}{error}: written with another model or "
            "model.distributed.fp8_amax_history_length",
        ) from None
