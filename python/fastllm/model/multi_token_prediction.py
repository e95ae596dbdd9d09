"""DeepSeek-V3's multi-token prediction modules (`model.base_model.multi_token_prediction`):
after the blocks, module k predicts token i + k + 1 from the previous module's hidden state
at i and the embedding of token i + k, through a transformer block of its own; the model's
embedding and head are shared."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fastllm.config import registry
from fastllm.config.model import TransformerConfig
from fastllm.model.normalization import normalization
from fastllm.model.parameters import describe
from fastllm.parallel.mesh import ParallelMesh
from fastllm.parallel.tensor import TensorDimension, enter
from fastllm.parallel.vocab_parallel_losses import vocab_parallel_label_losses
from fastllm_kernels.cross_entropy import linear_cross_entropy
from fastllm_kernels.linear import linear

IGNORED = -100


class PredictionModule(torch.nn.Module):
    """One depth: projection([embedding_norm(e); hidden_norm(h)]) → block → output_norm, the
    last for the shared head (DeepSeek's enorm, hnorm, eh_proj, the block, shared_head.norm)."""

    def __init__(self, config: TransformerConfig, layer_index: int, mesh: ParallelMesh) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.tensor = mesh.tensor
        # Under tensor parallelism the norms and the projection read the residual stream, as
        # every tensor rank holds it: replicated, their gradients whole (summed over the
        # ranks only under sequence-tensor parallelism, each rank's covering its chunk). The
        # output norm feeds the vocab-parallel head, as the final norm does: each rank's
        # gradient is its part.
        self.embedding_norm = normalization(config.normalization, hidden, tensor_partial=False)
        self.hidden_norm = normalization(config.normalization, hidden, tensor_partial=False)
        self.projection = torch.nn.Linear(2 * hidden, hidden, bias=False)
        describe(
            self.projection,
            "weight",
            weight_decay=True,
            sequence_tensor_parallel_replicated=True,
        )
        # no adapters: LoRA is refused with multi-token prediction
        self.block = registry.implementation(config.block)(
            config.block, config, layer_index, mesh, None
        )
        self.output_norm = normalization(config.normalization, hidden)

    def forward(
        self, hidden: Tensor, embedded: Tensor, context: Any
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """(this depth's hidden state, it through `output_norm`, the block's auxiliary loss)."""
        joined = torch.cat([self.embedding_norm(embedded), self.hidden_norm(hidden)], dim=-1)
        x = linear(joined, self.projection.weight)
        rotary = context.rotary_of(self.block)
        x, auxiliary = self.block(x, rotary, context.document_ids, None, context.branch_ids)
        return x, self.output_norm(enter(x, self.tensor)), auxiliary


def shifted(tokens: Tensor, k: int, fill: int) -> Tensor:
    """tokens (batch, seq) moved k positions left, the last k positions `fill`."""
    out = torch.full_like(tokens, fill)
    if k < tokens.shape[1]:
        out[:, : tokens.shape[1] - k] = tokens[:, k:]
    return out


def prediction_loss(
    modules: torch.nn.ModuleList,
    hidden: Tensor,
    input_ids: Tensor,
    labels: Tensor,
    embed: Callable[[Tensor], Tensor],
    head_weight: Tensor,
    context: Any,
    loss_weight: float,
    tensor: TensorDimension,
) -> Tensor:
    """loss_weight × the mean over the depths of each one's cross-entropy (a mean over the
    tokens whose target exists and is trained), plus the blocks' auxiliary losses. `hidden`:
    the blocks' output (batch, seq, hidden) before the final norm (under sequence-tensor
    parallelism, this rank's chunk); `input_ids` and `labels` (the next-token labels, so
    module k's targets are `labels` moved k left) whole sequences."""
    total = hidden.new_zeros((), dtype=torch.float32)
    for k, module in enumerate(modules, start=1):
        embedded = embed(shifted(input_ids, k, 0))
        hidden, normed, auxiliary = module(hidden, embedded, context)
        targets = shifted(labels, k, IGNORED).reshape(-1)
        rows = normed.reshape(-1, normed.shape[-1])
        if tensor.split:  # the vocab-parallel head, as the model's (the same loss every rank)
            loss, _ = vocab_parallel_label_losses(rows, head_weight, targets, tensor)
        else:
            loss = linear_cross_entropy(rows, head_weight, targets)
        total = total + loss_weight / len(modules) * loss.float()
        if auxiliary is not None:
            total = total + auxiliary
    return total
