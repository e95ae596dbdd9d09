"""Tensor-by-tensor rules between Hugging Face checkpoints and fastllm's parameter names.

Each rule names one fastllm tensor and the Hugging Face tensors it is made of; `join` builds
ours from theirs, `split` gives theirs back from ours. Both only concatenate, stack or slice,
so a round trip reproduces every tensor bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Rule:
    ours: str
    theirs: tuple[str, ...]
    join: Callable[[list[Tensor]], Tensor]
    split: Callable[[Tensor], list[Tensor]]


def same(ours: str, theirs: str) -> Rule:
    return Rule(ours, (theirs,), lambda ts: ts[0], lambda t: [t])


def concat(ours: str, theirs: tuple[str, ...], sizes: list[int]) -> Rule:
    return Rule(
        ours, theirs, lambda ts: torch.cat(ts, dim=0), lambda t: list(t.split(sizes, dim=0))
    )


def stack(ours: str, theirs: tuple[str, ...], join_dim_sizes: list[int] | None = None) -> Rule:
    """Experts stacked on a new first dimension; with `join_dim_sizes`, each expert's tensor is
    itself the concatenation of several of theirs (gate and up)."""
    count = len(theirs) // (len(join_dim_sizes) if join_dim_sizes else 1)
    if join_dim_sizes is None:
        return Rule(ours, theirs, lambda ts: torch.stack(ts), lambda t: list(t.unbind(0)))
    parts = len(join_dim_sizes)

    def join(ts: list[Tensor]) -> Tensor:
        return torch.stack([torch.cat(ts[e * parts : (e + 1) * parts]) for e in range(count)])

    def split(t: Tensor) -> list[Tensor]:
        return [piece for expert in t.unbind(0) for piece in expert.split(join_dim_sizes)]

    return Rule(ours, theirs, join, split)
