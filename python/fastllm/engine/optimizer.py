"""AdamW over the flat shards: one fused kernel call per contiguous run of the same weight
decay, gradient clipping by global norm, and skipping of steps whose gradients are not finite.
With `offload_optimizer` the state comes from host memory chunk by chunk
(engine/offloaded_optimizer.py), each chunk updated by the same kernel, stage by stage on a
side stream that the next step's use of each stage waits for (engine/update_fence.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastllm.config.training import OptimizerConfig
from fastllm.engine.buffers import Shard
from fastllm.engine.model_stages import ModelStages
from fastllm.engine.offloaded_optimizer import CHUNK, OffloadedState, StateSpan
from fastllm_kernels.adam import adamw_step_


@dataclass(frozen=True)
class StepReport:
    grad_norm: float
    """Global norm of the (unscaled, unclipped) gradient."""
    skipped: bool
    """True when the gradient had inf/NaN and the step was not taken."""


class AdamW:
    def __init__(self, stages: ModelStages, config: OptimizerConfig, chunk: int = CHUNK) -> None:
        """`chunk`: elements per streamed chunk of state in host memory (`offload_optimizer`)."""
        self.stages, self.config = stages, config
        self.step_count = 0
        """Optimizer steps taken (skipped ones excluded); Adam's bias correction uses it."""
        self.offloaded = (
            OffloadedState(self._shards(), stages.device, stages.fence, chunk)
            if stages.offload_optimizer
            else None
        )
        """With `offload_optimizer`: the state's way through the device."""

    @torch.no_grad()
    def grad_norm(self, grad_scale: float) -> float:
        """Over the whole model: every data rank's shards, every tensor rank's slices, every
        pipeline rank's stages, and the parameters replicated over tensor ranks once (on
        tensor rank 0). With expert parallelism the data group holds each expert's shards
        once too: an expert group's ranks split the experts, the expert-data ranks their
        shards."""
        mesh = self.stages.mesh
        squares = torch.zeros((), dtype=torch.float32, device=self.stages.device)
        counts_replicated = mesh.tensor.rank == 0
        for shard in self._shards():
            grad = shard.grad if counts_replicated else shard.grad[shard.replicated :]
            squares += torch.linalg.vector_norm(grad, dtype=torch.float32).square()
        for dimension in (mesh.data, mesh.tensor, mesh.pipeline):
            if dimension.size > 1:
                dist.all_reduce(squares, group=dimension.group)
        return math.sqrt(squares.item()) * grad_scale

    @torch.no_grad()
    def step(self, lr: float, loss_scale: float = 1.0) -> StepReport:
        """Update this rank's shards from the gradients (which carry `loss_scale`)."""
        self.stages.reduce_gradients()
        norm = self.grad_norm(1.0 / loss_scale)
        if not math.isfinite(norm):
            return StepReport(norm, skipped=True)
        clip = self.config.gradient_norm_clipping
        clip_factor = min(1.0, clip / (norm + 1e-6)) if clip is not None else 1.0
        self.step_count += 1
        grad_scale = clip_factor / loss_scale
        if self.offloaded is None:
            for shard in self._shards():
                self._update(shard, StateSpan.whole(shard), lr, grad_scale)
        else:  # stage by stage beside the next step (engine/update_fence.py)
            self.offloaded.update(
                self._stage_shards(),
                lambda shard, span: self._update(shard, span, lr, grad_scale),
            )
        if self.stages.mixed_precision:
            # The kernel wrote the compute weights behind autograd's back: a new version tells
            # the caches keyed by it (the FP8 weight copies) that they changed.
            for stage in self.stages.stages:
                for buffer in stage.buffers:
                    torch.autograd.graph.increment_version(buffer.weights)
        return StepReport(norm, skipped=False)

    def _update(self, shard: Shard, span: StateSpan, lr: float, grad_scale: float) -> None:
        """AdamW on the elements of `span`, one kernel call per run of one weight decay."""
        mixed_precision = self.stages.mixed_precision
        for run_start, run_end, decay in shard.decay_runs:
            start, end = max(run_start, span.start), min(run_end, span.end)
            if start >= end:
                continue
            state = slice(start - span.start, end - span.start)
            adamw_step_(
                None if span.master is None else span.master[state],
                shard.grad[start:end],
                span.exp_avg[state],
                span.exp_avg_sq[state],
                lr=lr,
                beta_1=self.config.beta_1,
                beta_2=self.config.beta_2,
                eps=self.config.epsilon,
                weight_decay=self.config.weight_decay if decay else 0.0,
                step=self.step_count,
                compute_copy=shard.weight[start:end] if mixed_precision else None,
                grad_scale=grad_scale,
                master_low=None if span.master_low is None else span.master_low[state],
            )

    def _shards(self) -> list[Shard]:
        return [shard for group in self.stages.groups for shard in group.buffers.shards.values()]

    def _stage_shards(self) -> list[tuple[int, list[Shard]]]:
        """This rank's stages in the order its forward passes run them, each with its shard
        of every group."""
        groups = [group.buffers.shards for group in self.stages.groups]
        return [
            (stage, [shards[stage] for shards in groups if stage in shards])
            for stage in sorted({stage for shards in groups for stage in shards})
        ]
