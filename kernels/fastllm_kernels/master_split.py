"""fp32 master weights kept as their bf16 compute copy plus a 16-bit remainder.

A float32's bits b are held as a high half h (a bfloat16: b rounded to its upper 16 bits,
halves away from zero) and a signed low half l = b - h·2¹⁶ in [-2¹⁵, 2¹⁵): b = h·2¹⁶ + l
exactly, so the pair is the fp32 master bit for bit, and h is the bf16 copy the model computes
with. Together they take 4 bytes per parameter where a master and a separate copy take 6.

Rounding the bits up from half (b + 2¹⁵, then the upper half) rounds the magnitude to the
nearest bfloat16, carrying into the exponent where it should, as a cast does; only an exact
tie (low half 0x8000) goes away from zero where a cast goes to the even neighbour, a choice
that keeps the remainder within 16 bits. The AdamW kernel does the same arithmetic in its
pass (adam.py); these are the torch forms, for loading, checkpoints and the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor


def split_(values: Tensor, high: Tensor, low: Tensor) -> None:
    """high (bf16) and low (int16) of fp32 `values`, written in place (all of one shape)."""
    bits = values.contiguous().view(torch.int32)
    top = (bits + 0x8000) >> 16  # arithmetic shift: the sign comes along
    high.copy_(top.to(torch.int16).view(torch.bfloat16))
    low.copy_((bits - (top << 16)).to(torch.int16))


def join(high: Tensor, low: Tensor) -> Tensor:
    """The fp32 values of (high, low), a new tensor."""
    top = high.contiguous().view(torch.int16).to(torch.int32)
    return ((top << 16) + low.to(torch.int32)).view(torch.float32)
