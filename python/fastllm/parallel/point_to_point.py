"""Point-to-point transfers between pipeline ranks. NCCL moves device tensors itself; Gloo
sends and receives host memory only, so there a CUDA tensor travels through a host copy (the
case of several ranks sharing one GPU through Gloo, as the GPU tests do)."""

from __future__ import annotations

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
