"""DeepSeek-V3's routing of a mixture of experts (sigmoid scores, a correction bias that only
chooses, group-limited top-k, scaled weights), and the update of the correction biases from
the expert loads after each optimizer step (auxiliary-loss-free load balancing).

Top-k of a softmax alone is the kernels' fused router (fastllm_kernels.moe.routing); this is
the general router, in torch: its ops are per token and expert, small beside the experts."""

from __future__ import annotations

import torch
from torch import Tensor

from fastllm.config.model import TransformerConfig
from fastllm_kernels.moe.routing import Routing
from fastllm_kernels.moe.sparse_map import GROUP_ALIGNMENT, sparse_map


def route_scored(
    logits: Tensor,
    config: TransformerConfig,
    bias: Tensor | None,
    dtype: torch.dtype,
    block: int = GROUP_ALIGNMENT,
) -> Routing:
    """Routing of `logits` (tokens, experts), in fp32: scores by `expert_score_function`; the
    choice top-k of the scores plus `bias` (not differentiated) among the experts of each
    token's `expert_groups_per_token` best groups (a group scored by the sum of its two best);
    the weights the chosen experts' scores (renormalized with `expert_renormalize`) times
    `expert_routed_scaling_factor`. The auxiliary loss: the load-balancing loss of softmax
    scores, as `route_reference`'s, and the z-loss, weighted by their coefficients."""
    logits = logits.float()
    tokens, num_experts = logits.shape
    sigmoid = config.expert_score_function == "sigmoid"
    scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
    choice = scores.detach() if bias is None else scores.detach() + bias.float()
    groups = config.expert_groups
    if groups > 1:
        grouped = choice.view(tokens, groups, num_experts // groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best = group_scores.topk(config.groups_per_token, dim=-1).indices
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~kept[..., None], float("-inf")).view(tokens, num_experts)
    experts = choice.topk(config.num_experts_per_token, dim=-1).indices
    weights = scores.gather(1, experts)
    if config.expert_renormalize:  # DeepSeek-V3 keeps an all-zero sum of sigmoids finite
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if sigmoid else 0.0))
    weights = weights * config.expert_routed_scaling_factor
    sparse = sparse_map(experts, num_experts, block)
    auxiliary = logits.new_zeros(())
    if config.expert_auxiliary_loss_coefficient:  # softmax scores (validated)
        routed = sparse.counts.float() / tokens
        balance = num_experts * (routed * scores.mean(dim=0)).sum()
        auxiliary = auxiliary + config.expert_auxiliary_loss_coefficient * balance
    if config.expert_z_loss_coefficient:
        z_loss = torch.logsumexp(logits, dim=-1).square().mean()
        auxiliary = auxiliary + config.expert_z_loss_coefficient * z_loss
    return Routing(weights.to(dtype), experts, sparse.counts, auxiliary, sparse)


@torch.no_grad()
def bias_update(load: Tensor, rate: float) -> Tensor:
    """The change of a mixture's correction biases for its expert loads (experts,), tokens
    routed to each: rate · sign(mean load − load), so that the experts that got more than
    their share lose some of their bias and the others gain (DeepSeek-V3, section 2.1.2)."""
    load = load.float()
    return rate * torch.sign(load.mean() - load)
