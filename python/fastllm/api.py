"""The Python API: load a fastllm or Hugging Face model directory as a `GPTModel`."""

from __future__ import annotations

from pathlib import Path

import torch

from fastllm.checkpoint.formats import open_model
from fastllm.model import GPTModel


def load_model(
    path: str | Path, device: str | torch.device | None = None, dtype: torch.dtype | None = None
) -> GPTModel:
    """The model stored in `path` (fastllm format or a supported Hugging Face architecture),
    in eval mode, on `device` (default CPU) in `dtype` (default: as stored)."""
    source = open_model(path)
    with torch.device("meta"):
        model = GPTModel(source.config)
    model.to_empty(device=device or "cpu")
    state = dict(source.tensors())
    if dtype is None:
        dtype = next(iter(state.values())).dtype
    model.to(dtype)
    model.load_state_dict(state, strict=True)
    return model.eval()
