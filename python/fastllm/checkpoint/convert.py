"""`fastllm convert`: checkpoints between fastllm's format and Hugging Face architectures."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from fastllm.checkpoint.errors import CheckpointWriteError
from fastllm.checkpoint.formats import open_model, write_model
from fastllm.config import ConfigError
from fastllm.config.convert import ConvertConfig


def convert(config: ConvertConfig) -> Path:
    """Convert and return the output directory. The output is written under a temporary name
    and renamed when complete, so an interrupted conversion never looks finished."""
    import torch

    output = Path(config.output.path)
    if output.exists():
        raise ConfigError("output.path", f"{output} already exists")
    source = open_model(config.input.path, config.input.format)
    dtype = None if config.dtype is None else getattr(torch, config.dtype)
    partial = output.with_name(f".{output.name}.partial-{os.getpid()}")
    try:
        write_model(
            source,
            partial,
            config.output.format,
            dtype=dtype,
            shard_bytes=int(config.shard_size_gb * 2**30),
        )
        os.replace(partial, output)
    except OSError as error:  # disk full, …
        raise CheckpointWriteError(output, str(error)) from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return output
