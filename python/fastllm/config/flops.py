"""The FLOPs a token costs, from the model's config alone (MFU, the pipeline simulator)."""

from __future__ import annotations

from fastllm.config.model import BaseModelConfig, FreezeConfig, LoRAConfig


def flops_per_token(
    config: BaseModelConfig, sequence_length: int, freeze: FreezeConfig | None = None
) -> float:
    """Training FLOPs per token, torchtitan's formula: 6 × (parameters that multiply, i.e. all
    but the embedding lookup; of a mixture of experts only the experts a token is routed to)
    + 12 × layers × heads × head size × keys (attention, counted whole: the sequence, or in a
    sliding block the window where it is shorter, each query's keys; with latent attention
    6 × heads × (query head size + value head size) × keys, and its parameters are its real
    matmuls': the down projections, the latents' up projections and the output, as a token
    computes them). A mixture's first dense layers count their dense MLPs. Each multi-token
    prediction module counts as a block, its projection and norms, and the head (frozen as the
    model's are). A norm counts as its weight (and bias) would as a matmul's: 6 × the elements
    it scales, so a norm over each head (QK-norm) counts every head, not its one weight of a
    head's size.

    Frozen parameters (`freeze`, and under LoRA with `freeze_others` all but the adapters)
    need no weight gradient: 4 × their count (the forward pass and the input gradient), and
    2 × (the forward pass alone, attention's third) in the frozen blocks before any trained
    parameter, where the backward pass stops. LoRA adapters count 6 × their parameters."""
    t = config.transformer
    assert t.kv_channels is not None
    freeze = freeze or FreezeConfig()
    others = isinstance(config.peft, LoRAConfig) and config.peft.freeze_others
    counts = config.parameter_counts(active=True)
    heads = 6 * t.num_attention_heads * _score_and_value_width(config)
    norms = 4 if freeze.norms or others else 6
    frozen_blocks = freeze.frozen_blocks()
    before_training = freeze.embeddings or others  # no backward pass before a trained one
    total = 0.0
    for index, layer in enumerate(config.block_counts(active=True)):
        weights = layer.block - layer.block_norms
        block = weights + layer.block_norm_elements + layer.adapters
        attention = heads * min(t.window_of(index) or sequence_length, sequence_length)
        frozen = index in frozen_blocks
        before_training = before_training and frozen
        if before_training:
            total += 2 * block + attention / 3
        elif frozen:
            total += 4 * block + attention
        else:
            total += (4 if others else 6) * weights + norms * layer.block_norm_elements
            total += 6 * layer.adapters + attention
    head = config.vocab_size * t.hidden_size  # tied or not, the head multiplies
    head_factor = 4 if freeze.head or others else 6
    total += norms * counts.final_norm + head_factor * head
    prediction = config.multi_token_prediction
    if prediction is not None:  # a block, its projection and norms, and the head again
        module = counts.block - counts.block_norms + 2 * t.hidden_size**2
        norm_elements = counts.block_norm_elements + 3 * counts.final_norm
        for index in range(t.num_layers, t.num_layers + prediction.depth):
            window = min(t.window_of(index) or sequence_length, sequence_length)
            total += 6 * module + norms * norm_elements + head_factor * head + heads * window
    return total


def _score_and_value_width(config: BaseModelConfig) -> int:
    """Per head, the width of q·kᵀ plus that of the scores' product with v: 2 × head size, or
    with latent attention its query head size plus its value head size."""
    t = config.transformer
    if t.latent_mixer is not None:
        return t.latent_mixer.query_head_dim + t.latent_mixer.v_head_dim
    assert t.kv_channels is not None
    return 2 * t.kv_channels
