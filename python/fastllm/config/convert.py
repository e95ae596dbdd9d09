"""`fastllm convert`: which checkpoint to read and which to write."""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

from fastllm.config.formats import ModelFormat
from fastllm.config.section import ConfigError, Section


class CheckpointLocation(Section):
    aliases: ClassVar[dict[str, str]] = {"type": "format"}

    format: ModelFormat = "fastllm"
    """fastllm (safetensors + config.yaml), distributed (a training export or checkpoint; input
    only), or a Hugging Face architecture; `type` is a synonym."""
    path: str = ""
    """Directory of the checkpoint."""

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("path", "is required")


class ConvertConfig(Section):
    input: CheckpointLocation = msgspec.field(default_factory=CheckpointLocation)
    """The checkpoint to read."""
    output: CheckpointLocation = msgspec.field(default_factory=CheckpointLocation)
    """The checkpoint to write; the directory must not exist yet."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Cast the weights to this dtype (none: keep the input's)."""
    shard_size_gb: float = 4.0
    """Largest safetensors file written; a bigger model is split into shards."""

    def validate(self) -> None:
        if self.input.format == "peft":
            raise ConfigError(
                "input.format",
                "peft is an adapter, not a model: train from its base with pretrained.adapter, "
                "or load it onto the base with peft",
            )
        if self.output.format == "distributed":
            raise ConfigError("output.format", "distributed is written by training, not by convert")
        if self.shard_size_gb <= 0:
            raise ConfigError("shard_size_gb", f"must be positive, got {self.shard_size_gb}")
