"""Checks and completions of a training config that need the file system, done before any
work starts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

from fastllm.config import ConfigError, TrainerConfig
from fastllm.config.layout import resolve
from fastllm.config.training import check_cadences


def with_pretrained_architecture(raw: dict[str, Any]) -> dict[str, Any]:
    """When a run starts from a checkpoint and sets no architecture in `model.base_model`
    (at most its `peft` adapters and its `head` losses), take the checkpoint's, with the
    config's adapters and losses."""
    pretrained = raw.get("pretrained")
    model = raw.get("model") or {}
    if not isinstance(pretrained, dict) or not isinstance(model, dict):
        return raw
    base = model.get("base_model") or {}
    if not isinstance(base, dict) or set(base) - {"peft", "head"}:
        return raw
    from fastllm.checkpoint.formats import open_model

    source = open_model(pretrained.get("path", ""), pretrained.get("format", "fastllm"))
    architecture = msgspec.to_builtins(source.config)
    architecture.pop("head")  # the losses it was trained on are not this run's
    architecture.update(base)
    adapter = pretrained.get("adapter")
    if adapter and "peft" not in base:  # the adapter's LoRA
        from fastllm.checkpoint import peft

        name = peft.architecture_for(source.config, source.hf_config)
        lora = peft.read_adapter_config(Path(adapter), source.config, name)
        architecture["peft"] = {"type": "lora", **msgspec.to_builtins(lora)}
    return {**raw, "model": {**model, "base_model": architecture}}


def check_inputs(config: TrainerConfig) -> None:
    """Everything the run will read exists, it has somewhere to write, and its layout fits
    the ranks torchrun started."""
    if config.run.experiment_dir is None:
        raise ConfigError("run.experiment_dir", "is required to train")
    experiment = Path(config.run.experiment_dir)
    existing = next(p for p in (experiment, *experiment.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError("run.experiment_dir", f"{existing} is a file, not a directory")
    if config.training.train_iters <= 0:
        raise ConfigError("training.train_iters", "must be positive to train")
    if not config.data.path and config.data.source is None:
        raise ConfigError("data.path", "no training dataset given (nor data.source)")
    phases = [
        (f"training.phases[{i}].data.path", phase.data.path)
        for i, phase in enumerate(config.training.phases)
        if phase.data is not None and phase.data.path is not None
    ]
    for key, paths in (
        ("data.path", config.data.path),
        *phases,
        ("data.validation_path", config.data.validation_path),
        *((f"data.datasets.{name}.path", d.path) for name, d in config.data.datasets.items()),
    ):
        for i, path in enumerate(paths):
            if not Path(path).exists():
                raise ConfigError(f"{key}[{i}]", f"{path}: no such dataset")
    if config.training.validation.interval and not config.data.validation_path:
        raise ConfigError(
            "training.validation.interval", "is set but data.validation_path is empty"
        )
    for key, paths in (("data.path", config.data.path), *phases):
        _check_preference(config, key, paths)
    resolve(config, int(os.environ.get("WORLD_SIZE", "1")))
    check_cadences(config.training)
    export = config.training.export
    if export.interval and export.format != "distributed":  # read at the first export
        from fastllm.checkpoint.formats import special_token_ids

        special_token_ids(Path(config.data.path[0]), "data.path[0]")


def _check_preference(config: TrainerConfig, key: str, paths: list[str]) -> None:
    """Preference pairs are trained with a dpo loss, and a dpo loss on preference pairs."""
    from fastllm.config.model import DPOLossConfig
    from fastllm.data.dataset import is_preference_dataset

    losses = config.model.base_model.head.losses
    dpo = next((name for name, loss in losses.items() if isinstance(loss, DPOLossConfig)), None)
    for i, path in enumerate(paths):
        preference = is_preference_dataset(Path(path))
        if preference and dpo is None:
            raise ConfigError(
                f"{key}[{i}]",
                f"{path} holds preference pairs: train them with a dpo loss "
                "(model.base_model.head.losses: {NAME: {type: dpo}})",
            )
        if dpo is not None and not preference:
            raise ConfigError(
                f"model.base_model.head.losses.{dpo}",
                f"a dpo loss needs preference pairs, and {key}[{i}] ({path}) holds none "
                "(fastllm prepare of prompt, chosen and rejected records)",
            )
