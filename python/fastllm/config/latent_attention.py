"""`model.base_model.transformer.latent_attention`: multi-head latent attention (DeepSeek-V2
and V3), Megatron-LM's names for its sizes."""

from __future__ import annotations

import math

from fastllm.config.section import ConfigError, Section, check_non_negative, check_positive


class LatentAttentionConfig(Section):
    """Queries, keys and values from low-rank projections of the block's input: the keys and
    values of every head are up-projected from one normalized latent of `kv_lora_rank` per
    token, the queries from one of `q_lora_rank` (or projected whole); each head's query and
    key are a part without position (`qk_head_dim`) and a rotary part
    (`qk_pos_emb_head_dim`), the key's rotary part one per token, shared by the heads; the
    values have `v_head_dim` per head. Every head has its own key (head_groups is
    num_attention_heads) and kv_channels is qk_head_dim + qk_pos_emb_head_dim."""

    q_lora_rank: int | None = None
    """Rank of the queries' down projection (normalized, then up-projected to the heads); null
    projects the queries from the block's input whole (DeepSeek-V2-Lite, Moonlight)."""
    kv_lora_rank: int = 512
    """Rank of the keys' and values' shared latent."""
    qk_head_dim: int = 128
    """Per head, the query and key dimensions without rotary embedding (DeepSeek's
    qk_nope_head_dim)."""
    qk_pos_emb_head_dim: int = 64
    """Per head, the query and key dimensions with rotary embedding (DeepSeek's
    qk_rope_head_dim); the key's are computed once per token and shared by the heads."""
    v_head_dim: int = 128
    """Size of one value head, and of one head of attention's output."""
    latent_norm_epsilon: float = 1e-6
    """Epsilon of the RMSNorms of the two latents (DeepSeek's are 1e-6 whatever the blocks')."""
    mscale_all_dim: float = 0.0
    """With yarn rotary: the softmax scale (qk_head_dim + qk_pos_emb_head_dim)^-0.5 is
    multiplied by (0.1 · mscale_all_dim · ln(scale_factor) + 1)², as DeepSeek-V3 scales the
    dimensions without rotary too (0: not multiplied)."""

    def validate(self) -> None:
        for key in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "v_head_dim"):
            check_positive(getattr(self, key), key)
        check_positive(self.qk_pos_emb_head_dim, "qk_pos_emb_head_dim")
        if self.qk_pos_emb_head_dim % 2:
            raise ConfigError(
                "qk_pos_emb_head_dim",
                f"must be even (rotary pairs), got {self.qk_pos_emb_head_dim}",
            )
        check_positive(self.latent_norm_epsilon, "latent_norm_epsilon")
        check_non_negative(self.mscale_all_dim, "mscale_all_dim")

    @property
    def query_head_dim(self) -> int:
        """Size of one query (and key) head: both parts."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    def softmax_scale(self, yarn_scale_factor: float | None) -> float:
        """The scale of q·k: 1/√(query_head_dim), times yarn's mscale² when it applies."""
        scale = self.query_head_dim**-0.5
        if yarn_scale_factor is not None and yarn_scale_factor > 1 and self.mscale_all_dim:
            mscale = 0.1 * self.mscale_all_dim * math.log(yarn_scale_factor) + 1.0
            scale *= mscale * mscale
        return scale
