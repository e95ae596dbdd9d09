"""Where this process runs: device, rank and world, from torchrun's environment."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Distributed:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def setup_distributed() -> Distributed:
    """Join the process group torchrun described (NCCL on GPUs, Gloo on CPUs, unless
    FASTLLM_DISTRIBUTED_BACKEND names one), or run alone."""
    # Segments that grow in place instead of new blocks of fixed sizes: less memory reserved
    # beyond what tensors use (torchtitan's launcher sets the same). Read when CUDA first
    # allocates, so a process that already has will keep its setting; a user's value stands.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    # FASTLLM_DISTRIBUTED_BACKEND=gloo on GPUs lets several ranks share one GPU (NCCL refuses
    # that): a layout can be checked on a machine with fewer GPUs than ranks, slowly.
    backend = os.environ.get("FASTLLM_DISTRIBUTED_BACKEND") or ("nccl" if cuda else "gloo")
    if cuda:
        shared = backend == "gloo"
        device = torch.device(
            "cuda", local_rank % torch.cuda.device_count() if shared else local_rank
        )
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        # Imported after the group exists (by torch.compile), torch._dynamo keeps references to
        # it that outlive destroy_process_group; Gloo's threads then live into interpreter
        # shutdown, where releasing a tensor can abort the process.
        importlib.import_module("torch._dynamo")

        dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    return Distributed(rank, world_size, local_rank, device)
