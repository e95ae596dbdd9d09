"""The run's geometry resolved once (`fastllm.config.layout`): the sizes of several configs on
several world sizes, the compatibility table's refusals, and `fastllm config validate
--world-size`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fastllm.config import ConfigError, TrainerConfig, load_config
from fastllm.config.layout import COMPATIBILITY, Incompatibility, StepShape, resolve
from fastllm.config.model import BlockConfig, TransformerConfig
from tests.conftest import ROOT

TINY = ROOT / "examples" / "tiny.yaml"
"""4 layers, 8 heads in 2 groups, batches of 8 sequences of 256 tokens."""


def tiny(*overrides: str) -> TrainerConfig:
    return load_config(TrainerConfig, [TINY], list(overrides))


@pytest.mark.parametrize(
    ("overrides", "world_size", "expected"),
    [
        (
            (),
            1,
            dict(tensor=1, data=1, pipeline=1, sample_groups=1, micro_batch_size=8,
                 breadth_first=1, depth_first=1, num_stages=4, stages_per_rank=(4,),
                 piece_length=256),
        ),
        (
            ("batch.micro_batch_size=2",),
            4,
            dict(data=4, sample_groups=4, micro_batch_size=2, breadth_first=1, depth_first=1),
        ),
        (
            ("model.distributed.tensor_parallel=2", "model.distributed.pipeline_parallel=2",
             "batch.micro_batch_size=1", "schedule.breadth_first_micro_batches=2"),
            8,
            dict(tensor=2, data=2, pipeline=2, micro_batch_size=1, breadth_first=2,
                 depth_first=2, num_stages=4, stages_per_rank=(2, 2)),
        ),
        (
            ("model.distributed.pipeline_parallel=3", "model.multi_stage.layers_per_stage=1",
             "schedule.order=depth_first"),
            3,
            dict(pipeline=3, data=1, num_stages=4, stages_per_rank=(2, 1, 1),
                 order="depth_first"),
        ),
        (
            ("model.distributed.sequence_data_parallel=2",
             "model.distributed.sequence_data_chunking=head_tail",
             "model.distributed.tensor_parallel=2",
             "model.distributed.sequence_tensor_parallel=true"),
            8,
            dict(tensor=2, data=4, sequence_data=2, sample_groups=2, micro_batch_size=4,
                 sequence_tensor_parallel=True, piece_length=64),
        ),
        (
            ("model.base_model.transformer.num_experts=4",
             "model.base_model.transformer.add_linear_biases=only_attn_qkv",
             "model.distributed.expert_parallel=2"),
            8,
            dict(data=8, expert=2, expert_data=4, sample_groups=8, micro_batch_size=1),
        ),
        (
            ("schedule.micro_batch_splits=4", "batch.micro_batch_size=2"),
            2,
            dict(data=2, micro_batch_size=2, depth_first=2, micro_batch_splits=4,
                 piece_length=64),
        ),
    ],
    ids=["one-process", "data-4", "tp2-pp2-dp2", "looped-pp3", "sdp2-tp2-sequence", "ep2",
         "pieces"],
)  # fmt: skip
def test_resolve_gives_every_size_of_the_run(
    overrides: tuple[str, ...], world_size: int, expected: dict[str, object]
) -> None:
    layout = resolve(tiny(*overrides), world_size)
    assert layout.world_size == world_size
    assert layout.tensor * layout.data * layout.pipeline == world_size
    assert {key: getattr(layout, key) for key in expected} == expected


def test_the_step_shape_is_the_layouts_stages_and_micro_batches() -> None:
    layout = resolve(
        tiny("model.distributed.pipeline_parallel=2", "schedule.breadth_first_micro_batches=4",
             "batch.micro_batch_size=1", "schedule.micro_batch_splits=2"),
        2,
    )  # fmt: skip
    assert layout.step == StepShape(4, 2, breadth_first=4, depth_first=2, pieces=2)
    assert layout.step.stages_of(1) == [1, 3]
    assert len(layout.step.stages_of(0)) == layout.stages_per_rank[0]


LORA = "model.base_model.peft={type: lora}"
DPO = (
    "reference_models.reference.pretrained.path=reference",
    "model.base_model.head.losses={dpo: {type: dpo}}",
)
IPO = (DPO[0], "model.base_model.head.losses={dpo: {type: dpo, loss_type: ipo}}")
LATENT = (
    "model.base_model.transformer.head_groups=8",
    "model.base_model.transformer.window_size=null",
    "model.base_model.transformer.add_linear_biases=false",
    "model.base_model.transformer.mixer={type: latent_attention, kv_lora_rank: 16, "
    "qk_head_dim: 16, qk_pos_emb_head_dim: 16, v_head_dim: 32}",
)
PREDICTION = "model.base_model.multi_token_prediction={depth: 1}"
OTHER_BLOCK = "model.base_model.transformer.block={type: test_layout_block}"


class OtherBlockConfig(BlockConfig, tag="test_layout_block"):
    """A block of another package (never built here)."""

    def num_norm_parameters(self, transformer: TransformerConfig) -> int:
        return 0


ODD_LATENT = "model.base_model.transformer.mixer={type: latent_attention, kv_lora_rank: 15}"
ROW_SETTINGS = {
    ("training.compile", "model.distributed.tensor_parallel"):
        ("training.compile=true", "model.distributed.tensor_parallel=2"),
    ("training.compile", "model.distributed.sequence_data_parallel"):
        ("training.compile=true", "model.distributed.sequence_data_parallel=2"),
    ("training.compile", "model.distributed.fp8_linear"):
        ("training.compile=true", "model.distributed.training_dtype=bfloat16",
         "model.distributed.fp8_linear=rowwise"),
    ("model.distributed.fp8_linear", "model.distributed.tensor_parallel"):
        ("model.distributed.training_dtype=bfloat16", "model.distributed.fp8_linear=tensorwise",
         "model.distributed.tensor_parallel=2"),
    ("model.multi_stage.offload_activations", "training.compile"):
        ("model.multi_stage.offload_activations=1", "training.compile=true"),
    ("model.multi_stage.offload_activations", "model.distributed.pipeline_parallel"):
        ("model.multi_stage.offload_activations=1", "model.distributed.pipeline_parallel=2"),
    ("model.multi_stage.offload_activations", "schedule.breadth_first_micro_batches"):
        ("model.multi_stage.offload_activations=1", "schedule.breadth_first_micro_batches=2"),
    ("model.multi_stage.offload_activations", "schedule.micro_batch_splits"):
        ("model.multi_stage.offload_activations=1", "schedule.micro_batch_splits=2"),
    ("schedule.micro_batch_splits", "model.distributed.sequence_data_parallel"):
        ("schedule.micro_batch_splits=2", "model.distributed.sequence_data_parallel=2"),
    ("schedule.micro_batch_splits", "model.multi_stage.recompute"):
        ("schedule.micro_batch_splits=2", "model.multi_stage.recompute=full"),
    ("model.freeze", "training.export"):
        ("model.freeze.blocks=[0,1]", "training.export.format=distributed"),
    ("model.base_model.peft", "training.export"): (LORA, "training.export.format=distributed"),
    ("model.base_model.head.losses", "model.distributed.sequence_data_parallel"):
        (*IPO, "model.distributed.sequence_data_parallel=2"),
    ("model.base_model.transformer.mixer", "model.distributed.sequence_data_parallel"):
        (*LATENT[:-1], ODD_LATENT, "model.distributed.sequence_data_parallel=2"),
    ("model.base_model.multi_token_prediction", "model.distributed.pipeline_parallel"):
        (PREDICTION, "model.distributed.pipeline_parallel=2"),
    ("model.base_model.multi_token_prediction", "model.distributed.sequence_data_parallel"):
        (PREDICTION, "model.distributed.sequence_data_parallel=2"),
    ("model.base_model.multi_token_prediction", "schedule.micro_batch_splits"):
        (PREDICTION, "schedule.micro_batch_splits=2"),
    ("model.base_model.multi_token_prediction", "model.base_model.head.losses"):
        (PREDICTION, *DPO),
    ("model.base_model.transformer.block", "model.base_model.peft"):
        (OTHER_BLOCK, LORA, "training.export.format=fastllm"),  # LoRA's distributed export row
    ("model.base_model.transformer.block", "model.multi_stage.recompute"):
        (OTHER_BLOCK, "model.multi_stage.recompute=selective"),
}  # fmt: skip
"""Settings under which each row of the table holds, and no earlier one."""


@pytest.mark.parametrize(
    "row", COMPATIBILITY, ids=[f"{r.setting.key}-with-{r.other.key}" for r in COMPATIBILITY]
)
def test_every_row_of_the_compatibility_table_refuses_naming_its_keys(
    row: Incompatibility,
) -> None:
    overrides = ROW_SETTINGS[(row.setting.key, row.other.key)]
    with pytest.raises(ConfigError) as caught:
        tiny(*overrides)
    assert caught.value.path == row.setting.key
    assert "not supported yet" in caught.value.message
    assert row.other.key in caught.value.message
    assert row.reason in caught.value.message
    # Each setting alone is fine (the architecture and dtype it needs kept; the tiny config's
    # distributed export, which frozen parameters cannot write, made a fastllm one).
    context = [
        o
        for o in overrides
        if o.startswith(("model.distributed.training", "model.base"))
        and o not in (LORA, PREDICTION, LATENT[-1], ODD_LATENT, OTHER_BLOCK)  # the rows' own
        and not any(o in losses for losses in (DPO, IPO))
    ]
    for override in overrides:
        # A reference model needs its loss, and a loss its reference model.
        together = next((o for o in (DPO, IPO) if override in o), (override,))
        tiny("training.export.format=fastllm", *together, *context)


def test_the_table_has_one_row_per_pair_of_settings() -> None:
    pairs = [(row.setting.key, row.other.key) for row in COMPATIBILITY]
    assert len(set(pairs)) == len(pairs) == len(ROW_SETTINGS)


@pytest.mark.parametrize(
    ("overrides", "world_size", "key", "words"),
    [
        (("model.distributed.tensor_parallel=2",), 3, "model.distributed.tensor_parallel",
         "must divide the number of ranks (3)"),
        (("model.distributed.pipeline_parallel=2", "model.distributed.tensor_parallel=2"), 6,
         "model.distributed.tensor_parallel", "(2) × model.distributed.pipeline_parallel (2)"),
        (("model.distributed.sequence_data_parallel=4",), 2,
         "model.distributed.sequence_data_parallel", "data-parallel size (2"),
        (("model.base_model.transformer.num_experts=4",
          "model.base_model.transformer.add_linear_biases=nowhere",
          "model.distributed.expert_parallel=4"), 2,
         "model.distributed.expert_parallel", "data-parallel size (2"),
        (("batch.batch_size=6",), 4, "batch.batch_size", "data-parallel size, 4"),
        (("batch.micro_batch_size=4", "schedule.breadth_first_micro_batches=3"), 1,
         "schedule.breadth_first_micro_batches", "(3) must divide"),
    ],
    ids=["tensor-by-ranks", "tensor-pipeline-by-ranks", "sdp-by-data", "ep-by-data",
         "batch-by-groups", "micro-batches"],
)  # fmt: skip
def test_sizes_that_do_not_fit_the_ranks_name_their_keys(
    overrides: tuple[str, ...], world_size: int, key: str, words: str
) -> None:
    config = tiny(*overrides)
    with pytest.raises(ConfigError) as caught:
        resolve(config, world_size)
    assert caught.value.path == key
    assert words in caught.value.message


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (("model.distributed.tensor_parallel=3",), "model.distributed.tensor_parallel",
         "must divide model.base_model.transformer.num_attention_heads (8)"),
        (("model.distributed.tensor_parallel=4",), "model.distributed.tensor_parallel",
         "must divide model.base_model.transformer.head_groups (2)"),
        (("model.distributed.pipeline_parallel=5",), "model.distributed.pipeline_parallel",
         "(5) is more than the model's stages (4"),
        (("model.distributed.sequence_data_parallel=3",), "batch.sequence_length",
         "model.distributed.sequence_data_parallel (3)"),
    ],
    ids=["heads-by-tensor", "groups-by-tensor", "stages-by-pipeline", "length-by-chunks"],
)  # fmt: skip
def test_sizes_that_do_not_divide_each_other_are_refused_on_load(
    overrides: tuple[str, ...], key: str, words: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        tiny(*overrides)
    assert caught.value.path == key
    assert words in caught.value.message


def fastllm(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fastllm.cli", *arguments], capture_output=True, text=True, cwd=ROOT
    )


def test_config_validate_prints_the_layout_on_the_given_ranks() -> None:
    result = fastllm(
        "config", "validate", "-c", "examples/tiny.yaml", "--world-size", "8",
        "model.distributed.tensor_parallel=2", "model.distributed.pipeline_parallel=2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "valid;" in result.stdout
    for line in ("  world_size: 8", "  tensor: 2", "  data: 2", "  pipeline: 2",
                 "  sample_groups: 2", "  micro_batch_size: 4", "  stages_per_rank: [2, 2]"):  # fmt: skip
        assert f"{line}\n" in result.stdout
    assert "layout:" not in fastllm("config", "validate", "-c", "examples/tiny.yaml").stdout


def test_config_validate_exits_2_naming_the_key_that_does_not_fit_the_ranks() -> None:
    result = fastllm(
        "config", "validate", "-c", "examples/tiny.yaml", "--world-size", "4",
        "batch.batch_size=6",
    )  # fmt: skip
    assert result.returncode == 2
    assert "batch.batch_size: (6) must be divisible" in result.stderr
    assert "Traceback" not in result.stderr
    result = fastllm(
        "config", "validate", "-c", "examples/tiny.yaml", "--world-size", "2",
        "schedule.micro_batch_splits=2", "model.multi_stage.recompute=full",
    )  # fmt: skip
    assert result.returncode == 2
    assert (
        "schedule.micro_batch_splits: not supported yet with model.multi_stage.recompute=full"
        in (result.stderr)
    )


def test_resolving_a_layout_imports_no_torch() -> None:
    probe = (
        "import sys\n"
        "from fastllm.cli import main\n"
        f"assert main(['config', 'validate', '-c', {str(TINY)!r}, '--world-size', '2']) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
