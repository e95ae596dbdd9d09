"""Point-to-point transfers between pipeline ranks. NCCL moves device tensors itself; Gloo
sends and receives host memory only, so there a CUDA tensor travels through a host copy (the
case of several ranks sharing one GPU through Gloo, as the GPU tests do)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def _through_host(tensor: Tensor) -> bool:
    return tensor.is_cuda and dist.get_backend() == "gloo"


class Sent:
    """A send in flight; `wait()` before the tensor may change or go."""

    def __init__(self, work: Any, tensor: Tensor) -> None:
        self.work, self.tensor = work, tensor  # the tensor (or its host copy) lives until then

    def wait(self) -> None:
        self.work.wait()


def isend(tensor: Tensor, dst: int) -> Sent:
    """Start sending `tensor` to global rank `dst`."""
    tensor = tensor.contiguous()
    if _through_host(tensor):
        tensor = tensor.cpu()
    return Sent(dist.isend(tensor, dst=dst), tensor)


def send(tensor: Tensor, dst: int) -> None:
    isend(tensor, dst).wait()


def recv(buffer: Tensor, src: int) -> Tensor:
    """Receive into `buffer` from global rank `src`; returns it."""
    if not _through_host(buffer):
        dist.recv(buffer, src=src)
        return buffer
    host = torch.empty(buffer.shape, dtype=buffer.dtype)
    dist.recv(host, src=src)
    return buffer.copy_(host)


def through_stages(
    x: Tensor,
    ranks: Sequence[int],
    rank: int,
    run: Callable[[int, Tensor], Tensor],
    receive_into: Callable[[], Tensor],
    global_rank: Callable[[int], int],
) -> Tensor:
    """`x` through the stages in order (forward only), stage s run as `run(s, input)` on its
    pipeline rank `ranks[s]`, each output sent to the next stage's rank where that is another
    (blocking: every pipeline rank calls this, in one global order), received there into
    `receive_into()`. The last stage's output on its rank; on the others, the last value they
    held (`x` on a rank that ran no stage)."""
    for stage, here in enumerate(ranks):
        if here != rank:
            continue
        if stage and ranks[stage - 1] != here:
            x = recv(receive_into(), global_rank(ranks[stage - 1]))
        x = run(stage, x)
        if stage + 1 < len(ranks) and ranks[stage + 1] != here:
            send(x, global_rank(ranks[stage + 1]))
    return x
