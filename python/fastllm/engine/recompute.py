"""Activation recomputation, applied to a plain model from the outside."""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from fastllm.model import GPTModel


def apply_recompute(model: GPTModel, level: str) -> None:
    """selective: each MLP recomputes its intermediate activations in the backward pass;
    full: each block recomputes everything but its input."""
    if level == "none":
        return
    for layer in model.layers:
        module: torch.nn.Module = layer if level == "full" else layer.mlp
        module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)  # type: ignore[method-assign]
