"""Long-lived buffers in host memory, page-locked for asynchronous copies to and from the GPU.

torch's pinned allocator (`pin_memory=True`) rounds every allocation up to a power of two: for
optimizer state of several GiB per buffer that wastes up to half of it, in the memory the
host has least of. Here the buffer is allocated at its size and registered with CUDA
(cudaHostRegister), and unregistered when its storage is freed (as torch's own checkpoint
stager does)."""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

_PORTABLE = 1
"""cudaHostRegisterPortable."""


def host_zeros(numel: int, dtype: torch.dtype, pin: bool) -> Tensor:
    """A flat tensor of zeros in host memory, page-locked when `pin` (CUDA only)."""
    tensor = torch.zeros(numel, dtype=dtype)
    if pin and numel:
        storage = tensor.untyped_storage()
        cudart = torch.cuda.cudart()
        # Portable: page-locked for every CUDA context, as torch's pinned allocator does.
        error = int(cudart.cudaHostRegister(storage.data_ptr(), storage.nbytes(), _PORTABLE))
        if error:
            raise RuntimeError(
                f"could not page-lock {storage.nbytes() / 2**30:.1f} GiB of host memory "
                f"(cudaHostRegister error {error})"
            )
        weakref.finalize(storage, _unregister, storage.data_ptr())
    return tensor


def _unregister(pointer: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(pointer)
