"""Activation recomputation, applied to a plain model from the outside."""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from fastllm.model import GPTModel
from fastllm.model.mlp import MLP, MixtureOfExperts
from fastllm.model.normalization import NormalizationLayer


def apply_recompute(model: GPTModel, level: str) -> None:
    """none: norms and gated activations store their outputs for the backward pass;
    elementwise (the model's own default): they recompute them; selective: each MLP also
    recomputes its intermediate activations; full: each block recomputes everything but its
    input."""
    if level == "none":
        for module in model.modules():
            if isinstance(module, NormalizationLayer):
                module.recompute = False
            elif isinstance(module, (MLP, MixtureOfExperts)):
                module.recompute_activation = False
    if level in ("none", "elementwise"):
        return
    for layer in model.layers:
        module: torch.nn.Module = layer if level == "full" else layer.mlp
        module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)  # type: ignore[method-assign]
