from __future__ import annotations

from pathlib import Path

import pytest

from fastllm.config import ConfigError, TrainerConfig, dump_yaml, load_config, load_raw
from fastllm.config.model import LayerNormConfig, Llama3RotaryConfig

# The example of shared/DESIGN.md, verbatim: a Fast-LLM file must run as is.
DESIGN_EXAMPLE = """
run: {experiment_dir: /path/to/exp}
model:
  base_model:
    transformer:
      normalization: {type: rms_norm}
      num_layers: 24
      hidden_size: 4096
      num_attention_heads: 32
      head_groups: 4
      add_linear_biases: false
      rotary: {type: default, theta: 10000}
      gated: true
      activation_type: silu
    vocab_size: 32000
    tie_word_embeddings: false
  distributed: {training_dtype: bfloat16}
training:
  logs: {interval: 10}
  train_iters: 100000
  export: {interval: 10000}
batch: {batch_size: 1, sequence_length: 4096}
data: {path: [/mnt/data/dataset]}
optimizer: {learning_rate: {base: 0.0001}}
"""

# Published parameter counts of the models the examples reproduce (their Hugging Face configs).
PUBLISHED_PARAMETERS = {
    "llama3-1b": 1_235_814_400,
    "llama3-8b": 8_030_261_248,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "starcoder2-3b": 3_030_371_328,
    "qwen2-7b": 7_615_616_512,
    "qwen3-8b": 8_190_735_360,
    "olmo2-7b": 7_298_617_344,
}


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_qwen3_moe_example_has_the_published_total_and_active_parameters(examples: Path) -> None:
    """Qwen/Qwen3-30B-A3B's model card: 30.5B parameters, 3.3B activated, 29.9B without the
    embeddings (cut to tenths of billions)."""
    base = load_config(TrainerConfig, [examples / "qwen3-30b-a3b.yaml"]).model.base_model
    assert base.num_parameters() // 10**8 == 305
    assert base.num_parameters(active=True) // 10**8 == 33
    assert base.num_parameters(embeddings=False) // 10**8 == 299


def test_design_example_validates_with_fast_llm_names(tmp_path: Path) -> None:
    config = load_config(TrainerConfig, [write(tmp_path, DESIGN_EXAMPLE)])
    transformer = config.model.base_model.transformer
    assert transformer.head_groups == 4
    assert transformer.kv_channels == 128
    assert transformer.ffn_hidden_size == 4 * 4096
    assert config.model.distributed.training_dtype == "bfloat16"
    assert config.training.export.interval == 10000
    assert config.data.path == ["/mnt/data/dataset"]
    assert config.optimizer.learning_rate.base == pytest.approx(1e-4)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_examples_reproduce_published_parameter_counts(examples: Path, name: str) -> None:
    config = load_config(TrainerConfig, [examples / f"{name}.yaml"])
    assert config.model.base_model.num_parameters() == PUBLISHED_PARAMETERS[name]


def test_every_example_round_trips_through_dump(examples: Path, tmp_path: Path) -> None:
    for example in sorted(examples.glob("*.yaml")):
        config = load_config(TrainerConfig, [example])
        dumped = write(tmp_path, dump_yaml(config), f"{example.stem}.dump.yaml")
        assert load_config(TrainerConfig, [dumped]) == config, example.name


def test_overrides_set_nested_keys_lists_and_yaml_values(tmp_path: Path) -> None:
    base = write(tmp_path, "data: {path: [a, b]}\n")
    config = load_config(
        TrainerConfig,
        [base],
        [
            "model.base_model.transformer.rotary={type: llama3, theta: 500000}",
            "data.path[1]=c",
            "data.path.2=d",
            "data.weights=[1, 2, 3]",
            "optimizer.learning_rate.base=3e-4",
            "training.train_iters=5",
            "training.train_iters=7",
        ],
    )
    assert isinstance(config.model.base_model.transformer.rotary, Llama3RotaryConfig)
    assert config.model.base_model.transformer.rotary.theta == 500000
    assert config.data.path == ["a", "c", "d"]
    assert config.data.weights == [1.0, 2.0, 3.0]
    assert config.optimizer.learning_rate.base == pytest.approx(3e-4)
    assert config.training.train_iters == 7


def test_later_files_override_earlier_ones_key_by_key(tmp_path: Path) -> None:
    first = write(tmp_path, "batch: {batch_size: 8, sequence_length: 128}\n", "a.yaml")
    second = write(tmp_path, "batch: {batch_size: 4}\n", "b.yaml")
    raw = load_raw([first, second])
    assert raw == {"batch": {"batch_size": 4, "sequence_length": 128}}


def test_union_variant_defaults_when_type_is_omitted() -> None:
    config = load_config(
        TrainerConfig, overrides=["model.base_model.transformer.normalization.epsilon=1e-6"]
    )
    normalization = config.model.base_model.transformer.normalization
    assert normalization.epsilon == pytest.approx(1e-6)
    assert type(normalization).__name__ == "RMSNormConfig"
    config = load_config(
        TrainerConfig, overrides=["model.base_model.transformer.normalization.type=layer_norm"]
    )
    assert isinstance(config.model.base_model.transformer.normalization, LayerNormConfig)


def test_derived_defaults_follow_the_fields_they_derive_from() -> None:
    config = load_config(
        TrainerConfig,
        overrides=[
            "model.base_model.transformer.hidden_size=512",
            "model.base_model.transformer.gated=true",
        ],
    )
    transformer = config.model.base_model.transformer
    assert transformer.kv_channels == 512 // 8
    assert transformer.ffn_hidden_size == 2048
    assert transformer.activation_type == "silu"
    assert transformer.init_method_std == pytest.approx(512**-0.5)
    assert config.batch.micro_batch_size == config.batch.batch_size


@pytest.mark.parametrize(
    ("override", "path", "fragment"),
    [
        (
            "model.base_model.transformer.hiden_size=3",
            "model.base_model.transformer.hiden_size",
            "did you mean hidden_size?",
        ),
        ("trainng.train_iters=3", "trainng", "did you mean training?"),
        (
            "model.base_model.transformer.num_layers=abc",
            "model.base_model.transformer.num_layers",
            "expected int, got str: 'abc'",
        ),
        (
            "model.distributed.training_dtype=bf16",
            "model.distributed.training_dtype",
            "expected one of bfloat16, float16, float32",
        ),
        (
            "model.base_model.transformer.activation_type=sulu",
            "model.base_model.transformer.activation_type",
            "did you mean silu?",
        ),
        (
            "model.base_model.transformer.rotary.type=lama3",
            "model.base_model.transformer.rotary.type",
            "did you mean llama3?",
        ),
        ("data.path[0]=3", "data.path[0]", "expected str, got int: 3"),
        (
            "model.base_model.transformer.num_attention_heads=7",
            "model.base_model.transformer.num_attention_heads",
            "hidden_size (1024) must be divisible by num_attention_heads (7)",
        ),
        (
            "model.base_model.transformer.head_groups=3",
            "model.base_model.transformer.head_groups",
            "num_attention_heads (8) must be divisible by head_groups (3)",
        ),
        (
            "model.base_model.transformer.global_attention_interval=6",
            "model.base_model.transformer.global_attention_interval",
            "mixes sliding and global blocks but window_size is not set",
        ),
        (
            "model.base_model.transformer={window_size: 8, window_rotary: {theta: 10}}",
            "model.base_model.transformer.window_rotary",
            "is the sliding blocks' rotary beside global ones: it needs global_attention_interval",
        ),
        (
            "model.base_model.transformer.query_key_norm_scope=projection",
            "model.base_model.transformer.query_key_norm_scope",
            "is 'projection' but neither query_norm nor key_norm is set",
        ),
        (
            "model.base_model.transformer="
            "{query_norm: {type: layer_norm}, query_key_norm_scope: projection}",
            "model.base_model.transformer.query_norm",
            "layer_norm over the whole projection (query_key_norm_scope: projection) is not",
        ),
        ("batch.micro_batch_size=3", "batch.micro_batch_size", "must divide batch_size (1)"),
        ("model.base_model.vocab_size=0", "model.base_model.vocab_size", "must be positive, got 0"),
        ("data.weights=[1]", "data.weights", "has 1 entries but path has 0"),
        ("optimizer.beta_2=1.5", "optimizer.beta_2", "must be in [0, 1)"),
    ],
)
def test_errors_name_the_key_path_and_what_is_wrong(
    override: str, path: str, fragment: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(TrainerConfig, overrides=[override])
    assert caught.value.path == path
    assert fragment in caught.value.message


def test_override_errors_name_the_argument() -> None:
    with pytest.raises(ConfigError, match="key=value"):
        load_config(TrainerConfig, overrides=["training.train_iters"])
    with pytest.raises(ConfigError, match=r"data.path\[3\]: index out of range"):
        load_config(TrainerConfig, overrides=["data.path=[a]", "data.path[3]=b"])
    with pytest.raises(ConfigError, match="not a valid key"):
        load_config(TrainerConfig, overrides=["a..b=1"])


def test_yaml_errors_name_the_file_and_line(tmp_path: Path) -> None:
    broken = write(tmp_path, "run:\n  experiment_dir: x\nbatch: [1\n")
    with pytest.raises(ConfigError) as caught:
        load_config(TrainerConfig, [broken])
    assert caught.value.path.startswith(f"{broken}:")
    duplicated = write(tmp_path, "batch:\n  batch_size: 1\n  batch_size: 2\n", "dup.yaml")
    with pytest.raises(ConfigError, match="duplicate key 'batch_size'") as caught:
        load_config(TrainerConfig, [duplicated])
    assert caught.value.path == f"{duplicated}:3:3"
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(TrainerConfig, [tmp_path / "missing.yaml"])
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(TrainerConfig, [write(tmp_path, "- 1\n", "list.yaml")])


def test_exponent_floats_without_a_dot_are_numbers(tmp_path: Path) -> None:
    config = load_config(TrainerConfig, [write(tmp_path, "optimizer: {epsilon: 1e-6}\n")])
    assert config.optimizer.epsilon == pytest.approx(1e-6)


@pytest.mark.parametrize(
    ("override", "path"),
    [
        ("optimizer.weight_decay=.inf", "optimizer.weight_decay"),
        ("optimizer.learning_rate.base=.inf", "optimizer.learning_rate.base"),
        ("model.base_model.transformer.expert_z_loss_coefficient=.nan", "model.base_model.transformer.expert_z_loss_coefficient"),
        ("model.base_model.transformer.rotary.theta=.inf", "model.base_model.transformer.rotary.theta"),
        ("training.train_iters=9223372036854775808", "training.train_iters"),
        ("model.distributed.seed=100000000000000000000", "model.distributed.seed"),
        ("training.checkpoint.keep=-9223372036854775809", "training.checkpoint.keep"),
    ],
)  # fmt: skip
def test_non_finite_floats_and_integers_beyond_64_bits_are_rejected_naming_the_key(
    override: str, path: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(TrainerConfig, overrides=["data.path=[a, b]", override])
    assert caught.value.path == path
    assert "finite" in caught.value.message or "64-bit integer" in caught.value.message
    largest = load_config(TrainerConfig, overrides=["model.distributed.seed=9223372036854775807"])
    assert largest.model.distributed.seed == 2**63 - 1


def test_a_union_type_that_is_not_a_name_is_refused_naming_the_key() -> None:
    # Found by tests/fuzz: a list as the type of a tagged union was a TypeError (unhashable).
    for value in ("[]", "{a: 1}", "3"):
        with pytest.raises(ConfigError, match="unknown type") as caught:
            load_config(
                TrainerConfig, overrides=[f"model.base_model.transformer.rotary.type={value}"]
            )
        assert caught.value.path == "model.base_model.transformer.rotary.type"


def test_a_control_character_in_yaml_is_refused_in_one_line(tmp_path: Path) -> None:
    # Found by tests/fuzz: PyYAML's reader error spans two lines.
    with pytest.raises(ConfigError) as caught:
        load_config(TrainerConfig, overrides=["run.experiment_dir=\x1f"])
    assert "\n" not in str(caught.value) and "#x001f" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        load_config(TrainerConfig, [write(tmp_path, "run: {experiment_dir: a\x07}\n")])
    assert "\n" not in str(caught.value) and caught.value.path.endswith("config.yaml")
