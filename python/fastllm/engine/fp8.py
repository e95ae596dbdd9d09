"""FP8 compute of the blocks' linear layers, applied to a plain model from the outside.

The kernels compute a linear layer in FP8 when its weight's recipe carries an `Fp8Weight`
(fastllm_kernels/recipe.py, fp8/weight.py); this gives one to the recipes of the attention
projections' and the dense MLPs' weights, found through their parameters' metadata. The
embedding and the head stay bf16 (their precision matters most and the fused loss computes the
head), as do mixture-of-experts layers (their experts are not linear modules). The weights'
FP8 copies are refreshed once their version changes: the optimizer bumps it after writing the
compute weights (`AdamW.step`). A frozen weight (`model.freeze`, LoRA's base) computes in FP8
too, with no weight gradient (autograd asks for none, and it has no gradient sink); its copy
is kept for the run, quantized at its first use only (under ZeRO-3, its group's FP8 image is
made once: engine/fp8_gather.py). With delayed scaling the layers share one `AmaxHistories`
(of their inputs, output gradients and weights), which the trainer rolls after each optimizer
step and checkpoints; a frozen weight's history holds its one amax (`AmaxHistories.roll`)."""

from __future__ import annotations

import torch

from fastllm.config import ConfigError
from fastllm.model import GPTModel
from fastllm.model.attention import Attention
from fastllm.model.latent_attention import LatentAttention
from fastllm.model.mlp import MLP
from fastllm.model.parameters import meta_of
from fastllm_kernels.fp8.amax_history import AmaxHistories
from fastllm_kernels.fp8.weight import Fp8Weight

KEY = "model.distributed.fp8_linear"
MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (8.9) and Hopper (9.0) on."""


def apply_fp8(
    model: GPTModel,
    recipe: str,
    device: torch.device,
    *,
    keep_copies: bool,
    delayed: bool = False,
    history_length: int = 16,
) -> AmaxHistories | None:
    """Mark the FP8 layers (after the flat model made the parameters views of its buffers);
    returns the layers' amax histories under delayed scaling. On CPU the kernels emulate the
    FP8 rounding; a GPU must have FP8 tensor cores. `keep_copies`: keep each weight's FP8 copy
    for the step (a step of several forward passes per weight: micro-batches, splits, full
    recomputation); with one, the copy lives only for its product, and FP8 takes no more
    memory than bf16. A frozen weight always keeps its copy, a byte per parameter: its version
    never changes, so it is never quantized again.

    The attention projections are narrower than the MLP's (llama-1b's q/k/v: 2048 → 3072) and
    gain less, but they gain: keeping them bf16 measured 2.3% slower on llama-1b and 2.7% on
    llama-3b (bench/results/h200-c623d84, train_*_rowwise_mlp)."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            raise ConfigError(
                KEY,
                f"{recipe} needs FP8 tensor cores (compute capability 8.9 or more); "
                f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}",
            )
    elif device.type != "cpu":
        raise ConfigError(KEY, f"{recipe} runs on CUDA GPUs (or emulated on CPU), not {device}")
    layers: list[torch.nn.Linear] = []
    # fastllm's attention and dense MLPs among each block's own layers, whatever the block's
    # type (an MLP inside a mixture, its shared experts, stays bf16)
    for layer in (layer for block in model.layers for layer in block.children()):
        if isinstance(layer, LatentAttention):
            layers += layer.projections()
        elif isinstance(layer, Attention):
            layers += [layer.query_key_value, layer.dense]
        elif isinstance(layer, MLP):
            layers += [layer.layer_1, layer.layer_2]
    histories = AmaxHistories(len(layers), history_length, device) if delayed else None
    for index, layer in enumerate(layers):
        entry = None if histories is None else (histories, index)
        meta = meta_of(layer, "weight")
        assert meta.recipe is not None, "a projection's weight has a recipe"
        meta.recipe.fp8 = Fp8Weight(recipe, keep_copies or meta.frozen, entry)
    return histories
