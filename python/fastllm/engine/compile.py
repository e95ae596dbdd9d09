"""torch.compile of the transformer blocks, applied to a plain model from the outside."""

from __future__ import annotations

import torch

from fastllm.model import GPTModel


def apply_compile(model: GPTModel) -> None:
    """Compile each block's forward (after recomputation wrapped it, as torchtitan does), so
    inductor fuses the elementwise work between the matmuls and attention: residual adds,
    norms, rotary, activations. While compiling, the kernels hand over their torch references
    for inductor to fuse; the loss head and the optimizer keep their own kernels."""
    for layer in model.layers:
        # Default dynamism: dense blocks see one shape; MoE routing varies the tokens per
        # expert, which dynamo then marks dynamic instead of recompiling for every count.
        layer.forward = torch.compile(layer.forward)  # type: ignore[method-assign]
