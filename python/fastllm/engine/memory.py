"""The bytes this rank's parameter buffers hold, by kind: what an out-of-memory report puts
beside the activations, whose share is the rest of the peak (and, apart, the optimizer state
held in host memory)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from fastllm.engine.model_stages import ModelStages
from fastllm.engine.optimizer import AdamW


@dataclass(frozen=True)
class BufferMemory:
    weights: int
    """The compute weights this rank keeps, frozen ones included (ZeRO-3: its shards; a stage
    gathered to run takes its whole size more while it runs)."""
    gradients: int
    """The fp32 gradients once a step's backward pass wrote them (ZeRO-2/3: the two pooled
    stage buffers and this rank's shards)."""
    optimizer: int
    """The fp32 master weights (with bf16 compute weights, their low halves) and the two Adam
    moments of this rank's shards; with `offload_optimizer` only the two chunks of them being
    streamed through the device."""
    host_optimizer: int = 0
    """With `offload_optimizer`: the masters and moments, in host memory."""


def buffer_memory(stages: ModelStages, optimizer: AdamW) -> BufferMemory:
    weights = gradients = state_bytes = 0
    for group in stages.groups:
        buffers = group.buffers
        gradients += buffers.gradients.held_bytes
        for stage, shard in buffers.shards.items():
            held = shard.weight if buffers.shard_weights else buffers.stages[stage].weights
            weights += _bytes(held)
            if buffers.shard_gradients:
                gradients += _bytes(shard.grad)
            state = [shard.exp_avg, shard.exp_avg_sq, shard.master_low]
            if buffers.mixed_precision:  # in fp32 training the masters are the weights
                state.append(shard.master)
            state_bytes += sum(_bytes(t) for t in state if t is not None)
    for group in stages.frozen_groups:
        frozen = group.buffers
        held = (
            frozen.weight_shards.values()
            if frozen.shard_weights
            else (frozen.stages[s].weights for s in frozen.owned)
        )
        weights += sum(_bytes(t) for t in held)
    if optimizer.offloaded is None:
        return BufferMemory(weights, gradients, state_bytes)
    return BufferMemory(weights, gradients, optimizer.offloaded.device_bytes, state_bytes)


def _bytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()
