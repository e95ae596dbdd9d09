"""The static pipeline schedule: the orders, the programs derived from them, and the deadlock
check."""

from __future__ import annotations

import pytest

from fastllm.config.layout import StepShape
from fastllm.engine.schedule.program import (
    Op,
    Program,
    ScheduleError,
    Step,
    build_programs,
    check_deadlock_free,
    rank_orders,
    timeline,
)


def test_breadth_first_runs_each_stage_on_all_micro_batches_back_to_back() -> None:
    orders = rank_orders(StepShape(num_stages=4, pipeline=2, breadth_first=3, depth_first=2))
    first = [str(step) for step in orders[0][:12]]
    assert first == [
        "F0.0", "F0.1", "F0.2", "F2.0", "F2.1", "F2.2",
        "B2.0", "B2.1", "B2.2", "B0.0", "B0.1", "B0.2",
    ]  # fmt: skip
    assert [str(step) for step in orders[0][12:15]] == ["F0.3", "F0.4", "F0.5"]
    assert all(step.stage % 2 == 1 for step in orders[1])


def test_depth_first_is_one_forward_one_backward() -> None:
    orders = rank_orders(StepShape(2, 2, breadth_first=4, depth_first=1, order="depth_first"))
    assert [str(s) for s in orders[0]] == [
        "F0.0",
        "F0.1",
        "B0.0",
        "F0.2",
        "B0.1",
        "F0.3",
        "B0.2",
        "B0.3",
    ]
    assert [str(s) for s in orders[1]] == [
        "F1.0",
        "B1.0",
        "F1.1",
        "B1.1",
        "F1.2",
        "B1.2",
        "F1.3",
        "B1.3",
    ]


@pytest.mark.parametrize("pieces", [1, 3])
@pytest.mark.parametrize("order", ["breadth_first", "depth_first"])
@pytest.mark.parametrize(("stages", "pipeline"), [(2, 2), (4, 2), (6, 3), (3, 1)])
def test_programs_transfer_every_activation_once_and_cannot_deadlock(
    order: str, stages: int, pipeline: int, pieces: int
) -> None:
    shape = StepShape(stages, pipeline, breadth_first=4, depth_first=2, order=order, pieces=pieces)
    programs = build_programs(shape, zero_stage=3, gather_weights=True)
    sends = [(p.rank, op.peer, op.step) for p in programs for op in p.ops if op.kind == "send"]
    receives = [(op.peer, p.rank, op.step) for p in programs for op in p.ops if op.kind == "recv"]
    assert sorted(sends) == sorted(receives)
    crossings = sum(1 for s in range(stages - 1) if s % pipeline != (s + 1) % pipeline)
    units = shape.micro_batches * pieces
    assert len(sends) == 2 * crossings * units  # activations and gradients
    for program in programs:
        steps = program.computes()
        assert len(steps) == len(set(steps)) == 2 * len(shape.stages_of(program.rank)) * units
        # A stage's pieces of a micro-batch: forward first to last, backward last to first.
        for stage in shape.stages_of(program.rank):
            for m in range(shape.micro_batches):
                mine = [s for s in steps if s.stage == stage and s.micro_batch == m]
                order_of = [(s.forward, s.piece) for s in mine]
                forwards = [(True, p) for p in range(pieces)]
                assert order_of == forwards + [(False, p) for p in reversed(range(pieces))]
        gathered: set[int] = set()
        for op in program.ops:  # ZeRO-3: every computation finds its stage gathered
            if op.kind == "gather":
                gathered.add(op.stage)
            elif op.kind == "release":
                gathered.discard(op.stage)
            elif op.kind == "compute":
                assert op.step is not None and op.step.stage in gathered, str(op)
        assert not gathered


def test_breadth_first_gathers_and_reduces_once_per_stage_and_group() -> None:
    # Rank 0 runs stages 0 and 2: stage 0 is gathered for its forward and its backward
    # passes, stage 2 once (its backward passes follow its forward passes).
    for order, gathers in (("breadth_first", 3), ("depth_first", None)):
        shape = StepShape(4, 2, breadth_first=4, depth_first=1, order=order)
        program = build_programs(shape, zero_stage=3, gather_weights=True)[0]
        count = sum(op.kind == "gather" for op in program.ops)
        reduces = sum(op.reduce for op in program.ops)
        if gathers is not None:
            assert (count, reduces) == (gathers, 2)
        else:
            assert count > 4 and reduces > 2
    zero1 = build_programs(StepShape(4, 2, 4, 2, "depth_first"), zero_stage=1)[0]
    assert sum(op.reduce for op in zero1.ops) == 2  # each stage once per step


def test_an_order_running_a_piece_backward_before_the_next_piece_is_refused() -> None:
    # The next piece's backward pass adds to the gradients of this piece's keys and values.
    shape = StepShape(1, 1, breadth_first=1, depth_first=1, pieces=2)
    forwards = [Step(0, 0, True, 0), Step(0, 0, True, 1)]
    costs = [1.0], [2.0]
    timeline(shape, [[*forwards, Step(0, 0, False, 1), Step(0, 0, False, 0)]], *costs)
    with pytest.raises(ScheduleError, match=r"wait on each other: B0\.0"):
        timeline(shape, [[*forwards, Step(0, 0, False, 0), Step(0, 0, False, 1)]], *costs)


def test_a_program_whose_transfers_cross_is_refused() -> None:
    f0, f1 = Step(0, 0, True), Step(1, 0, True)
    programs = [
        Program(0, [Op("recv", f1, peer=1), Op("send", f0, peer=1)]),
        Program(1, [Op("recv", f0, peer=0), Op("send", f1, peer=0)]),
    ]
    with pytest.raises(ScheduleError, match="would deadlock: rank 0 at recv"):
        check_deadlock_free(programs)
    programs[0].ops.reverse()
    programs[1].ops.reverse()
    with pytest.raises(ScheduleError):
        check_deadlock_free(programs)
    programs[1].ops.reverse()
    check_deadlock_free(programs)
