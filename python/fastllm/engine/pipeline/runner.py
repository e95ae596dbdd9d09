"""Runs one rank's `Program` of a training step: its stages' forward and backward passes on
its micro-batches (or their pieces: `schedule.micro_batch_splits`), the transfers of
activations and input gradients with the neighbouring pipeline ranks, and the ZeRO gathers
and reductions the program places.

Each stage is an autograd graph of its own: its input is a leaf that requires a gradient,
and its backward pass is `torch.autograd.backward` from the received output gradient (the
last stage: from its loss, weighted by the micro-batch's share of the batch's tokens and the
loss scale). A stage's saved activations are dropped as soon as its backward pass is done.
A piece's attention reads the earlier pieces' keys and values from the micro-batch's
`StagedKeyValueMemory`, and a stage's backward pass of a piece also starts from the gradients
the later pieces gave its keys and values.
Transfers run in the program's order: blocking receives, sends started asynchronously (one
at a time in that order, never batched: Gloo-safe) and waited for at the end of the step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from fastllm.config.layout import StepShape
from fastllm.engine.micro_sequences import PieceCache, StagedKeyValueMemory
from fastllm.engine.model_stages import ModelStages
from fastllm.engine.pipeline.schedule import Op, Program, Step, build_programs, dependency
from fastllm.engine.stages import stages_read
from fastllm.model.gpt import Context, GPTModel
from fastllm.parallel import point_to_point

MicroBatch = tuple[Tensor, Tensor, Tensor | None]
"""Token ids, labels and attention document ids (None: plain causal) of a micro-batch or of
one piece of it (its document ids then from the start of the sequences), on the device."""
MakeContext = Callable[[MicroBatch, PieceCache | None], Context]
"""The context of a micro-batch (or piece, with the cache of its micro-batch's pieces)."""


@dataclass
class _Saved:
    """What a stage's forward pass keeps for its backward pass."""

    input: Tensor | None
    """The stage's input leaf (None for the first stage: it reads token ids)."""
    output: Tensor
    """The residual stream it hands on, or its weighted loss (the last stage)."""
    auxiliary: Tensor | None
    """Its blocks' auxiliary losses, weighted (MoE routers)."""


class PipelineRunner:
    def __init__(
        self,
        model: GPTModel,
        stages: ModelStages,
        shape: StepShape,
        *,
        zero_stage: int,
        activation_shape: tuple[int, ...],
    ) -> None:
        """`activation_shape`: what a stage hands the next one for one micro-batch (batch,
        sequence on this tensor rank, hidden)."""
        self.model, self.stages, self.shape = model, stages, shape
        self.num_layers = len(model.layers)
        self.pipeline = stages.mesh.pipeline
        self.activation_shape = activation_shape
        gatherer = stages.dense.gatherer
        programs = build_programs(
            shape,
            zero_stage=zero_stage,
            gather_weights=gatherer is not None,
            needs=gatherer.needs if gatherer is not None else None,
        )
        self.program: Program = programs[self.pipeline.rank]
        self.trace: list[Op] | None = None
        """When a list, every op run is appended to it (tests compare it with the program)."""

    def _needs(self, stage: int) -> list[int]:
        """The stages whose weights running `stage` reads."""
        return sorted(stages_read(stage, self.shape.num_stages, self.stages.tied_here))

    def _global(self, pipeline_rank: int) -> int:
        return dist.get_global_rank(self.pipeline.group, pipeline_rank)

    def _context(
        self,
        pieces: Sequence[MicroBatch],
        piece: int,
        memory: StagedKeyValueMemory | None,
        make_context: MakeContext,
    ) -> Context:
        start = piece * pieces[0][0].shape[1]
        return make_context(pieces[piece], None if memory is None else memory.piece(piece, start))

    def run(
        self,
        micro_batches: Sequence[Sequence[MicroBatch]],
        weights: Sequence[Sequence[float]],
        loss_scale: float,
        make_context: MakeContext,
    ) -> Tensor:
        """Run the step's program on the micro-batches, each given as its pieces (one without
        `schedule.micro_batch_splits`), each piece with its share of the batch's trained
        tokens; returns this rank's part of the weighted loss (the last stage's losses and
        every stage's auxiliary losses, each times its piece's weight): summed over the
        pipeline ranks, the step's loss."""
        stages, shape = self.stages, self.shape
        assert len(micro_batches) == shape.micro_batches
        assert all(len(pieces) == shape.pieces for pieces in micro_batches)
        memories: dict[int, StagedKeyValueMemory | None] = {}
        contexts: dict[tuple[int, int], Context] = {}
        produced: dict[Step, Tensor] = {}
        saved: dict[Step, _Saved] = {}
        sends: list[point_to_point.Sent] = []
        loss = torch.zeros((), dtype=torch.float32, device=stages.device)
        last = shape.num_stages - 1
        for op in self.program.ops:
            if self.trace is not None:
                self.trace.append(op)
            if op.kind == "gather":
                stages.prefetch_weights(op.stage)
            elif op.kind == "release":
                stages.release_weights(op.stage)
            elif op.kind == "recv":
                assert op.step is not None
                buffer = torch.empty(
                    self.activation_shape, dtype=stages.compute_dtype, device=stages.device
                )
                produced[op.step] = point_to_point.recv(buffer, self._global(op.peer))
            elif op.kind == "send":
                assert op.step is not None
                sends.append(point_to_point.isend(produced.pop(op.step), self._global(op.peer)))
            else:
                step = op.step
                assert step is not None
                m, p = step.micro_batch, step.piece
                for stage in self._needs(step.stage):
                    stages.wait_for_weights(stage)
                if m not in memories:
                    memories[m] = StagedKeyValueMemory() if shape.pieces > 1 else None
                memory = memories[m]
                if step.forward:
                    if (m, p) not in contexts:
                        contexts[(m, p)] = self._context(micro_batches[m], p, memory, make_context)
                    scale = weights[m][p] * loss_scale
                    saved[step], value = self._forward(
                        step, micro_batches[m][p], contexts[(m, p)], produced, scale, last
                    )
                    loss += weights[m][p] * value
                else:
                    forward = Step(step.stage, m, True, p)
                    self._backward(step, saved.pop(forward), produced, op.reduce, memory)
                    if step.stage == self.shape.stages_of(self.pipeline.rank)[0]:
                        contexts.pop((m, p), None)
                        if p == 0:
                            memories.pop(m, None)
        for sent in sends:
            sent.wait()
        stages.finish_step_backward()
        return loss

    def _forward(
        self,
        step: Step,
        micro_batch: MicroBatch,
        context: Context,
        produced: dict[Step, Tensor],
        scale: float,
        last: int,
    ) -> tuple[_Saved, Tensor]:
        """The stage's forward pass: what it saves, and its unweighted loss contribution."""
        input_ids, labels, _ = micro_batch
        first_position, last_position = self.stages.stages[step.stage].positions
        leaf = None
        if step.stage == 0:
            x = input_ids
        else:
            need = dependency(step, self.shape.num_stages)
            assert need is not None
            leaf = produced.pop(need).detach().requires_grad_(True)
            x = leaf
        out, auxiliary = self.model.run_positions(
            first_position, last_position, x, context, labels if step.stage == last else None
        )
        value = torch.zeros((), dtype=torch.float32, device=out.device)
        if auxiliary is not None:
            value = value + auxiliary.detach().float()
            auxiliary = auxiliary * scale
        if step.stage == last:
            value = value + out.detach().float()
            return _Saved(leaf, out * scale, auxiliary), value
        produced[step] = out.detach()
        return _Saved(leaf, out, auxiliary), value

    def _backward(
        self,
        step: Step,
        saved: _Saved,
        produced: dict[Step, Tensor],
        reduce: bool,
        memory: StagedKeyValueMemory | None,
    ) -> None:
        stages = self.stages
        tensors: list[Tensor] = [saved.output]
        grads: list[Tensor | None] = [None]
        if step.stage != self.shape.num_stages - 1:
            need = dependency(step, self.shape.num_stages)
            assert need is not None
            grads = [produced.pop(need)]
        if saved.auxiliary is not None:
            tensors.append(saved.auxiliary)
            grads.append(None)
        if memory is not None:
            first, last = stages.stages[step.stage].positions
            layers = range(max(first, 1) - 1, min(last, self.num_layers))
            keys_values, their_grads = memory.backward_roots(layers, step.piece)
            tensors += keys_values
            grads += their_grads
        stages.arm_reduction(reduce)
        torch.autograd.backward(tensors, grads)
        stages.finish_stage_backward(step.stage, reduce)
        if saved.input is not None:
            assert saved.input.grad is not None
            produced[step] = saved.input.grad

    @torch.no_grad()
    def evaluate(
        self,
        micro_batches: Sequence[Sequence[MicroBatch]],
        weights: Sequence[Sequence[float]],
        make_context: MakeContext,
    ) -> Tensor:
        """Forward passes only (validation): each piece of each micro-batch through the stages
        in turn, its activations handed on by blocking transfers in that one global order.
        Returns this rank's part of the weighted loss, as `run` does."""
        stages, shape = self.stages, self.shape
        last = shape.num_stages - 1
        loss = torch.zeros((), dtype=torch.float32, device=stages.device)
        for m, pieces in enumerate(micro_batches):
            memory = StagedKeyValueMemory() if shape.pieces > 1 else None
            for p, piece in enumerate(pieces):
                context = self._context(pieces, p, memory, make_context)
                produced: dict[Step, Tensor] = {}
                for stage in range(shape.num_stages):
                    rank, step = shape.rank_of(stage), Step(stage, m, True, p)
                    previous = shape.rank_of(stage - 1) if stage else rank
                    mine = rank == self.pipeline.rank
                    if stage and previous != rank:
                        need = Step(stage - 1, m, True, p)
                        if previous == self.pipeline.rank:
                            point_to_point.send(produced.pop(need), self._global(rank))
                        elif mine:
                            buffer = torch.empty(
                                self.activation_shape,
                                dtype=stages.compute_dtype,
                                device=stages.device,
                            )
                            produced[need] = point_to_point.recv(buffer, self._global(previous))
                    if not mine:
                        continue
                    for needed in self._needs(stage):
                        stages.wait_for_weights(needed)
                    _, value = self._forward(step, piece, context, produced, 1.0, last)
                    loss += weights[m][p] * value
                    stages.release_weights()
        return loss
