"""`model.base_model.multi_token_prediction`: DeepSeek-V3's multi-token prediction modules."""

from __future__ import annotations

from fastllm.config.section import Section, check_non_negative, check_positive


class MultiTokenPredictionConfig(Section):
    """`depth` modules after the blocks, each predicting one token further: module k (from 1)
    projects [norm(embedding of token i + k); norm(h_i of module k - 1, the blocks' output for
    the first)] to the hidden size, runs a transformer block of its own on it, and its output,
    through a norm of its own and the model's head, is trained on token i + k + 1. Their
    cross-entropies' mean, times `loss_weight`, is added to the loss (as the router's losses
    are, in the logged loss too). DeepSeek-V3: depth 1, loss_weight 0.3 (0.1 late in
    training)."""

    depth: int = 1
    """Modules, each predicting one more token ahead (DeepSeek-V3's num_nextn_predict_layers)."""
    loss_weight: float = 0.3
    """λ: the modules' mean cross-entropy is weighted by it."""

    def validate(self) -> None:
        check_positive(self.depth, "depth")
        check_non_negative(self.loss_weight, "loss_weight")
