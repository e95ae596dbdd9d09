"""The FLOPs a token costs, from the model's config alone (MFU, the pipeline simulator)."""

from __future__ import annotations

from fastllm.config.model import BaseModelConfig, FreezeConfig


def flops_per_token(
    config: BaseModelConfig, sequence_length: int, freeze: FreezeConfig | None = None
) -> float:
    """Training FLOPs per token, torchtitan's formula: 6 × (parameters that multiply, i.e. all
    but the embedding lookup; of a mixture of experts only the experts a token is routed to)
    + 12 × layers × heads × head size × sequence (attention, counted whole).

    Frozen parameters (`freeze`) need no weight gradient: 4 × their count (the forward pass
    and the input gradient), and 2 × (the forward pass alone, attention's third) in the
    frozen blocks before any trained parameter, where the backward pass stops."""
    t = config.transformer
    assert t.kv_channels is not None
    freeze = freeze or FreezeConfig()
    counts = config.parameter_counts(active=True)
    attention = 12 * t.num_attention_heads * t.kv_channels * sequence_length
    norms = 4 if freeze.norms else 6
    frozen_blocks = freeze.frozen_blocks()
    before_training = freeze.embeddings  # nothing before it trains: no backward pass there
    total = 0.0
    for block in range(t.num_layers):
        before_training = before_training and block in frozen_blocks
        if before_training:
            total += 2 * counts.block + attention / 3
        elif block in frozen_blocks:
            total += 4 * counts.block + attention
        else:
            total += 6 * (counts.block - counts.block_norms) + norms * counts.block_norms
            total += attention
    head = config.vocab_size * t.hidden_size  # tied or not, the head multiplies
    return total + norms * counts.final_norm + (4 if freeze.head else 6) * head
