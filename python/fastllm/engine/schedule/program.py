"""The static schedule of one training step, built before training.

A step is a list of `Step`s (the forward or backward pass of one stage on one piece of one
micro-batch: with `schedule.micro_batch_splits`, each micro-batch's sequences are cut into
pieces that go through the stages one after another, a piece's attention reading the keys and
values of the earlier pieces on the same stage, so a stage's backward passes of a micro-batch
run in reverse piece order). Each pipeline rank runs the steps of its stages (stage s on rank
s mod P) in an order fixed here, cost-independent:
- breadth_first: for each depth-first group, every stage in turn runs the group's
  micro-batches (their pieces in order) back to back, forward through the stages, then
  backward in reverse (the pieces of each micro-batch last to first), so ZeRO gathers and
  reduces each stage once per group (Lamy-Poirier 2023, arXiv 2211.05953);
- depth_first (1F1B): each rank starts a backward as soon as one is ready and holds at most
  as many micro-batches in flight as the pipeline ranks after it (the order a greedy run with
  unit costs gives).

From these orders the `Program` of each rank is derived: its computations interleaved with
the transfers of activations and input gradients between ranks (blocking send/recv, placed
where a unit-cost timeline has them), the ZeRO-3 weight gathers (one computation ahead) and
releases, and which backward passes end with the gradient reduction of their stage. All
ranks' programs are subsequences of one global order of events, so blocking transfers cannot
deadlock; `check_deadlock_free` verifies it (on any programs) by running them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from fastllm.config.layout import StepShape

ORDERS = ("breadth_first", "depth_first")


@dataclass(frozen=True, order=True)
class Step:
    stage: int
    micro_batch: int
    forward: bool
    piece: int = 0
    """Which piece of the micro-batch's sequences (`schedule.micro_batch_splits`)."""

    def __str__(self) -> str:
        piece = f":{self.piece}" if self.piece else ""
        return f"{'F' if self.forward else 'B'}{self.stage}.{self.micro_batch}{piece}"


@dataclass(frozen=True)
class Op:
    """One action of a rank's program.

    compute: `step`; with `reduce`, the stage's gradients are summed over data ranks after
    it (its last backward of a group with ZeRO-2/3, of the step with ZeRO-1).
    send / recv: the output activation of `step`'s stage (forward) or the gradient of its
    input (backward), to / from `peer`.
    gather / release: ZeRO-3, the full weights of `stage`."""

    kind: Literal["compute", "send", "recv", "gather", "release"]
    step: Step | None = None
    stage: int = -1
    peer: int = -1
    reduce: bool = False

    def __str__(self) -> str:
        if self.kind == "compute":
            return f"{self.step}{'+reduce' if self.reduce else ''}"
        if self.kind in ("send", "recv"):
            return f"{self.kind}({self.step}, {self.peer})"
        return f"{self.kind}({self.stage})"


@dataclass
class Program:
    rank: int
    ops: list[Op] = field(default_factory=list)

    def computes(self) -> list[Step]:
        return [op.step for op in self.ops if op.kind == "compute" and op.step is not None]


def rank_orders(shape: StepShape) -> list[list[Step]]:
    """Each pipeline rank's computations in the order it runs them."""
    if shape.order not in ORDERS:
        raise ValueError(f"unknown schedule order {shape.order!r}: one of {ORDERS}")
    orders: list[list[Step]] = [[] for _ in range(shape.pipeline)]
    pieces, backwards = range(shape.pieces), range(shape.pieces - 1, -1, -1)
    for depth in range(shape.depth_first):
        group = shape.group(depth)
        if shape.order == "breadth_first":
            steps = [
                Step(s, m, True, p) for s in range(shape.num_stages) for m in group for p in pieces
            ]
            steps += [
                Step(s, m, False, p)
                for s in reversed(range(shape.num_stages))
                for m in group
                for p in backwards
            ]
            for step in steps:
                orders[shape.rank_of(step.stage)].append(step)
        else:
            for rank, steps in enumerate(_one_forward_one_backward(shape, group)):
                orders[rank] += steps
    return orders


def _one_forward_one_backward(shape: StepShape, group: range) -> list[list[Step]]:
    """The 1F1B order of one group: a greedy run with unit costs (forward 1, backward 2) in
    which a free rank takes the ready backward of the earliest micro-batch, else the ready
    forward of the earliest one (piece), while it holds fewer micro-batches than its limit
    (its own stages times the pipeline ranks from it to the last; all pieces of a micro-batch
    in flight count as one)."""
    done: dict[Step, int] = {}
    orders: list[list[Step]] = [[] for _ in range(shape.pipeline)]
    free_at = [0] * shape.pipeline
    in_flight = [set() for _ in range(shape.pipeline)]
    limits = [len(shape.stages_of(r)) * (shape.pipeline - r) for r in range(shape.pipeline)]
    pending = {
        Step(s, m, f, p)
        for s in range(shape.num_stages)
        for m in group
        for f in (True, False)
        for p in range(shape.pieces)
    }
    time = 0
    while pending:
        for rank in range(shape.pipeline):
            if free_at[rank] > time:
                continue
            ready = [
                step
                for step in pending
                if shape.rank_of(step.stage) == rank
                and all(done.get(need, time + 1) <= time for need in inputs(step, shape))
            ]
            backwards = sorted(
                (s for s in ready if not s.forward),
                key=lambda s: (s.micro_batch, -s.stage, -s.piece),
            )
            forwards = sorted(
                (s for s in ready if s.forward), key=lambda s: (s.micro_batch, s.piece, s.stage)
            )
            forwards = [
                s
                for s in forwards
                if s.micro_batch in in_flight[rank] or len(in_flight[rank]) < limits[rank]
            ]
            choice = (backwards or forwards or [None])[0]
            if choice is None:
                continue
            pending.remove(choice)
            orders[rank].append(choice)
            cost = 1 if choice.forward else 2
            free_at[rank] = time + cost
            done[choice] = time + cost
            mine = shape.stages_of(rank)
            if choice.forward:
                in_flight[rank].add(choice.micro_batch)
            elif choice.stage == mine[0] and choice.piece == 0:
                in_flight[rank].discard(choice.micro_batch)
        time += 1
    return orders


def dependency(step: Step, num_stages: int) -> Step | None:
    """The step whose output `step` reads from another stage (None: the batch itself, or the
    stage's own forward pass)."""
    m, p = step.micro_batch, step.piece
    if step.forward:
        return Step(step.stage - 1, m, True, p) if step.stage else None
    if step.stage == num_stages - 1:
        return None
    return Step(step.stage + 1, m, False, p)


def inputs(step: Step, shape: StepShape) -> list[Step]:
    """Every step that must have run before `step`: its `dependency`; for a backward pass its
    own forward pass; with pieces, the stage's previous piece (forward: whose keys and values
    it reads) or next piece (backward: whose gradients of this piece's keys and values it
    adds)."""
    need = [dependency(step, shape.num_stages)]
    m, p = step.micro_batch, step.piece
    if step.forward:
        need.append(Step(step.stage, m, True, p - 1) if p else None)
    else:
        need.append(Step(step.stage, m, True, p))
        need.append(Step(step.stage, m, False, p + 1) if p + 1 < shape.pieces else None)
    return [s for s in need if s is not None]


def timeline(
    shape: StepShape,
    orders: Sequence[Sequence[Step]],
    forward_cost: Sequence[float],
    backward_cost: Sequence[float],
    transfer_cost: float = 0.0,
) -> dict[Step, tuple[float, float]]:
    """(start, end) of every step when each rank runs its steps in order, each as soon as
    its inputs are there (`transfer_cost` after the step producing one ended on another
    rank)."""
    times: dict[Step, tuple[float, float]] = {}
    position = [0] * len(orders)
    free = [0.0] * len(orders)
    while any(position[r] < len(order) for r, order in enumerate(orders)):
        progressed = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                step = order[position[rank]]
                known = inputs(step, shape)
                if any(need not in times for need in known):
                    break
                ready = free[rank]
                for need in known:
                    delay = transfer_cost if shape.rank_of(need.stage) != rank else 0.0
                    ready = max(ready, times[need][1] + delay)
                cost = (forward_cost if step.forward else backward_cost)[step.stage]
                times[step] = (ready, ready + cost)
                free[rank] = ready + cost
                position[rank] += 1
                progressed = True
        if not progressed:
            stuck = [str(o[position[r]]) for r, o in enumerate(orders) if position[r] < len(o)]
            raise ScheduleError(f"the steps wait on each other: {', '.join(stuck)}")
    return times


class ScheduleError(RuntimeError):
    """A schedule whose ranks would wait on each other forever."""


def build_programs(
    shape: StepShape,
    zero_stage: int = 1,
    gather_weights: bool = False,
    needs: Callable[[int], set[int]] | None = None,
) -> list[Program]:
    """Every pipeline rank's program for one step (see the module's docstring).
    `gather_weights`: ZeRO-3 over more than one data rank; `needs(stage)`: the stages whose
    weights running `stage` reads (default: itself)."""
    orders = rank_orders(shape)
    times = timeline(shape, orders, [1.0] * shape.num_stages, [2.0] * shape.num_stages)
    # One global order of events: by time, transfers before computations, then a fixed
    # tie-break; each rank's program is its subsequence.
    events: list[tuple[float, int, int, int, Op]] = []
    for rank, order in enumerate(orders):
        for step in order:
            events.append((times[step][0], 1, len(events), rank, Op("compute", step)))
            need = dependency(step, shape.num_stages)
            if need is None or shape.rank_of(need.stage) == rank:
                continue
            source, at = shape.rank_of(need.stage), times[need][1]
            events.append((at, 0, len(events), source, Op("send", need, peer=rank)))
            events.append((at, 0, len(events), rank, Op("recv", need, peer=source)))
    events.sort(key=lambda event: event[:3])
    programs = [Program(rank) for rank in range(shape.pipeline)]
    for *_, rank, op in events:
        programs[rank].ops.append(op)
    for program in programs:
        program.ops = _with_data_parallel_ops(
            program.ops, zero_stage, gather_weights, needs or (lambda stage: {stage})
        )
    check_deadlock_free(programs)
    return programs


def _with_data_parallel_ops(
    ops: list[Op], zero_stage: int, gather_weights: bool, needs: Callable[[int], set[int]]
) -> list[Op]:
    """Mark the backward passes after which their stage's gradients are reduced over data
    ranks (ZeRO-1: the stage's last of the step; ZeRO-2/3: the last of each run of
    consecutive backward passes of the stage); with `gather_weights` (ZeRO-3), add the
    gathers, issued one computation ahead of use, and the releases, after the last
    computation that reads a stage before another that does not."""
    steps = [op.step for op in ops if op.kind == "compute" and op.step is not None]
    result: list[Op] = []
    gathered: set[int] = set()
    position = -1
    for op in ops:
        if op.kind != "compute" or op.step is None:
            result.append(op)
            continue
        position += 1
        step = op.step
        later = steps[position + 1 :]
        following = later[0] if later else None
        if step.forward:
            reduce = False
        elif zero_stage == 1:
            reduce = not any(s.stage == step.stage and not s.forward for s in later)
        else:
            reduce = following is None or following.stage != step.stage or following.forward
        upcoming = needs(following.stage) if following is not None else set()
        if gather_weights:
            for stage in sorted((needs(step.stage) | upcoming) - gathered):
                result.append(Op("gather", stage=stage))
                gathered.add(stage)
        result.append(Op("compute", step, reduce=reduce))
        if gather_weights:
            for stage in sorted(gathered - upcoming):
                result.append(Op("release", stage=stage))
                gathered.discard(stage)
    return result


def check_deadlock_free(programs: Sequence[Program]) -> None:
    """Run the programs with blocking transfers (a send and its receive complete together, when
    both ranks have reached them); `ScheduleError` naming what each stuck rank waits on."""
    position = [0] * len(programs)
    while True:
        moved = False
        for rank, program in enumerate(programs):
            while position[rank] < len(program.ops):
                op = program.ops[position[rank]]
                if op.kind not in ("send", "recv"):
                    position[rank] += 1
                    moved = True
                    continue
                peer = programs[op.peer]
                if position[op.peer] >= len(peer.ops):
                    break
                other = peer.ops[position[op.peer]]
                partner = "recv" if op.kind == "send" else "send"
                if other.kind == partner and other.step == op.step and other.peer == rank:
                    position[rank] += 1
                    position[op.peer] += 1
                    moved = True
                    continue
                break
        if all(position[r] == len(p.ops) for r, p in enumerate(programs)):
            return
        if not moved:
            raise ScheduleError(
                f"the pipeline schedule would deadlock: {waiting_ops(programs, position)}"
            )


def waiting_ops(programs: Sequence[Program], position: Sequence[int]) -> str:
    """Where each unfinished rank's program waits (`position`: each rank's next op)."""
    return "; ".join(
        f"rank {r} at {p.ops[position[r]]}"
        for r, p in enumerate(programs)
        if position[r] < len(p.ops)
    )
