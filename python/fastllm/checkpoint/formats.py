"""Model directories on disk: fastllm's own format and Hugging Face's, read as
(config, tensor stream) and written from one, tensor by tensor.

The fastllm format is a directory with `config.yaml` (the `model.base_model` section, loadable
as a config file), safetensors weights under fastllm's parameter names, and `metadata.json`
(`{"format": "fastllm", "hf_config": ...}` keeping the Hugging Face config a model came from,
so a round trip loses nothing)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch
import yaml
from safetensors.torch import save_file
from torch import Tensor

from fastllm.checkpoint import peft
from fastllm.checkpoint.architectures import ARCHITECTURES
from fastllm.checkpoint.distributed import MANIFEST, SavedCheckpoint
from fastllm.checkpoint.errors import WriteStopped
from fastllm.checkpoint.hf_config import from_hf_config, to_hf_config
from fastllm.checkpoint.hf_weights import rules
from fastllm.checkpoint.safetensors_io import SafetensorsReader, ShardedWriter
from fastllm.config import BaseModelConfig, ConfigError, build, registry
from fastllm.config.model import LoRAConfig, TransformerConfig
from fastllm.config.yaml_io import load_yaml_file

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
)


@dataclass
class ModelSource:
    """A model on disk: its config and a way to read its tensors under fastllm's names."""

    directory: Path
    format: str
    config: BaseModelConfig
    hf_config: dict[str, Any] | None = None
    loaded: dict[str, Tensor] | None = field(default=None, repr=False)
    """Tensors already in memory under fastllm's names (a model being trained), read instead
    of the directory's files."""
    distributed: SavedCheckpoint | None = field(default=None, repr=False)
    """The verified checkpoint or export of a `distributed` directory."""
    base: str | None = None
    """The model a LoRA run fine-tuned (its `pretrained.path`), named in a PEFT adapter's
    config."""

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Every tensor under fastllm's names. Before any is read, the files' headers (or the
        manifest) are checked against what the config implies: the same tensors, of the same
        shapes, of floating-point values; `ConfigError` naming the first that is not."""
        if self.loaded is not None:
            return iter(self.loaded.items())
        if self.distributed is not None:
            saved = self.distributed
            saved.check_dtypes()
            _check_shapes(
                self.directory / MANIFEST,
                "the manifest's config",
                parameter_shapes(self.config),
                {
                    name: (shape, self.directory / MANIFEST)
                    for name, shape in saved.whole_shapes().items()
                },
            )
            return saved.full_tensors()
        reader = SafetensorsReader(self.directory)
        if self.format == "fastllm":
            expected = parameter_shapes(self.config)
            _check_shapes(self.directory, "config.yaml", expected, reader.shapes())
            return ((name, reader.get(name)) for name in expected)
        model_rules = list(rules(self.config, self.format))
        ours = parameter_shapes(self.config)
        expected = {}
        for rule in model_rules:
            meta = torch.empty(ours[rule.ours], device="meta")
            for name, piece in zip(rule.theirs, rule.split(meta), strict=True):
                expected[name] = tuple(piece.shape)
        found = reader.shapes()
        if self.config.tie_word_embeddings:
            found.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
        _check_shapes(self.directory, "config.json", expected, found)
        return (
            (rule.ours, rule.join([reader.get(name) for name in rule.theirs]))
            for rule in model_rules
        )


def parameter_shapes(config: BaseModelConfig) -> dict[str, tuple[int, ...]]:
    """fastllm's tensors for this config and their shapes, from the model itself (built
    without memory)."""
    from fastllm.model import GPTModel

    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in GPTModel(config).state_dict().items()}


def _check_shapes(
    location: Path,
    implied_by: str,
    expected: dict[str, tuple[int, ...]],
    found: dict[str, tuple[tuple[int, ...], Path]],
) -> None:
    """The tensors `found` (shape, file) are those `expected`, with their shapes."""
    missing, unexpected = (
        sorted(expected.keys() - found.keys()),
        sorted(found.keys() - expected.keys()),
    )
    details = [
        f"{what} tensors {names[:5]}{' …' if len(names) > 5 else ''}"
        for what, names in (("missing", missing), ("unexpected", unexpected))
        if names
    ]
    if details:
        raise ConfigError(str(location), f"does not match {implied_by}: " + "; ".join(details))
    wrong = [name for name in expected if found[name][0] != expected[name]]
    if wrong:
        name = wrong[0]
        shape, file = found[name]
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise ConfigError(
            str(file), f"{name}: {implied_by} implies {expected[name]}, file has {shape}{more}"
        )


def open_model(directory: str | Path, expected_format: str | None = None) -> ModelSource:
    """Open a fastllm or Hugging Face model directory (`expected_format` checks which)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(str(directory), "no such model directory")
    if (directory / MANIFEST).is_file():
        saved = SavedCheckpoint(directory)  # its checksums verified
        source = ModelSource(directory, "distributed", saved.model_config(), distributed=saved)
    elif (directory / "config.yaml").is_file():
        raw = load_yaml_file(directory / "config.yaml")
        if isinstance(raw, dict):
            registry.require(raw.get("components") or {}, str(directory / "config.yaml"))
        try:
            base_raw = raw["model"]["base_model"]
        except (KeyError, TypeError):
            raise ConfigError(
                f"{directory / 'config.yaml'}", "has no model.base_model section"
            ) from None
        metadata_path = directory / "metadata.json"
        metadata = _json_object(metadata_path) if metadata_path.is_file() else {}
        source = ModelSource(
            directory, "fastllm", build(BaseModelConfig, base_raw), metadata.get("hf_config")
        )
    elif (directory / "config.json").is_file():
        hf_config = _json_object(directory / "config.json")
        architecture, config = from_hf_config(hf_config)
        from_tensors = ARCHITECTURES[architecture].from_tensors
        if from_tensors is not None:
            from_tensors(config, set(SafetensorsReader(directory).shapes()))
        source = ModelSource(directory, architecture, config, hf_config)
    else:
        raise ConfigError(
            str(directory), "is not a model directory (no config.yaml or config.json)"
        )
    if expected_format is not None and source.format != expected_format:
        raise ConfigError(str(directory), f"holds a {source.format} model, not {expected_format}")
    return source


def _json_object(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(str(path), f"is not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ConfigError(str(path), "is not a JSON object")
    return value


_LATER_TRANSFORMER_KEYS = (
    "normalization_placement",
    "query_norm",
    "key_norm",
    "query_key_norm_scope",
    "global_attention_interval",
    "window_rotary",
    "attention_scale",
    "scale_embeddings",
    "mixer",
    "mlp",
    "block",
    "expert_score_function",
    "expert_bias",
    "expert_bias_update_rate",
    "expert_groups",
    "expert_groups_per_token",
    "expert_routed_scaling_factor",
    "first_dense_layers",
    "dense_ffn_hidden_size",
)
"""Keys of `transformer` that fastllm-format configs have had since QK-norm and post-norms
(and Gemma 3's options; mixer, mlp and block: since they are components; DeepSeek-V3's
routing)."""


def _omit_later_defaults(transformer: dict[str, Any]) -> None:
    """`_LATER_TRANSFORMER_KEYS` (and a norm's zero_centered) left out at their defaults, as a
    model without those features has always been written."""
    defaults = {
        f.name: f.default
        if f.default_factory is msgspec.NODEFAULT
        else msgspec.to_builtins(f.default_factory())
        for f in msgspec.structs.fields(TransformerConfig)
    }
    for key in _LATER_TRANSFORMER_KEYS:
        if transformer[key] == defaults[key]:
            del transformer[key]
    for key in ("normalization", "query_norm", "key_norm"):
        norm = transformer.get(key)
        if norm is not None and not norm["zero_centered"]:
            del norm["zero_centered"]


def _until_stopped(
    tensors: Iterator[tuple[str, Tensor]], stop: Callable[[], bool]
) -> Iterator[tuple[str, Tensor]]:
    for name, tensor in tensors:
        if stop():
            raise WriteStopped(f"stopped before writing {name}")
        yield name, tensor


def write_model(
    source: ModelSource,
    output: Path,
    output_format: str,
    *,
    dtype: Any = None,
    shard_bytes: int = 4 * 2**30,
    stop: Callable[[], bool] | None = None,
) -> None:
    """Write `source` to the new directory `output` in `output_format`, streaming tensors.
    What can be refused (the format, the source's tensors) is checked before `output` is
    made. `stop` is asked before each tensor: once it returns true, `WriteStopped` is raised
    and `output` is left incomplete for the caller to remove."""
    if output_format not in ("fastllm", "peft") and output_format not in ARCHITECTURES:
        raise ConfigError("output.format", f"unknown format {output_format!r}")
    lora = isinstance(source.config.peft, LoRAConfig)
    if output_format == "peft":
        _write_adapter(source, output, stop)
        return
    hf_config = None
    config = source.config
    if output_format in ARCHITECTURES:
        config = peft.base_config(source.config)  # the adapters merged into their weights
        hf_config = to_hf_config(config, output_format, source.hf_config)
        for key, value in special_token_ids(source.directory).items():
            if hf_config.get(key) is None or key not in (source.hf_config or {}):
                hf_config[key] = value
    tensors = source.tensors()
    if lora and hf_config is not None:
        tensors = peft.merged(source.config, tensors)
    if stop is not None:
        tensors = _until_stopped(tensors, stop)
    output.mkdir(parents=True)
    writer = ShardedWriter(output, shard_bytes)
    if hf_config is None:
        for name, tensor in tensors:
            writer.add(name, tensor if dtype is None else tensor.to(dtype))
        writer.close()
        base_model = msgspec.to_builtins(source.config)
        del base_model["head"]  # how it was trained, not part of the model
        if not lora:  # as a model without adapters has always been written
            del base_model["peft"]
        if base_model["multi_token_prediction"] is None:  # as before it existed
            del base_model["multi_token_prediction"]
        _omit_later_defaults(base_model["transformer"])
        section: dict[str, Any] = {"model": {"base_model": base_model}}
        if components := registry.record(source.config):
            section["components"] = components  # what reading it needs installed
        (output / "config.yaml").write_text(yaml.safe_dump(section, sort_keys=False))
        metadata = {"format": "fastllm", "hf_config": source.hf_config}
        (output / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    else:
        by_name = {rule.ours: rule for rule in rules(config, output_format)}
        for name, tensor in tensors:
            rule = by_name[name]
            for their_name, piece in zip(rule.theirs, rule.split(tensor), strict=True):
                writer.add(their_name, (piece if dtype is None else piece.to(dtype)).clone())
        writer.close()
        (output / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    copy_tokenizer_files(source.directory, output)


def _write_adapter(source: ModelSource, output: Path, stop: Callable[[], bool] | None) -> None:
    """A PEFT adapter directory of the model's LoRA adapters, under the names of the Hugging
    Face architecture of its base."""
    if not isinstance(source.config.peft, LoRAConfig):
        raise ConfigError("output.format", "peft: the model has no LoRA adapters")
    architecture = peft.architecture_for(source.config, source.hf_config)
    config = peft.adapter_config(source.config, architecture, source.base)
    tensors = source.tensors()
    if stop is not None:
        tensors = _until_stopped(tensors, stop)
    adapters = dict(peft.peft_tensors(source.config, architecture, tensors))
    output.mkdir(parents=True)
    save_file(adapters, output / peft.WEIGHTS_FILE, {"format": "pt"})
    (output / peft.CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def special_token_ids(directory: Path, key: str = "input.path") -> dict[str, int | None]:
    """bos/eos ids for a Hugging Face config.json, from the tokenizer files in `directory`
    (None where unknown, so that transformers' defaults of another vocabulary never apply).
    `ConfigError` under `key` naming the file that cannot be read."""
    ids: dict[str, int | None] = {"bos_token_id": None, "eos_token_id": None}
    settings, vocabulary = directory / "tokenizer_config.json", directory / "tokenizer.json"
    if not (settings.is_file() and vocabulary.is_file()):
        return ids
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(vocabulary))
    except Exception as error:  # the tokenizers crate raises a bare Exception
        raise ConfigError(key, f"{vocabulary}: not a tokenizer ({str(error)[:200]})") from None
    try:
        config = json.loads(settings.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(key, f"{settings}: {error}") from None
    if not isinstance(config, dict):
        raise ConfigError(key, f"{settings}: not a JSON object")
    for name in ("bos", "eos"):
        token = config.get(f"{name}_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            ids[f"{name}_token_id"] = tokenizer.token_to_id(token)
    return ids


def copy_tokenizer_files(source: Path, destination: Path) -> None:
    """Tokenizer files travel with the weights, so the result is usable on its own."""
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, destination / name)
