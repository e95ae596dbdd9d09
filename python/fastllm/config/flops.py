"""The FLOPs a token costs, from the model's config alone (MFU, the pipeline simulator)."""

from __future__ import annotations

from fastllm.config.model import BaseModelConfig


def flops_per_token(config: BaseModelConfig, sequence_length: int) -> float:
    """Training FLOPs per token, torchtitan's formula: 6 × (parameters that multiply, i.e. all
    but the embedding lookup; of a mixture of experts only the experts a token is routed to)
    + 12 × layers × heads × head size × sequence (attention)."""
    t = config.transformer
    assert t.kv_channels is not None
    active = config.num_parameters(embeddings=False, active=True)
    matmul_parameters = active + config.vocab_size * t.hidden_size
    attention = 12 * t.num_layers * t.num_attention_heads * t.kv_channels * sequence_length
    return 6 * matmul_parameters + attention
