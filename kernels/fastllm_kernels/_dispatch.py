"""Where an op runs (Triton or the torch reference) and launch settings shared by the kernels."""

from __future__ import annotations

import functools
import os

import torch
import triton


def use_triton(*tensors: torch.Tensor | None) -> bool:
    """Triton on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1; the reference otherwise,
    and while torch.compile traces (inductor fuses the reference with its neighbours)."""
    if torch.compiler.is_compiling():
        return False
    present = [t for t in tensors if t is not None]
    if all(t.is_cuda for t in present):
        return True
    return os.environ.get("TRITON_INTERPRET") == "1" and all(
        t.device.type == "cpu" for t in present
    )


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_programs(device: torch.device) -> int:
    """A grid size that fills the device once (a few programs in the interpreter)."""
    if device.type == "cuda":
        return _multiprocessor_count(device.index if device.index is not None else 0)
    return 4


def row_block(n_cols: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for kernels that keep one whole row of n_cols in registers."""
    block = triton.next_power_of_2(n_cols)
    if block > 65536:
        raise ValueError(f"rows of {n_cols} elements are too long for a one-block-per-row kernel")
    num_warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, num_warps


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D (rows, last dim) tensor with unit column stride, copying only when needed."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
