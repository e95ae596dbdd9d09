"""ZeRO-1/2: after the optimizer step, every rank's updated shard of each stage is
all-gathered into everyone's full compute weights, asynchronously and stage by stage in the
order the next forward pass runs them; a stage's forward pass waits only for its own stage
(forward pre-hooks on the stages' first modules, or the pipeline runner before each step), so
the gathers of later stages overlap the compute of the earlier ones."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastllm.engine.buffers import GroupBuffers
from fastllm.engine.update_fence import UpdateFence


class WeightRefresh:
    def __init__(self, buffers: GroupBuffers, fence: UpdateFence) -> None:
        """`fence`: what the gather of a stage's shard waits for of its update."""
        self.buffers, self.fence = buffers, fence
        self.pending: dict[int, tuple[Any, Tensor]] = {}
        """Per stage: its all-gather in flight, and the copy of this rank's shard it reads (the
        shard is a view of the buffer the gather writes)."""

    @torch.no_grad()
    def start(self) -> None:
        buffers = self.buffers
        self.wait_all()
        for stage, shard in buffers.shards.items():
            self.fence.wait(stage)
            source = shard.weight.clone()
            work = dist.all_gather_into_tensor(
                buffers.stages[stage].weights, source, group=buffers.data.group, async_op=True
            )
            self.pending[stage] = (work, source)

    def wait(self, stage: int) -> None:
        pending = self.pending.pop(stage, None)
        if pending is not None:
            pending[0].wait()

    def wait_all(self) -> None:
        for stage in list(self.pending):
            self.wait(stage)

    def install_hooks(self, modules: list[list[torch.nn.Module]]) -> None:
        """Each stage's forward pass waits for its weights (the last stage's tied head reads
        the embedding's, which the first stage waited for)."""
        for stage, stage_modules in enumerate(modules):
            if stage in self.buffers.shards:
                stage_modules[0].register_forward_pre_hook(self._hook(stage))

    def _hook(self, stage: int):
        def hook(_module: torch.nn.Module, _args: Any) -> None:
            self.wait(stage)

        return hook
