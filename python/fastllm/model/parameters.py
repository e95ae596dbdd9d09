"""What the model tells the engine about each parameter, set where the layer is built: the
engine lays out buffers, shards, reduces gradients, counts the gradient norm and exports from
this alone, never from parameter names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fastllm_kernels.recipe import WeightRecipe


@dataclass(frozen=True)
class TensorSplit:
    """How a tensor is split over the tensor-parallel ranks: along `dim`, whose full size is
    the sum of `segments`, each segment cut into equal contiguous slices (a fused q/k/v or
    [gate; up] tensor is split per segment, so every rank holds whole heads and matching gate
    and up rows)."""

    dim: int
    segments: tuple[int, ...]

    def local(self, full: Tensor, rank: int, size: int) -> Tensor:
        """Rank `rank`'s slice of the whole tensor."""
        pieces = [
            segment.chunk(size, dim=self.dim)[rank]
            for segment in full.split(list(self.segments), dim=self.dim)
        ]
        return torch.cat(pieces, dim=self.dim) if len(pieces) > 1 else pieces[0]

    def merge(self, slices: list[Tensor]) -> Tensor:
        """The whole tensor from every rank's slice, in rank order."""
        size = len(slices)
        per_rank = [segment // size for segment in self.segments]
        parts = [piece.split(per_rank, dim=self.dim) for piece in slices]
        return torch.cat(
            [parts[rank][s] for s in range(len(self.segments)) for rank in range(size)],
            dim=self.dim,
        )

    def to_builtins(self) -> dict[str, Any]:
        return {"dim": self.dim, "segments": list(self.segments)}

    @staticmethod
    def from_builtins(raw: dict[str, Any] | None) -> TensorSplit | None:
        return None if raw is None else TensorSplit(raw["dim"], tuple(raw["segments"]))


@dataclass(frozen=True)
class ParameterMeta:
    weight_decay: bool
    """AdamW's decoupled weight decay applies (matrices, not norms, biases and embeddings)."""
    tensor_split: TensorSplit | None = None
    """How tensor ranks split it; None: replicated, every tensor rank holds it whole."""
    tensor_partial: bool = False
    """Replicated, and each tensor rank's gradient is only its part of the whole (the norms:
    their fused projections see only this rank's columns); summed over the tensor ranks."""
    sequence_tensor_parallel_replicated: bool = False
    """Replicated, and under sequence-tensor parallelism each tensor rank's gradient covers only
    its chunk of the sequence (biases of row-parallel layers); summed over the tensor ranks
    then."""
    expert_split: bool = False
    """Its first dimension lists a mixture's experts; with expert parallelism each rank of
    the expert group holds a contiguous 1/E of them, in buffers of their own."""
    tied: bool = False
    """Read by two layers of different stages (the embedding, when the head shares it)."""
    layer: int = 0
    """Position in the model: 0 the embedding, 1 … num_layers the blocks, num_layers + 1 the
    final norm and the head. The engine groups layers into stages."""
    frozen: bool = False
    """It does not train (`model.freeze`): weights only, in buffers of their own."""
    balancing_bias: bool = False
    """A mixture's expert correction bias (`expert_bias`): no gradient reaches it (its
    gradient stays zero, and its stage's reduction does not wait for one); the engine moves
    it after each optimizer step by the expert loads (model/routing.py)."""
    recipe: WeightRecipe | None = field(default=None, compare=False)
    """A projection's weight: the recipe its layer passes to the kernels' ops with it, made
    empty with the layer; the engine fills it in (a gradient sink, FP8)."""

    def tensor_reduced(self, sequence_tensor_parallel: bool) -> bool:
        """Its gradient is summed over the tensor ranks (with more than one)."""
        return self.tensor_partial or (
            self.sequence_tensor_parallel_replicated and sequence_tensor_parallel
        )


def describe(module: torch.nn.Module, name: str, **meta: Any) -> None:
    """Attach `ParameterMeta(**meta)` to `module`'s parameter `name` (nothing for an absent
    bias). Kept on the module, so copies of the model and replaced parameters keep it."""
    if getattr(module, name) is not None:
        module.__dict__.setdefault("parameter_meta", {})[name] = ParameterMeta(**meta)


def meta_of(module: torch.nn.Module, name: str) -> ParameterMeta:
    """The meta `describe` attached to `module`'s parameter `name`."""
    return module.__dict__["parameter_meta"][name]


def freeze(module: torch.nn.Module, recurse: bool = True) -> None:
    """Every parameter of `module` (and, with `recurse`, its children's) frozen."""
    for child in module.modules() if recurse else [module]:
        metas = child.__dict__.get("parameter_meta", {})
        for name, meta in metas.items():
            metas[name] = dataclasses.replace(meta, frozen=True)


def set_layer(module: torch.nn.Module, layer: int) -> None:
    """Every parameter of `module` (and its children) at model position `layer`."""
    for child in module.modules():
        metas = child.__dict__.get("parameter_meta", {})
        for name, meta in metas.items():
            metas[name] = dataclasses.replace(meta, layer=layer)


def parameter_metas(model: torch.nn.Module) -> dict[str, ParameterMeta]:
    """Every parameter's meta, by the name `named_parameters` gives it."""
    metas = {
        f"{prefix}.{name}" if prefix else name: meta
        for prefix, module in model.named_modules()
        for name, meta in module.__dict__.get("parameter_meta", {}).items()
    }
    missing = [name for name, _ in model.named_parameters() if name not in metas]
    if missing:
        raise TypeError(f"parameters without a ParameterMeta: {missing[:5]}")
    return metas


def full_shape(shape: tuple[int, ...], split: TensorSplit | None) -> tuple[int, ...]:
    """The whole tensor's shape, from a slice's."""
    if split is None:
        return shape
    whole = list(shape)
    whole[split.dim] = sum(split.segments)
    return tuple(whole)
