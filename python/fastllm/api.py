"""The Python API: load a fastllm or Hugging Face model directory as a `GPTModel`."""

from __future__ import annotations

from itertools import chain
from pathlib import Path

import torch

from fastllm.checkpoint import peft
from fastllm.checkpoint.formats import open_model
from fastllm.model import GPTModel


def load_model(
    path: str | Path,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    adapter: str | Path | None = None,
) -> GPTModel:
    """The model stored in `path` (fastllm format or a supported Hugging Face architecture),
    with the LoRA adapters of the PEFT adapter directory `adapter` if given (computed beside
    the base weights, not merged), in eval mode, on `device` (default CPU) in `dtype`
    (default: as stored)."""
    source = open_model(path)
    config, adapters = source.config, iter(())
    if adapter is not None:
        config, adapters = peft.with_adapter(config, source.hf_config, Path(adapter))
    with torch.device("meta"):
        model = GPTModel(config)
    state = dict(chain(source.tensors(), adapters))
    if dtype is None:
        dtype = next(iter(state.values())).dtype
    # Memory of the dtype at once: no full-precision copy to convert.
    model.to(dtype).to_empty(device=device or "cpu")
    model.load_state_dict(state, strict=True)
    return model.eval()
