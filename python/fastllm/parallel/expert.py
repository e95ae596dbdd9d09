"""Expert parallelism: the E ranks of an expert group (consecutive ranks of the data group)
each hold 1/E of every mixture's experts (rank r experts r·N/E … (r+1)·N/E - 1) and compute
them for the tokens of the whole group.

Each rank routes its own tokens, sorts the (token, choice) pairs by expert, which groups them
by the rank that holds the expert, and sends each rank its rows by all-to-all; the receiver
runs its experts over what it got and sends the outputs back the same way, and the sender
sums each token's k outputs scaled by its routing weights. The all-to-all's backward pass is
the all-to-all of the gradients the other way. The row counts are exchanged first and read by
the host, since the collectives take per-rank split sizes.

An expert's weight gradient on its rank then covers every token the group routed to it, so
summing it over the ranks that hold the same expert (the expert-data group, `mesh.expert_data`)
gives the whole batch's: the engine keeps expert parameters in buffers of their own, sharded
by ZeRO over that group (ModelStages.experts)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastllm.parallel.dimension import Dimension


def exchange(
    tokens: Tensor,
    weights: Tensor,
    experts: Tensor,
    counts: Tensor,
    expert: Dimension,
    compute: Callable[[Tensor, Tensor], Tensor],
) -> Tensor:
    """The mixture's routed output for `tokens` (tokens, hidden), each sent to its k `experts`
    (tokens, k; global indices) with `weights` (tokens, k); `counts` (experts,): the rows this
    rank routes to each expert (the router's). `compute(rows, local_experts)` runs
    this rank's experts on the rows the group sent it (`local_experts` (rows,) in
    0 … N/E - 1) and returns their outputs. Differentiable in tokens, weights and whatever
    `compute` reads."""
    k = experts.shape[1]
    per_rank = counts.numel() // expert.size
    order = experts.reshape(-1).argsort(stable=True)  # by expert, hence by the rank holding it
    sources = order // k  # the token of each sorted row
    # received[s, e]: rows source rank s routes to this rank's expert e.
    ones = [1] * expert.size  # both split sizes given: dynamo traces no other all-to-all
    received = _all_to_all(counts.view(expert.size, per_rank), ones, ones, expert.group)
    splits = torch.stack([counts.view(expert.size, per_rank).sum(dim=1), received.sum(dim=1)])
    send_splits, receive_splits = splits.tolist()  # one wait for the host
    rows = _AllToAll.apply(tokens[sources], receive_splits, send_splits, expert.group)
    # Received rows come by source rank, then by expert within each.
    local = torch.arange(per_rank, device=counts.device).repeat(expert.size)
    outputs = compute(rows, local.repeat_interleave(received.reshape(-1)))
    back = _AllToAll.apply(outputs, send_splits, receive_splits, expert.group)
    scaled = back * weights.reshape(-1)[order, None]
    return torch.zeros_like(tokens).index_add(0, sources, scaled)


class _AllToAll(torch.autograd.Function):
    """Rows split `input_splits` ways sent to the group's ranks, `output_splits` rows received
    from each; backward: the gradients sent back the other way."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup | None,
    ) -> Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def _all_to_all(
    x: Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None,
) -> Tensor:
    """Rows of `x` (split `input_splits` ways) to the group's ranks. Gloo moves
    host memory only: a CUDA tensor goes through a host copy there (ranks sharing one GPU in
    the GPU tests)."""
    device = x.device
    if x.is_cuda and dist.get_backend(group) == "gloo":
        x = x.cpu()
    out = x.new_empty(sum(output_splits), *x.shape[1:])
    dist.all_to_all_single(
        out,
        x.contiguous(),
        output_split_sizes=output_splits,
        input_split_sizes=input_splits,
        group=group,
    )
    return out.to(device)
