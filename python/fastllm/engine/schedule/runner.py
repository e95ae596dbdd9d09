"""Runs one rank's `Program` of a training step, every step, one stage or many: its stages'
forward and backward passes on its micro-batches (or their pieces: `schedule.micro_batch_splits`),
the transfers of activations and input gradients with the neighbouring pipeline ranks, and the
ZeRO gathers and reductions the program places. The loss is weighted here and only here: each
piece's loss times its share of the global batch's trained tokens (`engine.batch`) and the loss
scale.

Without pipeline parallelism or breadth-first micro-batches, the program has one stage spanning
the whole model (`whole`): the stages' module hooks drive the ZeRO-3 gathers and the ZeRO-1/2
weight refreshes, a micro-batch is one autograd graph (its pieces' keys and values in a
`KeyValueMemory`) and its backward pass runs once, at its first piece's backward op, reducing
the gradients when the program says so (ZeRO-1: the step's last; ZeRO-2/3: every one).

Otherwise each stage is an autograd graph of its own: its input is a leaf that requires a
gradient, and its backward pass is `torch.autograd.backward` from the received output gradient
(the last stage: from its weighted loss). A stage's saved activations are dropped as soon as
its backward pass is done. A piece's attention reads the earlier pieces' keys and values from
the micro-batch's `StagedKeyValueMemory`, and a stage's backward pass of a piece also starts
from the gradients the later pieces gave its keys and values.
Transfers run in the program's order: blocking receives, sends started asynchronously (one
at a time in that order, never batched: Gloo-safe) and waited for at the end of the step.

Reference models (`engine.reference`) run in the same steps: each forward step runs their
same stage first, without autograd, and a forward transfer carries their outputs after the
trained model's activation, to the same peer (so they add no op to the program); the last
stage hands their final hidden states to the losses. With pieces, each reference model keeps
its own keys and values of the earlier pieces, and the losses that read whole answers (DPO)
run at a micro-batch's last piece (`AnswerStates`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

from fastllm.config.layout import StepShape
from fastllm.config.model import DistillationLossConfig, DPOLossConfig, LabelLossConfig, Loss
from fastllm.engine.batch import MicroBatch, Pairs
from fastllm.engine.micro_sequences import (
    AnswerStates,
    KeyValueMemory,
    PieceCache,
    StagedKeyValueMemory,
)
from fastllm.engine.model_stages import ModelStages
from fastllm.engine.reference import ReferenceModel
from fastllm.engine.schedule.program import Op, Program, Step, build_programs, dependency
from fastllm.engine.stages import stages_read
from fastllm.model.gpt import Context, GPTModel
from fastllm.model.head_losses import HeadTargets, Teacher, head_losses
from fastllm.parallel import point_to_point
from fastllm_kernels.preference import DPO_METRICS

Memory = KeyValueMemory | StagedKeyValueMemory


@dataclass
class _Pieces:
    """What a micro-batch's pieces leave for the later ones (`engine.micro_sequences`)."""

    memory: Memory
    """The trained model's keys and values."""
    references: dict[str, Memory]
    """Each reference model's."""
    answers: AnswerStates | None
    """The final hidden states, when a loss reads whole answers (DPO)."""


@dataclass
class _Saved:
    """What a stage's forward pass keeps for its backward pass."""

    input: Tensor | None
    """The stage's input leaf (None for the first stage: it reads token ids)."""
    output: Tensor
    """The residual stream it hands on, or its weighted loss (the last stage)."""
    auxiliary: Tensor | None
    """Its blocks' auxiliary losses, weighted (MoE routers)."""


class StepRunner:
    def __init__(
        self,
        model: GPTModel,
        stages: ModelStages,
        shape: StepShape,
        *,
        zero_stage: int,
        activation_shape: tuple[int, ...],
        losses: Mapping[str, Loss] | None = None,
        references: Mapping[str, ReferenceModel] | None = None,
    ) -> None:
        """`shape`: the step's (one stage for the whole model: `whole`). `activation_shape`:
        what a stage hands the next one for one micro-batch (batch, sequence on this tensor
        rank, hidden). `losses`: the head's, by name (default: the label loss); `references`:
        the reference models they read, by name."""
        self.model, self.stages, self.shape = model, stages, shape
        self.losses = dict(losses or {"label": LabelLossConfig()})
        self.references = dict(references or {})
        self._distilled = {
            loss.reference_model
            for loss in self.losses.values()
            if isinstance(loss, DistillationLossConfig)
        }
        """The reference models whose hidden states a loss reads."""
        self._precomputed = {
            loss.reference_model
            for loss in self.losses.values()
            if isinstance(loss, DPOLossConfig) and loss.reference_log_probs == "precomputed"
        }
        """The reference models whose log-probabilities come with the batches' pairs."""
        self._answer_losses = {
            name for name, loss in self.losses.items() if isinstance(loss, DPOLossConfig)
        }
        """The losses that read whole answers: with pieces, run once the last one is through."""
        dpo = any(isinstance(loss, DPOLossConfig) for loss in self.losses.values())
        self.named_keys = [*self.losses, *(DPO_METRICS if dpo else ())]
        """What `named_losses` holds, in a fixed order: the losses, then DPO's metrics."""
        self.named_losses: dict[str, Tensor] = {}
        """After `run` or `evaluate`: this rank's part of each loss (weighted as the total is),
        by name."""
        self.num_layers = len(model.layers)
        self.pipeline = stages.mesh.pipeline
        self.activation_shape = activation_shape
        self.whole = shape.num_stages == 1
        """One stage spanning the whole model; its gathers and refreshes driven by the stages'
        module hooks (`ModelStages(gather_in_forward=True)`)."""
        self.zero_stage = zero_stage
        self._programs: dict[int, Program] = {}
        """This rank's program by the number of micro-batches it runs."""
        self.program = self._program(shape.micro_batches)
        """The program of a step."""
        self.trace: list[Op] | None = None
        """When a list, every op run is appended to it (tests compare it with the program)."""

    def _program(self, micro_batches: int) -> Program:
        """This rank's program for `micro_batches` (a multiple of the breadth-first ones)."""
        program = self._programs.get(micro_batches)
        if program is None:
            shape = self.shape
            if micro_batches % shape.breadth_first:
                raise ValueError(
                    f"{micro_batches} micro-batches: a multiple of the {shape.breadth_first} "
                    "breadth-first ones is needed"
                )
            shape = replace(shape, depth_first=micro_batches // shape.breadth_first)
            gatherer = self.stages.dense.gatherer
            program = build_programs(
                shape,
                zero_stage=self.zero_stage,
                gather_weights=gatherer is not None and not self.whole,
                needs=gatherer.needs if gatherer is not None else None,
            )[self.pipeline.rank]
            self._programs[micro_batches] = program
        return program

    def _needs(self, stage: int) -> list[int]:
        """The stages whose weights running `stage` reads (none to wait for when `whole`: the
        module hooks wait)."""
        if self.whole:
            return []
        return sorted(stages_read(stage, self.shape.num_stages, self.stages.tied_here))

    def _positions(self, stage: int) -> tuple[int, int]:
        if self.whole:
            return 0, self.num_layers + 1
        return self.stages.stages[stage].positions

    def _global(self, pipeline_rank: int) -> int:
        return dist.get_global_rank(self.pipeline.group, pipeline_rank)

    def _memory(self) -> Memory:
        return KeyValueMemory() if self.whole else StagedKeyValueMemory()

    def _pieces(self) -> _Pieces | None:
        """What a micro-batch's pieces share (None without pieces)."""
        if self.shape.pieces == 1:
            return None
        answers = AnswerStates(not self.whole) if self._answer_losses else None
        return _Pieces(self._memory(), {name: self._memory() for name in self.references}, answers)

    def _context(self, micro_batch: MicroBatch, piece: int, pieces: _Pieces | None) -> Context:
        input_ids, labels, documents = micro_batch.pieces[piece]
        pairs = micro_batch.pairs_of(piece)
        return self.model.context(
            input_ids,
            document_ids=documents,
            cache=None if pieces is None else _cache(pieces.memory, piece, input_ids.shape[1]),
            position_ids=None if pairs is None else pairs.positions,
            branch_ids=None if pairs is None else pairs.parts,
            labels=labels,
        )

    def run(self, micro_batches: Sequence[MicroBatch], loss_scale: float) -> Tensor:
        """Run the program of the micro-batches (a step's, or any multiple of the breadth-first
        ones: the passes without the optimizer step); returns this rank's part of the
        weighted loss (the last stage's losses and every stage's auxiliary losses, each times
        its piece's weight): summed over the pipeline and data ranks, the step's loss."""
        stages, shape = self.stages, self.shape
        assert all(len(m.pieces) == shape.pieces for m in micro_batches)
        program = self._program(len(micro_batches))
        memories: dict[int, _Pieces | None] = {}
        contexts: dict[tuple[int, int], Context] = {}
        produced: dict[Step, Tensor] = {}
        carried: dict[Step, list[Tensor]] = {}
        """The reference models' outputs of a forward step, handed on with `produced`'s."""
        computes = program.computes()
        position = -1
        saved: dict[Step, _Saved] = {}
        pending: list[_Saved] = []
        """`whole`: the pieces' forward passes whose backward pass runs at the first piece's."""
        sends: list[point_to_point.Sent] = []
        loss = torch.zeros((), dtype=torch.float32, device=stages.device)
        named: dict[str, Tensor] = {}
        last = shape.num_stages - 1
        first_here = shape.stages_of(self.pipeline.rank)[0]
        for op in program.ops:
            if self.trace is not None:
                self.trace.append(op)
            if op.kind == "gather":
                stages.prefetch_weights(op.stage)
            elif op.kind == "release":
                stages.release_weights(op.stage)
            elif op.kind == "recv":
                assert op.step is not None
                self._receive(op.step, self._global(op.peer), produced, carried)
            elif op.kind == "send":
                assert op.step is not None
                peer = self._global(op.peer)
                tensors = [produced.pop(op.step), *carried.pop(op.step, [])]
                sends += [point_to_point.isend(tensor, peer) for tensor in tensors]
            else:
                step = op.step
                assert step is not None
                position += 1
                m, p = step.micro_batch, step.piece
                for stage in self._needs(step.stage):
                    stages.wait_for_weights(stage)
                if m not in memories:
                    memories[m] = self._pieces()
                pieces = memories[m]
                if step.forward:
                    if (m, p) not in contexts:
                        contexts[(m, p)] = self._context(micro_batches[m], p, pieces)
                    following = computes[position + 1 : position + 2]
                    # The reference models' weights stay gathered for the stage's next forward.
                    keep = [s.stage for s in following if s.forward] == [step.stage]
                    saved[step], value = self._forward(
                        step, micro_batches[m], contexts[(m, p)], produced, carried, last,
                        loss_scale, named, pieces, keep,
                    )  # fmt: skip
                    loss += value
                else:
                    forward = Step(step.stage, m, True, p)
                    if self.whole:
                        pending.append(saved.pop(forward))
                        if p == 0:
                            final = step == program.computes()[-1]
                            self._backward_whole(pending, op.reduce, final)
                            pending = []
                    else:
                        self._backward(step, saved.pop(forward), produced, op.reduce, pieces)
                    if step.stage == first_here:
                        contexts.pop((m, p), None)
                        if p == 0:
                            memories.pop(m, None)
        for sent in sends:
            sent.wait()
        if not self.whole:
            stages.finish_step_backward()
        self.named_losses = named
        return loss

    def _receive(
        self,
        step: Step,
        peer: int,
        produced: dict[Step, Tensor],
        carried: dict[Step, list[Tensor]],
    ) -> None:
        """What `step`'s stage hands on, from global rank `peer`: a forward step's output
        activation and its reference models' (each of its own width), or a backward step's
        input gradient."""
        stages = self.stages
        widths = [self.activation_shape[-1]]
        if step.forward:
            widths += [r.model.config.transformer.hidden_size for r in self.references.values()]
        received = [
            point_to_point.recv(
                torch.empty(
                    (*self.activation_shape[:-1], width),
                    dtype=stages.compute_dtype,
                    device=stages.device,
                ),
                peer,
            )
            for width in widths
        ]
        produced[step] = received[0]
        if len(received) > 1:
            carried[step] = received[1:]

    def _forward(
        self,
        step: Step,
        micro_batch: MicroBatch,
        context: Context,
        produced: dict[Step, Tensor],
        carried: dict[Step, list[Tensor]],
        last: int,
        loss_scale: float,
        named: dict[str, Tensor],
        pieces: _Pieces | None = None,
        keep_references: bool = False,
    ) -> tuple[_Saved, Tensor]:
        """The stage's forward pass of `step`'s piece of `micro_batch`, the reference models'
        same stage first: what it saves, and its weighted loss contribution (the last stage
        adds each of its losses, and their metrics, weighted, to `named`). `pieces`: what the
        micro-batch's pieces share; `keep_references`: the reference models' weights stay
        gathered (ZeRO-3) for the stage's next forward pass."""
        p = step.piece
        input_ids, labels, documents = micro_batch.pieces[p]
        weight, pairs = micro_batch.weights[p], micro_batch.pairs_of(p)
        first_position, last_position = self._positions(step.stage)
        need = dependency(step, self.shape.num_stages)
        # The reference models first: only their outputs are kept.
        inputs = [input_ids] * len(self.references) if need is None else carried.pop(need, [])
        stage = None if self.whole else step.stage
        length = input_ids.shape[1]
        outputs = {
            name: reference.run(
                stage, x, input_ids, documents, pairs,
                None if pieces is None else _cache(pieces.references[name], p, length),
            )
            for (name, reference), x in zip(self.references.items(), inputs, strict=True)
        }  # fmt: skip
        leaf = None
        if need is None:
            x = input_ids
        else:
            leaf = produced.pop(need).detach().requires_grad_(True)
            x = leaf
        if step.stage == last:
            teachers = {
                name: reference.teacher(
                    outputs[name], labels, pairs, hidden=name in self._distilled
                )
                for name, reference in self.references.items()
            }
            for name in self._precomputed:
                if pairs is None or pairs.reference is None:
                    raise ValueError(
                        f"reference_models.{name}: its log-probabilities are precomputed, and "
                        "the batch came without them (DataLoader's reference_log_probs)"
                    )
                teachers[name] = Teacher(log_probs=pairs.reference)
        out, auxiliary = self.model.run_positions(first_position, last_position, x, context)
        value = torch.zeros((), dtype=torch.float32, device=out.device)
        if auxiliary is not None:
            value = value + weight * auxiliary.detach().float()
            auxiliary = auxiliary * (weight * loss_scale)
        if step.stage == last:
            answers = None if pieces is None else pieces.answers
            states, losses = out, self.losses
            if answers is not None:
                losses = {n: loss for n, loss in losses.items() if n not in self._answer_losses}
            spans = None if pairs is None else pairs.spans
            targets = HeadTargets(labels, teachers, spans)
            out = self._losses(states, targets, losses, weight, pairs, named)
            if answers is not None:
                out = out + self._answer_losses_of(answers, p, states, teachers, micro_batch, named)
            value = value + out.detach().float()
            saved = _Saved(leaf, out * loss_scale, auxiliary)
        else:
            produced[step] = out.detach()
            if outputs:
                carried[step] = list(outputs.values())
            saved = _Saved(leaf, out, auxiliary)
        if not keep_references:  # at the last stage, once the losses have read their heads
            for reference in self.references.values():
                reference.release()
        return saved, value

    def _losses(
        self,
        states: Tensor,
        targets: HeadTargets,
        losses: Mapping[str, Loss],
        weight: float,
        pairs: Pairs | None,
        named: dict[str, Tensor],
    ) -> Tensor:
        """`losses` of the final-normed `states`, weighted, summed (each added, and its
        metrics, to `named`)."""
        # Each loss weighted by its piece's share of the global batch: of the trained
        # tokens, or of the preference pairs for DPO.
        shares = {
            name: pairs.share if pairs is not None and isinstance(loss, DPOLossConfig) else weight
            for name, loss in losses.items()
        }
        weights = {name: loss.weight * shares[name] for name, loss in losses.items()}
        total, values, metrics = head_losses(self.model, states, targets, losses, weights)
        for name, v in values.items():
            named[name] = named.get(name, 0.0) + shares[name] * v.float()
        for name, v in metrics.items():  # DPO's, averaged over the pairs
            assert pairs is not None
            named[name] = named.get(name, 0.0) + pairs.share * v.detach().float()
        return total

    def _answer_losses_of(
        self,
        answers: AnswerStates,
        piece: int,
        states: Tensor,
        teachers: Mapping[str, Teacher],
        micro_batch: MicroBatch,
        named: dict[str, Tensor],
    ) -> Tensor:
        """The losses that read whole answers, at the micro-batch's last piece (0 before):
        the earlier pieces' `states` and the reference models' log-probabilities are kept
        until then."""
        for name in self.references:
            log_probs = teachers[name].log_probs
            assert log_probs is not None
            answers.add_log_probs(name, log_probs)
        if piece < len(micro_batch.pieces) - 1:
            answers.keep(piece, states)
            return torch.zeros((), dtype=torch.float32, device=states.device)
        pairs = micro_batch.pairs
        assert pairs is not None
        whole = {
            name: Teacher(log_probs=log_probs) for name, log_probs in answers.log_probs.items()
        }
        whole |= {name: teachers[name] for name in self._precomputed}
        targets = HeadTargets(micro_batch.whole()[1], whole, pairs.spans)
        losses = {name: self.losses[name] for name in self._answer_losses}
        return self._losses(answers.join(states), targets, losses, 1.0, pairs, named)

    def _backward_whole(self, forwards: list[_Saved], reduce: bool, final: bool) -> None:
        """One micro-batch's backward pass through the whole model, from its pieces' weighted
        losses; with `reduce`, the gradients are summed over data ranks while it runs, and in
        the step's `final` one those of groups whose gradients are not sharded (ZeRO-1, or one
        data rank of a ZeRO-2/3 run)."""
        tensors = [saved.output for saved in forwards]
        tensors += [saved.auxiliary for saved in forwards if saved.auxiliary is not None]
        # An earlier piece's losses are none when all read whole answers (the last piece's).
        tensors = [tensor for tensor in tensors if tensor.requires_grad]
        self.stages.arm_reduction(reduce, final, uses=len(forwards))
        torch.autograd.backward(tensors)
        self.stages.finish_backward()

    def _backward(
        self,
        step: Step,
        saved: _Saved,
        produced: dict[Step, Tensor],
        reduce: bool,
        pieces: _Pieces | None,
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
        if pieces is not None:
            first, last = stages.stages[step.stage].positions
            layers = range(max(first, 1) - 1, min(last, self.num_layers))
            assert isinstance(pieces.memory, StagedKeyValueMemory)
            keys_values, their_grads = pieces.memory.backward_roots(layers, step.piece)
            tensors += keys_values
            grads += their_grads
            root = None if pieces.answers is None else pieces.answers.backward_root(step.piece)
            if root is not None:
                tensors.append(root[0])
                grads.append(root[1])
        stages.arm_reduction(reduce)
        # A stage of frozen parameters with nothing trained before it has no backward pass:
        # the gradient it received goes unused.
        differentiable = [(t, g) for t, g in zip(tensors, grads, strict=True) if t.requires_grad]
        if differentiable:
            torch.autograd.backward(*map(list, zip(*differentiable, strict=True)))
        stages.finish_stage_backward(step.stage, reduce)
        if saved.input is not None:
            assert saved.input.grad is not None
            produced[step] = saved.input.grad

    @torch.no_grad()
    def reference_log_probs(
        self, reference: ReferenceModel, micro_batch: MicroBatch
    ) -> Tensor | None:
        """`reference`'s log-probabilities of each answer of `micro_batch`'s pairs (DPO's,
        precomputed), its pieces run whole through the reference's stages, one after another
        over the pipeline ranks (blocking transfers; every rank of the pipeline calls it).
        On the rank of the last stage; None on the others."""
        input_ids, labels, documents = micro_batch.whole()
        pairs, shape, rank = micro_batch.pairs, self.shape, self.pipeline.rank
        assert pairs is not None

        def run(stage: int, states: Tensor) -> Tensor:
            whole_or_stage = None if self.whole else stage
            return reference.run(whole_or_stage, states, input_ids, documents, pairs)

        def receive_into() -> Tensor:
            width = reference.model.config.transformer.hidden_size
            batch, length = self.activation_shape[0], self.activation_shape[1] * shape.pieces
            dtype, device = self.stages.compute_dtype, input_ids.device
            return torch.empty((batch, length, width), dtype=dtype, device=device)

        ranks = [shape.rank_of(stage) for stage in range(shape.num_stages)]
        states = point_to_point.through_stages(
            input_ids, ranks, rank, run, receive_into, self._global
        )
        log_probs = None
        if shape.rank_of(shape.num_stages - 1) == rank:
            log_probs = reference.teacher(states, labels, pairs, hidden=False).log_probs
        reference.release()
        return log_probs

    @torch.no_grad()
    def evaluate(
        self, micro_batches: Sequence[MicroBatch], stop: Callable[[], bool] | None = None
    ) -> Tensor | None:
        """Forward passes only (validation): each piece of each micro-batch through the stages
        in turn, its activations handed on by blocking transfers in that one global order.
        Returns this rank's part of the weighted loss, as `run` does; None when `stop`, asked
        before each micro-batch (by every rank: all run this loop), said to stop."""
        stages, shape = self.stages, self.shape
        last = shape.num_stages - 1
        loss = torch.zeros((), dtype=torch.float32, device=stages.device)
        named: dict[str, Tensor] = {}
        for m, micro_batch in enumerate(micro_batches):
            if stop is not None and stop():
                return None
            pieces = self._pieces()
            for p in range(len(micro_batch.pieces)):
                context = self._context(micro_batch, p, pieces)
                produced: dict[Step, Tensor] = {}
                carried: dict[Step, list[Tensor]] = {}
                for stage in range(shape.num_stages):
                    rank, step = shape.rank_of(stage), Step(stage, m, True, p)
                    previous = shape.rank_of(stage - 1) if stage else rank
                    mine = rank == self.pipeline.rank
                    if stage and previous != rank:
                        need = Step(stage - 1, m, True, p)
                        if previous == self.pipeline.rank:
                            for tensor in [produced.pop(need), *carried.pop(need, [])]:
                                point_to_point.send(tensor, self._global(rank))
                        elif mine:
                            self._receive(need, self._global(previous), produced, carried)
                    if not mine:
                        continue
                    for needed in self._needs(stage):
                        stages.wait_for_weights(needed)
                    _, value = self._forward(
                        step, micro_batch, context, produced, carried, last, 1.0, named, pieces
                    )
                    loss += value
                    stages.release_weights()
        self.named_losses = named
        return loss


def _cache(memory: Memory, piece: int, length: int) -> Memory | PieceCache:
    """The model's `cache` for `piece` (of `length` positions) of a micro-batch."""
    if isinstance(memory, StagedKeyValueMemory):
        return memory.piece(piece, piece * length)
    return memory
