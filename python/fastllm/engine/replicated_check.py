"""`model.multi_stage.debug_tensor_parallel`: the parameters every tensor rank holds whole must
stay identical on all of them; a missing or wrong gradient reduction makes them drift."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fastllm.engine.buffers import GroupBuffers


@torch.no_grad()
def check_replicated(buffers: GroupBuffers) -> None:
    """Compare this rank's master shards of the replicated parameters with tensor rank 0's;
    raise naming those that differ on any tensor rank."""
    tensor = buffers.tensor
    if tensor.size == 1:
        return
    source = dist.get_global_rank(tensor.group, 0)
    drifted: list[str] = []
    for stage, shard in buffers.shards.items():
        if not shard.replicated:
            continue
        mine = shard.master_values(0, shard.replicated).to(buffers.device)  # offloaded: host
        theirs = mine.clone()
        dist.broadcast(theirs, src=source, group=tensor.group)
        differs = (mine != theirs).to(torch.int32)
        for index, _, _, s0, s1 in buffers.layout.shard_parameters(stage, buffers.data.rank):
            if s0 < shard.replicated and bool(differs[s0 : min(s1, shard.replicated)].any()):
                drifted.append(buffers.names[index])
    found = torch.tensor([len(drifted)], device=buffers.device)
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=tensor.group)
    if drifted or found.item():
        names = ", ".join(drifted[:5]) or "(on another tensor rank)"
        raise RuntimeError(
            f"model.multi_stage.debug_tensor_parallel: parameters replicated over tensor ranks "
            f"differ from tensor rank 0's: {names}"
        )
