"""The run's geometry, resolved once: `resolve(config, world_size)` gives every size a run of
`config` on `world_size` ranks uses, and `COMPATIBILITY` is the one table of the settings that
do not compose yet. The mesh, the trainer, the input checks and the simulator read the resolved
`RunLayout`; `fastllm config validate --world-size N` prints it.

Ranks are ordered tensor → data → pipeline (Fast-LLM's order); sequence-data and expert ranks
are consecutive ranks of the data group. Imports no torch."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import msgspec

from fastllm.config.section import ConfigError

if TYPE_CHECKING:
    from fastllm.config.model import BaseModelConfig, DistributedConfig, MultiStageConfig
    from fastllm.config.trainer import TrainerConfig


def num_stages(num_layers: int, layers_per_stage: int | Fraction = 1) -> int:
    """Stages of `layers_per_stage` blocks (the last may have fewer; a fraction spreads the
    blocks over the stages, as `engine.stages.stage_of_layer` does)."""
    return max(1, -(-num_layers // layers_per_stage))


def pipeline_rank_of(stage: int, pipeline: int) -> int:
    """The pipeline rank that runs `stage`: stage s on rank s mod pipeline (more stages than
    ranks: the looped placement)."""
    return stage % pipeline


def pipeline_stages(num_stages: int, pipeline: int, rank: int) -> list[int]:
    """The stages pipeline rank `rank` runs, in order."""
    return list(range(rank, num_stages, pipeline))


@dataclass(frozen=True)
class StepShape:
    """The shape of one training step, which the pipeline schedule is built from: stages over
    pipeline ranks (stage s on rank s mod pipeline, so more stages than ranks loops over them),
    breadth- and depth-first micro-batches, and the pieces each micro-batch is cut into."""

    num_stages: int
    pipeline: int
    breadth_first: int
    depth_first: int
    order: str = "breadth_first"
    pieces: int = 1
    """Pieces of each micro-batch (`schedule.micro_batch_splits`)."""

    def rank_of(self, stage: int) -> int:
        return pipeline_rank_of(stage, self.pipeline)

    @property
    def micro_batches(self) -> int:
        return self.breadth_first * self.depth_first

    def group(self, depth: int) -> range:
        """The micro-batches of depth-first group `depth`."""
        return range(depth * self.breadth_first, (depth + 1) * self.breadth_first)

    def stages_of(self, rank: int) -> list[int]:
        return pipeline_stages(self.num_stages, self.pipeline, rank)


@dataclass(frozen=True)
class MeshShape:
    """The sizes of the parallel mesh (`parallel.mesh.build_mesh` makes a process group of
    each): what a training run and `fastllm evaluate` share of a layout. Data, tensor,
    pipeline, sequence-data and expert sizes are different numbers; each collective's group
    has one of them."""

    world_size: int
    tensor: int
    """Ranks that split each layer (`model.distributed.tensor_parallel`)."""
    data: int
    """Data-parallel ranks, world / (tensor × pipeline): ZeRO shards and gradient sums span
    them."""
    pipeline: int
    """Ranks that split the stages (`model.distributed.pipeline_parallel`)."""
    sequence_data: int
    """Consecutive data ranks that share each sequence."""
    sequence_data_chunking: str
    """Which chunks of a sequence each of them computes: contiguous or head_tail."""
    expert: int
    """Consecutive data ranks that split each mixture's experts."""
    sequence_tensor_parallel: bool
    """Activations between layers split over the tensor ranks (needs tensor > 1)."""


def mesh_shape(distributed: DistributedConfig, world_size: int) -> MeshShape:
    """The mesh `distributed` (`model.distributed`) makes of `world_size` ranks; a
    `ConfigError` naming the key whose size does not divide them."""
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    tensor, pipeline = distributed.tensor_parallel, distributed.pipeline_parallel
    if world_size % (tensor * pipeline):
        raise ConfigError(
            "model.distributed.tensor_parallel",
            f"tensor_parallel ({tensor}) × model.distributed.pipeline_parallel "
            f"({pipeline}) must divide the number of ranks ({world_size})",
        )
    data = world_size // (tensor * pipeline)
    for key, size in (
        ("sequence_data_parallel", distributed.sequence_data_parallel),
        ("expert_parallel", distributed.expert_parallel),
    ):
        if data % size:
            raise ConfigError(
                f"model.distributed.{key}",
                f"({size}) must divide the data-parallel size ({data}: {_over(world_size)})",
            )
    return MeshShape(
        world_size=world_size,
        tensor=tensor,
        data=data,
        pipeline=pipeline,
        sequence_data=distributed.sequence_data_parallel,
        sequence_data_chunking=distributed.sequence_data_chunking,
        expert=distributed.expert_parallel,
        sequence_tensor_parallel=distributed.sequence_tensor_parallel and tensor > 1,
    )


def _over(world_size: int) -> str:
    return f"{world_size} ranks over model.distributed.tensor_parallel × pipeline_parallel"


@dataclass(frozen=True)
class RunLayout(MeshShape):
    """Every size a training run uses: its mesh's, and its steps'."""

    expert_data: int
    """Data ranks that hold the same experts (ZeRO shards the expert parameters over them);
    1 without expert parallelism."""
    sample_groups: int
    """The data ranks as the data loader sees them: one per sequence-data group."""
    micro_batch_size: int
    """Sequences per forward/backward pass on one rank (at most what a sample group trains)."""
    breadth_first: int
    """Micro-batches of a group, each run through a stage before the next stage starts."""
    depth_first: int
    """Groups of micro-batches run one after the other in a step."""
    micro_batch_splits: int
    """Pieces each sequence of a micro-batch is cut into."""
    order: str
    """How a group's micro-batches visit the stages: breadth_first or depth_first."""
    num_stages: int
    stages_per_rank: tuple[int, ...]
    """How many stages each pipeline rank holds."""
    piece_length: int
    """Tokens of one sequence a rank computes in one pass: its sequence-data chunk, cut into
    `micro_batch_splits` pieces, split over the tensor ranks with sequence-tensor parallelism
    (what a pipeline stage hands the next per sequence)."""

    @property
    def step(self) -> StepShape:
        return StepShape(
            self.num_stages,
            self.pipeline,
            self.breadth_first,
            self.depth_first,
            self.order,
            self.micro_batch_splits,
        )


# --- what does not compose yet -----------------------------------------------------------------


@dataclass(frozen=True)
class Condition:
    """A setting in use: the config key, when it counts as used, and how the table says so."""

    key: str
    """Dotted key, which is also its attribute path in the config."""
    holds: Callable[[Any], bool]
    text: str


def _enabled(key: str) -> Condition:
    """A switch turned on, or a count above 0."""
    return Condition(key, bool, key)


def _above_one(key: str) -> Condition:
    """A size above 1 (unset counts as 1)."""
    return Condition(key, lambda value: (value or 1) > 1, f"{key} > 1")


def _equal_to(key: str, expected: str) -> Condition:
    return Condition(key, lambda value: value == expected, f"{key}={expected}")


def _other_than(key: str, default: str) -> Condition:
    return Condition(key, lambda value: value != default, f"{key} other than {default}")


@dataclass(frozen=True)
class Incompatibility:
    """`setting` is refused while `other` holds, for `reason`; the error names `setting`'s key."""

    setting: Condition
    other: Condition
    reason: str


_COMPILE = _enabled("training.compile")
_OFFLOAD = _enabled("model.multi_stage.offload_activations")
_SPLITS = _above_one("schedule.micro_batch_splits")
_FP8 = _other_than("model.distributed.fp8_linear", "none")
_ONE_PASS = "one forward pass of the blocks at a time, run eagerly"
_FROZEN = Condition("model.freeze", lambda freeze: freeze.any, "model.freeze, any parameter frozen")
_LORA_FROZEN = Condition(
    "model.base_model.peft",
    lambda peft: getattr(peft, "freeze_others", False),  # LoRA's (config.model imports this)
    "model.base_model.peft, LoRA with freeze_others",
)
_PREDICTION = Condition(
    "model.base_model.multi_token_prediction",
    lambda prediction: prediction is not None,
    "model.base_model.multi_token_prediction",
)


def _dpo_loss(predicate: Callable[[Any], bool] = lambda _: True, described: str = "") -> Condition:
    """A DPO loss among the head's losses (one of which `predicate` holds; `described` says
    what it holds)."""
    return Condition(
        "model.base_model.head.losses",
        lambda losses: any(
            loss.__struct_config__.tag == "dpo" and predicate(loss) for loss in losses.values()
        ),
        f"model.base_model.head.losses, a dpo loss{described}",
    )


_DPO = _dpo_loss()
_GRAPHS = "their collectives would break the compiled graphs"
_OTHER_BLOCK = Condition(
    "model.base_model.transformer.block",
    lambda block: block.__struct_config__.tag != "decoder",
    "model.base_model.transformer.block of a type other than decoder",
)
_DISTRIBUTED_EXPORT = Condition(
    "training.export",
    lambda export: export.interval is not None and export.format == "distributed",
    "training.export.format=distributed with an interval",
)

COMPATIBILITY: tuple[Incompatibility, ...] = (
    *(
        Incompatibility(
            frozen,
            _DISTRIBUTED_EXPORT,
            "a distributed export holds the trained shards only; export as fastllm or a "
            "Hugging Face format",
        )
        for frozen in (_FROZEN, _LORA_FROZEN)
    ),
    *(
        Incompatibility(_PREDICTION, other, reason)
        for other, reason in (
            (
                _above_one("model.distributed.pipeline_parallel"),
                "its modules embed tokens again on the last stage, which holds no embedding",
            ),
            (
                _above_one("model.distributed.sequence_data_parallel"),
                "its tokens and labels are shifted along the whole sequence",
            ),
            (_SPLITS, "its tokens and labels are shifted along the whole sequence"),
            (
                _DPO,
                "its inputs and labels are shifted along the sequence, so the last tokens of a "
                "chosen answer would learn to predict the rejected answer's",
            ),
        )
    ),
    *(
        Incompatibility(_OTHER_BLOCK, other, reason)
        for other, reason in (
            (
                Condition(
                    "model.base_model.peft",
                    lambda peft: peft.__struct_config__.tag == "lora",
                    "model.base_model.peft of type lora",
                ),
                "LoRA's adapters are counted and exported as the decoder block's "
                "attention and MLP projections",
            ),
            (
                _equal_to("model.multi_stage.recompute", "selective"),
                "selective recomputation wraps the decoder block's MLP",
            ),
        )
    ),
    Incompatibility(
        _dpo_loss(lambda loss: loss.loss_type == "ipo", " of loss_type ipo"),
        _above_one("model.distributed.sequence_data_parallel"),
        "its length normalization would count the tokens of each answer in this rank's chunk only",
    ),
    Incompatibility(
        Condition(
            "model.base_model.transformer.mixer",
            lambda mixer: (
                mixer.__struct_config__.tag == "latent_attention" and mixer.kv_lora_rank % 2 == 1
            ),
            "model.base_model.transformer.mixer of type latent_attention with an odd kv_lora_rank",
        ),
        _above_one("model.distributed.sequence_data_parallel"),
        "the sequence-data ranks gather each token's latent and rotary key part as two "
        "halves of one size",
    ),
    Incompatibility(_COMPILE, _above_one("model.distributed.tensor_parallel"), _GRAPHS),
    Incompatibility(_COMPILE, _above_one("model.distributed.sequence_data_parallel"), _GRAPHS),
    Incompatibility(_COMPILE, _FP8, "the FP8 layers run their own kernels"),
    Incompatibility(
        _FP8,
        _above_one("model.distributed.tensor_parallel"),
        "the FP8 layers have no tensor-parallel form",
    ),
    Incompatibility(_OFFLOAD, _COMPILE, _ONE_PASS),
    Incompatibility(_OFFLOAD, _above_one("model.distributed.pipeline_parallel"), _ONE_PASS),
    Incompatibility(_OFFLOAD, _above_one("schedule.breadth_first_micro_batches"), _ONE_PASS),
    Incompatibility(_OFFLOAD, _SPLITS, _ONE_PASS),
    Incompatibility(
        _SPLITS,
        _above_one("model.distributed.sequence_data_parallel"),
        "the keys and values gathered over the sequence-data ranks hold no earlier pieces",
    ),
    Incompatibility(
        _SPLITS,
        _equal_to("model.multi_stage.recompute", "full"),
        "a recomputed block would add its piece's keys and values a second time",
    ),
)
"""Every pair of settings that does not compose yet, with the reason; the first row that holds
is the error."""


def _setting(config: TrainerConfig, key: str) -> Any:
    """The value of a dotted config key."""
    value: Any = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


def check_compatible(config: TrainerConfig) -> None:
    """A `ConfigError` naming both keys of the first row of `COMPATIBILITY` that `config`
    meets."""
    for row in COMPATIBILITY:
        mine, other = _setting(config, row.setting.key), _setting(config, row.other.key)
        if row.setting.holds(mine) and row.other.holds(other):
            raise ConfigError(
                row.setting.key,
                f"not supported yet with {row.other.text} ({row.reason}; here "
                f"{row.setting.key}={_show(mine)}, {row.other.key}={_show(other)})",
            )


def _show(value: Any) -> str:
    """A value as YAML writes it (a section as flow-style JSON)."""
    if isinstance(value, msgspec.Struct | dict):
        return json.dumps(msgspec.to_builtins(value))
    return str(value).lower() if isinstance(value, bool) else str(value)


# --- sizes --------------------------------------------------------------------------------------


def check_shape(config: TrainerConfig) -> None:
    """The sizes that must divide each other whatever the number of ranks: the model's
    dimensions by the tensor ranks, the experts by the expert ranks, the sequence by its
    chunks and pieces, and at least one stage per pipeline rank."""
    model = config.model
    check_model_split(model.base_model, model.multi_stage, model.distributed)
    _check_sequence_length(config)


def check_model_split(
    base_model: BaseModelConfig, multi_stage: MultiStageConfig, distributed: DistributedConfig
) -> None:
    """The model splits as `distributed` asks: at least one stage per pipeline rank, the
    dimensions that the tensor ranks slice divisible by them, the experts by the expert
    ranks."""
    t = base_model.transformer
    stages, pipeline = multi_stage.num_stages(t.num_layers), distributed.pipeline_parallel
    if pipeline > stages:
        raise ConfigError(
            "model.distributed.pipeline_parallel",
            f"({pipeline}) is more than the model's stages ({stages}: "
            "model.base_model.transformer.num_layers / model.multi_stage.layers_per_stage), "
            "so some pipeline rank would hold none",
        )
    tensor = distributed.tensor_parallel
    assert t.ffn_hidden_size is not None, "validate() first"
    for key, value in (
        ("model.base_model.transformer.num_attention_heads", t.num_attention_heads),
        ("model.base_model.transformer.head_groups", t.head_groups),
        ("model.base_model.transformer.ffn_hidden_size", t.ffn_hidden_size),
        ("model.base_model.vocab_size", base_model.vocab_size),
    ):
        if value % tensor:
            raise ConfigError(
                "model.distributed.tensor_parallel",
                f"({tensor}) must divide {key} ({value}): each rank holds a slice",
            )
    expert = distributed.expert_parallel
    if t.num_experts % expert:
        raise ConfigError(
            "model.distributed.expert_parallel",
            f"({expert}) must divide model.base_model.transformer.num_experts "
            f"({t.num_experts}): each rank holds an equal share of the experts",
        )


def _check_sequence_length(config: TrainerConfig) -> None:
    distributed, length = config.model.distributed, config.batch.sequence_length
    sequence_data, splits = distributed.sequence_data_parallel, config.schedule.micro_batch_splits
    head_tail = distributed.sequence_data_chunking == "head_tail" and sequence_data > 1
    factors = [
        (2, "2 (model.distributed.sequence_data_chunking: head_tail)", head_tail),
        (sequence_data, "model.distributed.sequence_data_parallel", sequence_data > 1),
        (splits, "schedule.micro_batch_splits", splits > 1),
        (
            distributed.tensor_parallel,
            "model.distributed.tensor_parallel (with sequence_tensor_parallel)",
            distributed.sequence_tensor_parallel and distributed.tensor_parallel > 1,
        ),
    ]
    used = [(factor, key) for factor, key, applies in factors if applies]
    chunks = 1
    for factor, _ in used:
        chunks *= factor
    if length % chunks:
        raise ConfigError(
            "batch.sequence_length",
            f"({length}) must be divisible by {' × '.join(key for _, key in used)} ({chunks})",
        )


def resolve(config: TrainerConfig, world_size: int) -> RunLayout:
    """Every size a run of `config` on `world_size` ranks uses; a `ConfigError` naming the keys
    when they do not fit the ranks or each other, or when the settings do not compose yet."""
    check_compatible(config)
    check_shape(config)
    mesh = mesh_shape(config.model.distributed, world_size)
    batch, tensor, pipeline, data = config.batch, mesh.tensor, mesh.pipeline, mesh.data
    sequence_data, expert = mesh.sequence_data, mesh.expert
    over = _over(world_size)
    groups = data // sequence_data
    if batch.batch_size % groups:
        shared = (
            f" over model.distributed.sequence_data_parallel ({sequence_data})"
            if sequence_data > 1
            else ""
        )
        raise ConfigError(
            "batch.batch_size",
            f"({batch.batch_size}) must be divisible by the data-parallel size{shared}, "
            f"{groups} (the {over})",
        )
    per_group = batch.batch_size // groups
    assert batch.micro_batch_size is not None, "validate() first"
    micro = min(batch.micro_batch_size, per_group)
    breadth, depth = config.schedule.micro_batches(per_group, micro)
    num_stages = config.model.multi_stage.num_stages(config.model.base_model.transformer.num_layers)
    splits = config.schedule.micro_batch_splits
    sequence_tensor = mesh.sequence_tensor_parallel
    piece = batch.sequence_length // sequence_data // splits // (tensor if sequence_tensor else 1)
    return RunLayout(
        **vars(mesh),
        expert_data=data // expert if expert > 1 else 1,
        sample_groups=groups,
        micro_batch_size=micro,
        breadth_first=breadth,
        depth_first=depth,
        micro_batch_splits=splits,
        order=config.schedule.order,
        num_stages=num_stages,
        stages_per_rank=tuple(
            len(pipeline_stages(num_stages, pipeline, r)) for r in range(pipeline)
        ),
        piece_length=piece,
    )
