"""`fastllm schedule`: the step of a config's pipeline, timed under a cost model, for the
breadth-first, depth-first (looped) and depth-first (one stage per rank) schedules; prints the
bubble, the exposed communication and the predicted step time, and draws each rank's timeline.

It simulates the very programs the runner executes (`programs_for` builds both). Each rank has
three streams: compute (the stages' passes, in program order), pipeline (its transfers, in
program order; one starts when the sender's data is ready and both ranks' pipeline streams are
free, and the receiver's compute waits for it) and data (ZeRO-3 gathers, issued where the
program has them, and gradient reduce-scatters after the backward passes that reduce; ZeRO-1/2
all-gather the updated weights after the step, synchronously as the engine does today).

The bubble is the compute streams' idle share with free communication; the exposed
communication is what the communication costs add to the step on top of that."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgspec

from fastllm.config import TrainerConfig
from fastllm.config.flops import flops_per_token
from fastllm.config.layout import StepShape, resolve
from fastllm.engine.schedule.program import Program, Step, build_programs, waiting_ops
from fastllm.engine.stages import stages_read

EFFECTIVE_TFLOPS = 550.0
"""Default compute rate: what our dense training sustains on one H200 (56% MFU of 989 TFLOP/s:
llama-1b, bench/results/h200-9e4df3c)."""
LINK_GBPS = 25.0
"""Default pipeline and data-parallel bandwidth per GPU: one 200 Gb/s InfiniBand link, the
multi-node setting pipelines are for (within a node NVLink is ~15× faster)."""
LATENCY_S = 20e-6


@dataclass(frozen=True)
class CostModel:
    forward: list[float]
    """Seconds of each stage's forward pass on one micro-batch (one piece of it)."""
    backward: list[float]
    activation_bytes: float
    """What a stage hands the next per micro-batch or piece (and the gradient it gets back)."""
    weight_bytes: list[float]
    """Each stage's compute weights on one tensor rank."""
    gradient_bytes: list[float]
    """Each stage's fp32 gradient on one tensor rank."""
    data_size: int
    zero_stage: int
    pipeline_bandwidth: float
    """Bytes per second of a transfer between pipeline ranks."""
    data_bandwidth: float
    """Bytes per second of a ring collective over the data group (bus bandwidth)."""

    def free_communication(self) -> CostModel:
        return replace(self, pipeline_bandwidth=math.inf, data_bandwidth=math.inf)

    def transfer(self) -> float:
        if math.isinf(self.pipeline_bandwidth):
            return 0.0
        return LATENCY_S + self.activation_bytes / self.pipeline_bandwidth

    def collective(self, nbytes: float) -> float:
        if self.data_size == 1 or math.isinf(self.data_bandwidth):
            return 0.0
        return LATENCY_S + nbytes * (self.data_size - 1) / self.data_size / self.data_bandwidth


@dataclass
class Interval:
    rank: int
    stream: str
    """compute, pipeline or data."""
    start: float
    end: float
    label: str


@dataclass
class Simulation:
    step_time: float
    intervals: list[Interval] = field(default_factory=list)

    def busy(self, rank: int, stream: str = "compute") -> float:
        return sum(i.end - i.start for i in self.intervals if i.rank == rank and i.stream == stream)


def programs_for(config: TrainerConfig, world_size: int) -> list[Program]:
    """The programs the trainer's runner builds for `config` on `world_size` ranks."""
    layout = resolve(config, world_size)
    shape, zero_stage = layout.step, config.model.multi_stage.zero_stage
    tied = config.model.base_model.tie_word_embeddings
    last = shape.num_stages - 1
    # As ModelStages.tied_here: the head has no copy of its own when it shares the rank.
    tied_here = tied and shape.rank_of(last) == shape.rank_of(0)

    def needs(stage: int) -> set[int]:
        return stages_read(stage, shape.num_stages, tied_here)

    return build_programs(
        shape,
        zero_stage=zero_stage,
        gather_weights=zero_stage == 3 and layout.data > 1,
        needs=needs,
    )


def cost_model(
    config: TrainerConfig,
    world_size: int,
    tflops: float = EFFECTIVE_TFLOPS,
    pipeline_gbps: float = LINK_GBPS,
    data_gbps: float = LINK_GBPS,
) -> CostModel:
    """Stage times from the FLOPs of their layers (torchtitan's count, split by layer) at
    `tflops`, message sizes from the geometry; per piece of a micro-batch with
    `schedule.micro_batch_splits` (each the same share: the later pieces' longer attention
    is not modelled)."""
    base, batch, layout = config.model.base_model, config.batch, resolve(config, world_size)
    t, stages = base.transformer, config.model.multi_stage
    tensor, pieces = layout.tensor, layout.micro_batch_splits
    tokens = layout.micro_batch_size * batch.sequence_length // layout.sequence_data // pieces
    head = 6 * base.vocab_size * t.hidden_size
    block = (flops_per_token(base, batch.sequence_length) - head) / t.num_layers
    count = layout.num_stages
    forward, weights = [], []
    block_parameters = base.num_parameters(embeddings=False) / t.num_layers
    compute_bytes = 2 if config.model.distributed.training_dtype != "float32" else 4
    for stage in range(count):
        first = stage * stages.layers_per_stage
        layers = min(stages.layers_per_stage, t.num_layers - first)
        flops = layers * block + (head if stage == count - 1 else 0)
        parameters = layers * block_parameters + base.vocab_size * t.hidden_size * (
            (stage == 0) + (stage == count - 1 and not base.tie_word_embeddings)
        )
        forward.append(flops / 3 * tokens / tensor / (tflops * 1e12))
        weights.append(parameters / tensor * compute_bytes)
    recompute = 2.0 if stages.recompute == "full" else 1.0
    return CostModel(
        forward=forward,
        backward=[(1 + recompute) * f for f in forward],
        activation_bytes=layout.micro_batch_size
        * layout.piece_length
        * t.hidden_size
        * compute_bytes,
        weight_bytes=weights,
        gradient_bytes=[w / compute_bytes * 4 for w in weights],
        data_size=layout.data,
        zero_stage=stages.zero_stage,
        pipeline_bandwidth=pipeline_gbps * 1e9,
        data_bandwidth=data_gbps * 1e9,
    )


def simulate(shape: StepShape, programs: Sequence[Program], costs: CostModel) -> Simulation:
    """The step's timeline (see the module's docstring)."""
    ranks = len(programs)
    position = [0] * ranks
    compute = [0.0] * ranks
    link: dict[frozenset[int], float] = {}
    """Per pair of ranks: when its stream is free (NCCL runs each pair's transfers on a stream
    of their own, in order); inf while a send waits to be received."""
    data = [0.0] * ranks
    ready: list[dict[int, float]] = [{} for _ in range(ranks)]
    """Per rank: when each gathered stage's weights arrived."""
    posted: dict[tuple[Step, int], float] = {}
    """(step, receiver) → when the sent data is ready."""
    produced: dict[Step, float] = {}
    result = Simulation(0.0)
    while any(position[r] < len(p.ops) for r, p in enumerate(programs)):
        progressed = False
        for rank, program in enumerate(programs):
            while position[rank] < len(program.ops):
                op = program.ops[position[rank]]
                pair = frozenset((rank, op.peer))
                if op.kind == "send":
                    assert op.step is not None
                    if math.isinf(link.get(pair, 0.0)):
                        break
                    posted[(op.step, op.peer)] = max(produced[op.step], link.get(pair, 0.0))
                    link[pair] = math.inf  # known once the receiver takes it
                elif op.kind == "recv":
                    assert op.step is not None
                    key = (op.step, rank)
                    if key not in posted:
                        break
                    start = posted.pop(key)
                    end = start + costs.transfer()
                    link[pair] = end
                    compute[rank] = max(compute[rank], end)
                    produced[op.step] = end
                    result.intervals.append(Interval(op.peer, "pipeline", start, end, str(op.step)))
                elif op.kind == "gather":
                    start = max(data[rank], compute[rank])
                    data[rank] = start + costs.collective(costs.weight_bytes[op.stage])
                    ready[rank][op.stage] = data[rank]
                    result.intervals.append(
                        Interval(rank, "data", start, data[rank], f"gather {op.stage}")
                    )
                elif op.kind == "compute":
                    step = op.step
                    assert step is not None
                    # The stream's order keeps a rank's own dependencies; received inputs
                    # already delayed it at their receive.
                    start = max(compute[rank], ready[rank].get(step.stage, 0.0))
                    cost = (costs.forward if step.forward else costs.backward)[step.stage]
                    compute[rank] = start + cost
                    produced[step] = compute[rank]
                    result.intervals.append(
                        Interval(rank, "compute", start, compute[rank], str(step))
                    )
                    if op.reduce:
                        begin = max(data[rank], compute[rank])
                        data[rank] = begin + costs.collective(costs.gradient_bytes[step.stage])
                        result.intervals.append(
                            Interval(rank, "data", begin, data[rank], f"reduce {step.stage}")
                        )
                position[rank] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(
                f"the simulated programs wait on each other: {waiting_ops(programs, position)}"
            )
    for rank in range(ranks):
        transfers = [free for pair, free in link.items() if rank in pair]
        end = max(compute[rank], data[rank], *transfers)
        if costs.zero_stage < 3:  # the updated weights, all-gathered after the step
            owned = shape.stages_of(rank)
            duration = costs.collective(sum(costs.weight_bytes[s] for s in owned))
            if duration:
                result.intervals.append(Interval(rank, "data", end, end + duration, "all-gather"))
            end += duration
        result.step_time = max(result.step_time, end)
    return result


VARIANTS = {
    "breadth-first": {"schedule.order": "breadth_first"},
    "depth-first (looped)": {"schedule.order": "depth_first"},
    "depth-first (one stage per rank)": {"schedule.order": "depth_first", "stages": 1},
}
"""The schedules compared: the config's stages in either order, and 1F1B with one stage per
pipeline rank (Megatron-LM without interleaving)."""


def variant_config(config: TrainerConfig, name: str) -> TrainerConfig:
    """`config` with the schedule `name` (the same global batch and micro-batches, as
    breadth-first micro-batches)."""
    settings = VARIANTS[name]
    stages = config.model.multi_stage
    if settings.get("stages") == 1:
        layers = config.model.base_model.transformer.num_layers
        per_rank = -(-layers // config.model.distributed.pipeline_parallel)
        stages = msgspec.structs.replace(stages, layers_per_stage=per_rank)
    schedule = msgspec.structs.replace(config.schedule, order=settings["schedule.order"])
    model = msgspec.structs.replace(config.model, multi_stage=stages)
    return msgspec.structs.replace(config, model=model, schedule=schedule)


@dataclass(frozen=True)
class Prediction:
    name: str
    step_time: float
    bubble: float
    """Share of the compute streams' time idle with free communication."""
    exposed: float
    """Seconds communication adds to the step."""
    simulation: Simulation


def predict(config: TrainerConfig, world_size: int, **rates: float) -> list[Prediction]:
    """Each schedule of `VARIANTS` on `config`'s geometry."""
    predictions = []
    for name in VARIANTS:
        variant = variant_config(config, name)
        shape = resolve(variant, world_size).step
        programs = programs_for(variant, world_size)
        costs = cost_model(variant, world_size, **rates)
        timed = simulate(shape, programs, costs)
        ideal = simulate(shape, programs, costs.free_communication())
        busy = sum(ideal.busy(rank) for rank in range(shape.pipeline))
        bubble = 1 - busy / (shape.pipeline * ideal.step_time)
        predictions.append(
            Prediction(name, timed.step_time, bubble, timed.step_time - ideal.step_time, timed)
        )
    return predictions


COLOURS = {"F": "#6baed6", "B": "#2171b5", "pipeline": "#fd8d3c", "gather": "#74c476",
           "reduce": "#de2d26", "all-gather": "#31a354"}  # fmt: skip


def draw(predictions: Sequence[Prediction], path: Path, title: str) -> None:
    """Each schedule's timeline, one row per rank (compute above, communication below)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = 1 + max(i.rank for p in predictions for i in p.simulation.intervals)
    figure, axes = plt.subplots(
        len(predictions), 1, figsize=(12, 1.1 + 0.75 * ranks * len(predictions)), sharex=True
    )
    longest = max(p.step_time for p in predictions)
    for axis, prediction in zip(axes, predictions, strict=True):
        for interval in prediction.simulation.intervals:
            row = interval.rank * 2
            height, y = (0.8, row) if interval.stream == "compute" else (0.35, row + 0.8)
            if interval.stream == "compute":
                colour = COLOURS[interval.label[0]]
            elif interval.stream == "pipeline":
                colour = COLOURS["pipeline"]
            else:
                colour = COLOURS[interval.label.split()[0]]
            axis.barh(
                y, (interval.end - interval.start) * 1e3, left=interval.start * 1e3,
                height=height, color=colour, edgecolor="white", linewidth=0.3, align="edge",
            )  # fmt: skip
        axis.set_yticks([r * 2 + 0.6 for r in range(ranks)], [f"rank {r}" for r in range(ranks)])
        axis.invert_yaxis()
        axis.set_xlim(0, longest * 1e3 * 1.01)
        axis.set_title(
            f"{prediction.name}: step {prediction.step_time * 1e3:.1f} ms, bubble "
            f"{prediction.bubble:.0%}, exposed communication {prediction.exposed * 1e3:.1f} ms",
            fontsize=9,
            loc="left",
        )
    axes[-1].set_xlabel("ms")
    labels = {"F": "forward", "B": "backward", "pipeline": "activation/gradient transfer",
              "gather": "ZeRO-3 gather", "reduce": "gradient reduce-scatter",
              "all-gather": "weight all-gather"}  # fmt: skip
    figure.legend(
        handles=[Patch(color=COLOURS[k], label=v) for k, v in labels.items()],
        loc="lower center", ncol=6, fontsize=8, frameon=False,
    )  # fmt: skip
    figure.suptitle(title, fontsize=10)
    figure.tight_layout(rect=(0, 0.04, 1, 0.97))
    figure.savefig(path, dpi=110)
    plt.close(figure)


def report(
    config: TrainerConfig,
    world_size: int,
    png: Path | None = None,
    **rates: float,
) -> str:
    """The comparison table (and the timelines drawn into `png`)."""
    predictions = predict(config, world_size, **rates)
    lines = [f"{'schedule':34} {'step (ms)':>10} {'bubble':>7} {'exposed comm (ms)':>18}"]
    for p in predictions:
        lines.append(
            f"{p.name:34} {p.step_time * 1e3:10.2f} {p.bubble:7.1%} {p.exposed * 1e3:18.2f}"
        )
    if png is not None:
        shape = resolve(config, world_size).step
        pieces = f" of {shape.pieces} pieces" if shape.pieces > 1 else ""
        title = (
            f"{world_size} ranks, pipeline {shape.pipeline}, ZeRO-"
            f"{config.model.multi_stage.zero_stage}, {shape.micro_batches} micro-batches"
            f"{pieces} per rank, {config.model.base_model.transformer.num_layers} layers"
        )
        draw(predictions, png, title)
    return "\n".join(lines)
