"""`schedule`: how a step's micro-batches are grouped and ordered (Fast-LLM's keys).

A step runs `depth_first_micro_batches` groups one after the other; within a group, the
`breadth_first_micro_batches` micro-batches go through each pipeline stage back to back, so
ZeRO-2/3 gather a stage's weights and reduce its gradients once per group, not once per
micro-batch. The global batch is micro_batch_size × data-parallel size × breadth-first ×
depth-first micro-batches. `micro_batch_splits` cuts each micro-batch's sequences into pieces
run one after another (with the pipeline, each piece a unit of its schedule)."""

from __future__ import annotations

from typing import Literal

from fastllm.config.section import ConfigError, Section, check_positive


class ScheduleConfig(Section):
    breadth_first_micro_batches: int | None = None
    """Micro-batches of a group, each run through a stage before the next stage starts.
    Default: derived from `batch.batch_size` when depth_first_micro_batches is set, else 1."""
    depth_first_micro_batches: int | None = None
    """Groups of micro-batches run one after the other in a step (gradient accumulation).
    Default: what `batch.batch_size` leaves over the other factors."""
    order: Literal["breadth_first", "depth_first"] = "breadth_first"
    """How a group's micro-batches visit the pipeline stages: breadth_first (each stage runs
    all of them back to back, forward then backward; Lamy-Poirier 2023) or depth_first
    (1F1B: each rank starts a micro-batch's backward as soon as it can, holding at most as
    many micro-batches in flight as there are pipeline ranks). The same gradients either way."""

    micro_batch_splits: int = 1
    """Pieces each sequence of a micro-batch is cut into, run one after another (Fast-LLM's
    micro-sequences): a later piece attends to the keys and values of the earlier ones, which
    stay in the autograd graph, so one backward pass over the pieces' losses gives the
    gradients of the whole sequences. Each forward pass then holds one piece's transient
    activations (logit chunks, MLP intermediates, attention workspace); the stored ones are
    those of the whole sequences. With pipeline parallelism or breadth-first micro-batches,
    each piece goes through the stages as a unit of the schedule, the stage's backward passes
    of a micro-batch's pieces last to first. Not yet with
    model.distributed.sequence_data_parallel > 1 or model.multi_stage.recompute: full."""

    def validate(self) -> None:
        check_positive(self.breadth_first_micro_batches, "breadth_first_micro_batches")
        check_positive(self.depth_first_micro_batches, "depth_first_micro_batches")
        check_positive(self.micro_batch_splits, "micro_batch_splits")

    def micro_batches(self, per_rank: int, micro_batch_size: int) -> tuple[int, int]:
        """(breadth-first, depth-first) micro-batches of a step in which each data rank trains
        `per_rank` sequences in micro-batches of `micro_batch_size`; a config error naming
        the keys when they do not fit together."""
        count, left = divmod(per_rank, micro_batch_size)
        if left:
            raise ConfigError(
                "batch.micro_batch_size",
                f"({micro_batch_size}) must divide the sequences of each data-parallel rank "
                f"({per_rank} = batch.batch_size / data-parallel size)",
            )
        breadth, depth = self.breadth_first_micro_batches, self.depth_first_micro_batches
        if breadth is None and depth is None:
            return 1, count
        if breadth is None or depth is None:
            given, key = (breadth, "breadth_first") if depth is None else (depth, "depth_first")
            assert given is not None
            if count % given:
                raise ConfigError(
                    f"schedule.{key}_micro_batches",
                    f"({given}) must divide the micro-batches of each data-parallel rank "
                    f"({count} = batch.batch_size / (data-parallel size × "
                    f"batch.micro_batch_size))",
                )
            other = count // given
            return (given, other) if depth is None else (other, given)
        if breadth * depth != count:
            raise ConfigError(
                "schedule",
                f"breadth_first_micro_batches ({breadth}) × depth_first_micro_batches ({depth}) "
                f"must equal the micro-batches of each data-parallel rank ({count} = "
                "batch.batch_size / (data-parallel size × batch.micro_batch_size))",
            )
        return breadth, depth
