"""Components of other packages (config/registry.py): found by import path or entry point,
checked, shown and documented as fastllm's own, and each failure an error naming the key, the
type and why."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

from fastllm.config import ConfigError, TrainerConfig, build, registry
from fastllm.config.model import (
    BlockConfig,
    DecoderBlockConfig,
    LossConfig,
    MixerConfig,
    MLPBaseConfig,
    NormalizationConfig,
    TransformerConfig,
)
from fastllm.config.reference import reference
from fastllm.config.section import check_positive
from fastllm.config.yaml_io import dump_yaml
from tests.test_cli import fastllm

HERE = "tests.config.test_registry"
MLP_KEY = "model.base_model.transformer.mlp"


class WideMLPConfig(MLPBaseConfig, tag="test_wide_mlp"):
    """A test MLP of another package."""

    unsupported_settings: ClassVar[dict[str, str]] = {
        "model.distributed.pipeline_parallel": "a test says so"
    }

    width: int = 7
    """The test's own field."""

    def validate(self) -> None:
        check_positive(self.width, "width")

    def num_parameters(self, transformer: TransformerConfig, *, active: bool = False) -> int:
        return 2 * transformer.hidden_size * self.width


class ScaleNormConfig(NormalizationConfig, tag="test_scale_norm"):
    """A test normalization of another package, only ever named by its entry point."""


def mlp(value: dict[str, Any], *overrides: tuple[str, Any]) -> TrainerConfig:
    transformer: dict[str, Any] = {"mlp": value, "num_layers": 2, "hidden_size": 64}
    raw: dict[str, Any] = {"model": {"base_model": {"transformer": transformer}}}
    for key, setting in overrides:
        *parents, last = key.split(".")
        section = raw
        for part in parents:
            section = section.setdefault(part, {})
        section[last] = setting
    return build(TrainerConfig, raw)


def refused(value: dict[str, Any], *overrides: tuple[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        mlp(value, *overrides)
    return caught.value


def test_an_import_path_type_is_built_checked_and_named_by_its_tag() -> None:
    config = mlp({"type": f"{HERE}:WideMLPConfig", "width": 3})
    component = config.model.base_model.transformer.mlp
    assert isinstance(component, WideMLPConfig) and component.width == 3
    assert mlp({"type": "test_wide_mlp"}).model.base_model.transformer.mlp == WideMLPConfig()
    assert "mlp:\n        type: test_wide_mlp\n        width: 3\n" in dump_yaml(config)
    t, counts = config.model.base_model.transformer, config.model.base_model.parameter_counts()
    assert counts.block == t.mixer.num_parameters(t) + 2 * 64 * 3 + counts.block_norms


def test_a_components_own_checks_and_keys_are_refused_at_its_full_key() -> None:
    error = refused({"type": "test_wide_mlp", "width": 0})
    assert error.path == f"{MLP_KEY}.width" and "must be positive" in error.message
    error = refused({"type": "test_wide_mlp", "widht": 2})
    assert error.path == f"{MLP_KEY}.widht" and "did you mean width?" in error.message
    error = refused({"type": "test_wide_mlp", "width": "wide"})
    assert error.path == f"{MLP_KEY}.width" and "expected int" in error.message


def test_an_unknown_type_lists_the_choices_and_how_to_add_one() -> None:
    error = refused({"type": "mpl"})
    assert error.path == f"{MLP_KEY}.type"
    assert "unknown type 'mpl'; expected one of" in error.message
    assert error.message.endswith("; did you mean mlp?")
    assert "module:Class" in error.message and "fastllm.mlp" in error.message


def test_an_import_that_fails_names_the_key_the_type_and_the_error(tmp_path: Path) -> None:
    error = refused({"type": "no_such_package.layers:MLP"})
    assert error.path == f"{MLP_KEY}.type"
    assert "'no_such_package.layers:MLP'" in error.message
    assert "ModuleNotFoundError: No module named 'no_such_package'" in error.message
    (tmp_path / "broken_plugin.py").write_text("raise RuntimeError('the plugin is broken')\n")
    sys.path.insert(0, str(tmp_path))
    try:
        error = refused({"type": "broken_plugin:MLP"})
    finally:
        sys.path.remove(str(tmp_path))
    assert "RuntimeError: the plugin is broken" in error.message
    error = refused({"type": f"{HERE}:ScaleNormConfig"})
    assert "is not a MLPBaseConfig subclass (a mlp component)" in error.message


def entry_point(name: str, value: str, group: str) -> importlib.metadata.EntryPoint:
    return importlib.metadata.EntryPoint(name=name, value=value, group=group)


def test_an_entry_point_is_imported_when_its_name_is_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    imported: list[str] = []

    def entry_points(point: str) -> list[importlib.metadata.EntryPoint]:
        imported.append(point)
        return {
            "normalization": [
                entry_point("test_scale_norm", f"{HERE}:ScaleNormConfig", "fastllm.normalization"),
                entry_point("test_mislabelled", f"{HERE}:ScaleNormConfig", "fastllm.normalization"),
                entry_point("test_missing", "gone_plugin:Norm", "fastllm.normalization"),
            ]
        }.get(point, [])

    monkeypatch.setattr(registry, "_entry_points", entry_points)
    assert registry.lookup("normalization", "test_scale_norm", "k") is ScaleNormConfig
    with pytest.raises(ConfigError, match="entry point 'test_mislabelled' names ScaleNormConfig"):
        registry.lookup("normalization", "test_mislabelled", "k")
    with pytest.raises(ConfigError) as caught:
        registry.lookup("normalization", "test_missing", "model.base_model.transformer.key")
    assert caught.value.path == "model.base_model.transformer.key"
    assert "type 'test_missing' (entry point of fastllm.normalization: gone_plugin:Norm)" in (
        caught.value.message
    )
    assert "No module named 'gone_plugin'" in caught.value.message


def test_a_setting_a_component_does_not_support_is_refused_at_its_key() -> None:
    error = refused(
        {"type": "test_wide_mlp"},
        ("model.distributed.pipeline_parallel", 2),
        ("model.multi_stage.layers_per_stage", 1),
    )
    assert error.path == MLP_KEY
    assert "'test_wide_mlp' does not support model.distributed.pipeline_parallel=2" in (
        error.message
    )
    assert "a test says so" in error.message


def test_lora_and_experts_are_refused_on_an_mlp_of_another_package() -> None:
    lora = {"type": "lora", "layers": ["query", "mlp_1"]}
    error = refused({"type": "test_wide_mlp"}, ("model.base_model.peft", lora))
    assert error.path == "model.base_model.peft.layers" and "['mlp_1']" in error.message
    error = refused({"type": "test_wide_mlp"}, ("model.base_model.transformer.num_experts", 2))
    assert error.path == "model.base_model.transformer.num_experts"


def test_a_checkpoint_records_the_components_of_other_packages_and_requires_them() -> None:
    config = mlp({"type": "test_wide_mlp"})
    recorded = registry.record(config)
    assert recorded == {"mlp": {"test_wide_mlp": f"{HERE}:WideMLPConfig"}}
    registry.require(recorded, "checkpoint/4/manifest.json")
    missing = {"mlp": {**recorded["mlp"], "gone": "gone_plugin.mlp:GoneMLPConfig"}}
    with pytest.raises(ConfigError) as caught:
        registry.require(missing, "checkpoint/4/manifest.json")
    assert caught.value.path == "checkpoint/4/manifest.json"
    assert "mlp type 'gone'" in caught.value.message
    assert "No module named 'gone_plugin'" in caught.value.message


def test_the_reference_documents_the_components_of_installed_packages_on_request() -> None:
    assert "test_wide_mlp" not in reference(TrainerConfig)
    text = reference(TrainerConfig, plugins=True)
    assert "## `model.base_model.transformer.mlp` with `type: test_wide_mlp`" in text
    assert "| `width` | int | `7` | The test's own field. |" in text
    assert "`type:` `mlp` or `test_wide_mlp`" in text


def test_config_show_prints_a_component_named_by_import_path() -> None:
    result = fastllm("config", "show", f"{MLP_KEY}={{type: {HERE}:WideMLPConfig, width: 5}}")
    assert result.returncode == 0, result.stderr
    assert "    mlp:\n        type: test_wide_mlp\n        width: 5\n" in result.stdout
    result = fastllm("config", "validate", f"{MLP_KEY}.type=no_such_package:MLP")
    assert result.returncode == 2
    assert f"{MLP_KEY}.type: type 'no_such_package:MLP' cannot be imported" in result.stderr


class PlainMixerConfig(MixerConfig, tag="test_plain_mixer"):
    """A test mixer of another package that declares nothing."""

    def num_parameters(self, transformer: TransformerConfig) -> int:
        return 0


class PlainLossConfig(LossConfig, tag="test_plain_loss"):
    """A test loss of another package that declares nothing."""


def test_what_a_mixer_or_a_loss_must_handle_is_refused_until_it_says_it_does() -> None:
    mixer = {"model": {"base_model": {"transformer": {"mixer": {"type": "test_plain_mixer"}}}}}
    build(TrainerConfig, mixer)
    distributed = {"sequence_data_parallel": 2}
    with pytest.raises(ConfigError) as caught:
        build(TrainerConfig, {"model": {**mixer["model"], "distributed": distributed}})
    assert caught.value.path == "model.base_model.transformer.mixer"
    assert "model.distributed.sequence_data_parallel=2" in caught.value.message
    with pytest.raises(ConfigError, match=r"schedule\.micro_batch_splits=2"):
        build(TrainerConfig, {**mixer, "schedule": {"micro_batch_splits": 2}})
    loss = {"type": "test_plain_loss"}
    raw = {
        "base_model": {"head": {"losses": {"mine": loss}}},
        "distributed": {"tensor_parallel": 2},
    }
    with pytest.raises(ConfigError) as caught:
        build(TrainerConfig, {"model": raw})
    assert caught.value.path == "model.base_model.head.losses.mine"
    assert "the head's vocabulary is split over the tensor ranks" in caught.value.message
    label = {"base_model": {"head": {"losses": {"label": {}}}, "transformer": {"head_groups": 2}}}
    build(TrainerConfig, {"model": {**label, "distributed": {"tensor_parallel": 2}}})


BLOCK_KEY = "model.base_model.transformer.block"


class TwoNormBlockConfig(BlockConfig, tag="test_two_norm_block"):
    """A test block of another package, with two norms."""

    def num_norm_parameters(self, transformer: TransformerConfig) -> int:
        return 2 * transformer.normalization.num_parameters(transformer.hidden_size)


def block(value: dict[str, Any], *overrides: tuple[str, Any]) -> TrainerConfig:
    return mlp({"type": "mlp"}, (BLOCK_KEY, value), *overrides)


def test_the_block_is_a_point_whose_decoder_is_found_as_any_component() -> None:
    assert registry.is_point(BlockConfig)
    assert registry.builtins("block") == {"decoder": DecoderBlockConfig}
    assert registry.lookup("block", "decoder", f"{BLOCK_KEY}.type") is DecoderBlockConfig
    assert block({"type": "decoder"}) == mlp({"type": "mlp"})
    assert isinstance(TrainerConfig().model.base_model.transformer.block, DecoderBlockConfig)
    config = block({"type": f"{HERE}:TwoNormBlockConfig"})
    assert isinstance(config.model.base_model.transformer.block, TwoNormBlockConfig)
    assert registry.record(config) == {
        "block": {"test_two_norm_block": f"{HERE}:TwoNormBlockConfig"}
    }
    t, counts = config.model.base_model.transformer, config.model.base_model.parameter_counts()
    norms = 2 * t.normalization.num_parameters(64)
    assert counts.block_norms == norms
    assert counts.block == t.mixer.num_parameters(t) + t.mlp.num_parameters(t) + norms


def test_an_unknown_or_broken_block_type_is_refused_at_its_key() -> None:
    error = refused({"type": "mlp"}, (BLOCK_KEY, {"type": "decodr"}))
    assert error.path == f"{BLOCK_KEY}.type" and error.message.endswith("; did you mean decoder?")
    assert "fastllm.block" in error.message
    error = refused({"type": "mlp"}, (BLOCK_KEY, {"type": "no_such_package.blocks:Block"}))
    assert error.path == f"{BLOCK_KEY}.type"
    assert "ModuleNotFoundError: No module named 'no_such_package'" in error.message
    error = refused({"type": "mlp"}, (BLOCK_KEY, {"type": f"{HERE}:WideMLPConfig"}))
    assert "is not a BlockConfig subclass (a block component)" in error.message


@pytest.mark.parametrize(
    ("setting", "value", "reason"),
    [
        ("model.base_model.peft", {"type": "lora"}, "counted and exported as the decoder block's"),
        ("model.multi_stage.recompute", "selective", "wraps the decoder block's MLP"),
    ],
)
def test_what_reaches_into_the_decoder_block_is_refused_with_another_block(
    setting: str, value: Any, reason: str
) -> None:
    block({"type": "decoder"}, (setting, value))
    with pytest.raises(ConfigError) as caught:
        block({"type": "test_two_norm_block"}, (setting, value))
    assert caught.value.path == BLOCK_KEY
    assert f"not supported yet with {setting}" in caught.value.message
    assert reason in caught.value.message
    block({"type": "test_two_norm_block"}, ("model.multi_stage.recompute", "full"))
