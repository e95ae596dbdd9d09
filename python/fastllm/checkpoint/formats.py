"""Model directories on disk: fastllm's own format and Hugging Face's, read as
(config, tensor stream) and written from one, tensor by tensor.

The fastllm format is a directory with `config.yaml` (the `model.base_model` section, loadable
as a config file), safetensors weights under fastllm's parameter names, and `metadata.json`
(`{"format": "fastllm", "hf_config": ...}` keeping the Hugging Face config a model came from,
so a round trip loses nothing)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import yaml
from torch import Tensor

from fastllm.checkpoint.architectures import ARCHITECTURES
from fastllm.checkpoint.distributed import MANIFEST, SavedCheckpoint
from fastllm.checkpoint.hf_config import from_hf_config, to_hf_config
from fastllm.checkpoint.hf_weights import rules
from fastllm.checkpoint.safetensors_io import SafetensorsReader, ShardedWriter
from fastllm.config import BaseModelConfig, ConfigError, build
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

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        if self.distributed is not None:
            yield from self.distributed.full_tensors()
            return
        if self.loaded is not None:
            yield from self.loaded.items()
            return
        reader = SafetensorsReader(self.directory)
        if self.format == "fastllm":
            names = list(parameter_shapes(self.config))
            _check_names(self.directory, set(reader.keys()), set(names))
            for name in names:
                yield name, reader.get(name)
            return
        model_rules = list(rules(self.config, self.format))
        needed = {name for rule in model_rules for name in rule.theirs}
        present = set(reader.keys())
        if self.config.tie_word_embeddings:
            present.discard("lm_head.weight")  # some tied checkpoints store the copy anyway
        _check_names(self.directory, present, needed)
        for rule in model_rules:
            yield rule.ours, rule.join([reader.get(name) for name in rule.theirs])


def parameter_shapes(config: BaseModelConfig) -> dict[str, tuple[int, ...]]:
    """fastllm's tensor names for this config and their whole shapes, from the model itself
    (built without memory)."""
    import torch

    from fastllm.model import GPTModel

    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in GPTModel(config).state_dict().items()}


def _check_names(directory: Path, present: set[str], needed: set[str]) -> None:
    missing, unexpected = sorted(needed - present), sorted(present - needed)
    details = [
        f"{what} tensors {names[:5]}{' …' if len(names) > 5 else ''}"
        for what, names in (("missing", missing), ("unexpected", unexpected))
        if names
    ]
    if details:
        raise ConfigError(str(directory), "does not match its config: " + "; ".join(details))


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


def write_model(
    source: ModelSource,
    output: Path,
    output_format: str,
    *,
    dtype: Any = None,
    shard_bytes: int = 4 * 2**30,
) -> None:
    """Write `source` to the new directory `output` in `output_format`, streaming tensors."""
    output.mkdir(parents=True)
    if output_format == "fastllm":
        writer = ShardedWriter(output, shard_bytes)
        for name, tensor in source.tensors():
            writer.add(name, tensor if dtype is None else tensor.to(dtype))
        writer.close()
        section = {"model": {"base_model": msgspec.to_builtins(source.config)}}
        (output / "config.yaml").write_text(yaml.safe_dump(section, sort_keys=False))
        metadata = {"format": "fastllm", "hf_config": source.hf_config}
        (output / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    elif output_format in ARCHITECTURES:
        hf_config = to_hf_config(source.config, output_format, source.hf_config)
        for key, value in special_token_ids(source.directory).items():
            if hf_config.get(key) is None or key not in (source.hf_config or {}):
                hf_config[key] = value
        writer = ShardedWriter(output, shard_bytes)
        by_name = {rule.ours: rule for rule in rules(source.config, output_format)}
        for name, tensor in source.tensors():
            rule = by_name[name]
            for their_name, piece in zip(rule.theirs, rule.split(tensor), strict=True):
                writer.add(their_name, (piece if dtype is None else piece.to(dtype)).clone())
        writer.close()
        (output / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    else:
        raise ConfigError("output.format", f"unknown format {output_format!r}")
    copy_tokenizer_files(source.directory, output)


def special_token_ids(directory: Path) -> dict[str, int | None]:
    """bos/eos ids for a Hugging Face config.json, from the tokenizer files in `directory`
    (None where unknown, so that transformers' defaults of another vocabulary never apply)."""
    ids: dict[str, int | None] = {"bos_token_id": None, "eos_token_id": None}
    settings, vocabulary = directory / "tokenizer_config.json", directory / "tokenizer.json"
    if not (settings.is_file() and vocabulary.is_file()):
        return ids
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(vocabulary))
    config = json.loads(settings.read_text())
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
