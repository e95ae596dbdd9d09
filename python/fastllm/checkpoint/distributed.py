"""The `distributed` format, written by training (checkpoints and exports) and read back by
any layout, by `fastllm convert` and by `pretrained`. This module alone writes and reads its
manifest.

One safetensors file per rank (`rank_NNNNN.safetensors`, the global rank = tensor rank +
tensor size × (data rank + data size × pipeline rank)) holds that rank's shards of the flat
fp32 state of the stages it runs (stage s on pipeline rank s mod pipeline size), one tensor per
stage and kind (`master`, and in checkpoints `exp_avg`, `exp_avg_sq`, plus the RNG states).
`manifest.json` describes the layout: every parameter's flat placement on one tensor rank
(the same on all of them), its slice shape and how tensor ranks split it, the tensor, data and
pipeline sizes, the config and the training counters. A reader rebuilds any parameter whole
(merging data shards, then tensor slices), so a checkpoint loads with any tensor, data and
pipeline size and ZeRO stage (the stages, `model.multi_stage.layers_per_stage`, are the
writer's: the reader finds each parameter's pieces by its layout).

With expert parallelism (`expert_parallel` E) the experts' parameters have a layout of their
own (`expert_parameters`: each expert rank's share, sharded over the data ranks holding the
same experts, data rank = expert rank + E × expert-data rank), saved as `KIND.experts.stage_S`;
a parameter whole is its E shares concatenated along the first dimension."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec
import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from fastllm import _native
from fastllm.config import BaseModelConfig, ConfigError, build, registry
from fastllm.model.parameters import TensorSplit

MANIFEST = "manifest.json"
STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
"""What a checkpoint keeps per stage; an export keeps the master weights only."""


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def stage_key(kind: str, stage: int, experts: bool = False) -> str:
    return f"{kind}.experts.stage_{stage:05d}" if experts else f"{kind}.stage_{stage:05d}"


@dataclass
class ShardedState:
    """One rank's part of the flat training state, as the engine lays it out: what a snapshot
    saves and what a restore fills."""

    specs: list[tuple[str, int, int, bool]]
    """(name, numel, stage, weight decay) of every parameter of this tensor rank, in layout
    order."""
    shapes: dict[str, tuple[int, ...]]
    splits: dict[str, TensorSplit | None]
    alignment: int
    tensor_size: int
    tensor_rank: int
    data_size: int
    data_rank: int
    shards: dict[int, dict[str, Tensor | Callable[[], Tensor]]]
    """Per stage this rank runs: each kind's shard (views of the engine's buffers, or copies
    of them; to be saved, also a function making the copy, called when it is written)."""
    pipeline_size: int = 1
    pipeline_rank: int = 0
    expert_size: int = 1
    expert_rank: int = 0
    experts: ShardedState | None = None
    """With expert parallelism: the experts' parameters (this rank's share), laid out and
    sharded over the data ranks holding the same experts."""

    @property
    def rank(self) -> int:
        return self.tensor_rank + self.tensor_size * (
            self.data_rank + self.data_size * self.pipeline_rank
        )

    def layout(self) -> _native.BufferLayout:
        return _native.BufferLayout(self.specs, alignment=self.alignment, data_size=self.data_size)

    def parts(self) -> list[tuple[ShardedState, bool]]:
        """(part, holds experts) of this state and its experts'."""
        return [(self, False)] + ([] if self.experts is None else [(self.experts, True)])

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Every shard with the key it is saved under."""
        for part, experts in self.parts():
            for stage, kinds in part.shards.items():
                for kind, tensor in kinds.items():
                    yield stage_key(kind, stage, experts), tensor() if callable(tensor) else tensor


@dataclass
class Snapshot:
    """What the trainer hands over to be saved: its state and the counters to resume."""

    kind: str
    """checkpoint or export."""
    state: ShardedState
    config: dict[str, Any]
    counters: dict[str, Any] = field(default_factory=dict)
    """step, optimizer_steps, consumed_samples, skipped_steps, loss_scaler (checkpoints)."""
    extra: dict[str, Tensor] = field(default_factory=dict)
    """Tensors of this rank only, such as the RNG states."""
    components: dict[str, dict[str, str]] = field(default_factory=dict)
    """The components of other packages that `config` chooses (`registry.record`): reading
    it needs them installed."""

    def manifest(self) -> dict[str, Any]:
        state = self.state
        parts = [part for part, _ in state.parts()]
        experts = [] if state.experts is None else state.experts.specs
        return {
            "format": "distributed",
            "kind": self.kind,
            **self.counters,
            "parameters": [list(spec) for spec in state.specs],
            "expert_parameters": [list(spec) for spec in experts],
            "expert_parallel": state.expert_size,
            "shapes": {name: list(shape) for part in parts for name, shape in part.shapes.items()},
            "splits": {
                name: None if split is None else split.to_builtins()
                for part in parts
                for name, split in part.splits.items()
            },
            "alignment": state.alignment,
            "tensor_parallel": state.tensor_size,
            "data_parallel": state.data_size,
            "pipeline_parallel": state.pipeline_size,
            "world_size": state.tensor_size * state.data_size * state.pipeline_size,
            "config": self.config,
            "components": self.components,
        }


def verified_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a checkpoint or export whose files match their sizes and checksums;
    `ConfigError` naming the first file that does not (or the missing manifest)."""
    try:
        return json.loads(_native.verify_checkpoint(str(directory)))
    except (OSError, ValueError) as error:  # the crate's message names the file
        raise ConfigError("", str(error)) from None


_Count = Annotated[int, msgspec.Meta(ge=1)]
_Size = Annotated[int, msgspec.Meta(ge=0)]
_Spec = tuple[str, _Size, _Size, bool]


class _Split(msgspec.Struct, forbid_unknown_fields=True):
    dim: _Size
    segments: list[_Size]


class _Layout(msgspec.Struct):
    """The manifest's fields that place the parameters in the rank files, typed. The manifest
    has no checksum of its own: damage that leaves valid JSON is caught here, or by
    `_check_layout` against the shapes, or by `_piece` against the rank files."""

    parameters: list[_Spec]
    shapes: dict[str, list[_Size]]
    alignment: _Count
    world_size: _Count
    config: dict[str, Any]
    splits: dict[str, _Split | None] = {}
    tensor_parallel: _Count = 1
    pipeline_parallel: _Count = 1
    data_parallel: _Count | None = None
    expert_parallel: _Count = 1
    expert_parameters: list[_Spec] = []


class SavedCheckpoint:
    """A checkpoint or export on disk, read piece by piece, its files verified first (or given
    the `manifest` of a verification just done). A manifest that does not describe its files
    is a `ConfigError` naming it."""

    def __init__(self, directory: Path, manifest: dict[str, Any] | None = None) -> None:
        self.directory = directory
        self.manifest = manifest if manifest is not None else verified_manifest(directory)
        try:
            m = msgspec.convert(self.manifest, _Layout)
        except msgspec.ValidationError as error:
            raise self._bad_manifest(str(error)) from None
        self.parameters = [tuple(p) for p in m.parameters]
        self.shapes = {name: tuple(shape) for name, shape in m.shapes.items()}
        self.splits = {
            name: TensorSplit.from_builtins(msgspec.to_builtins(raw))
            for name, raw in m.splits.items()
        }
        self.tensor_size = m.tensor_parallel
        self.pipeline_size = m.pipeline_parallel
        self.data_size = m.world_size if m.data_parallel is None else m.data_parallel
        self.expert_size = m.expert_parallel
        self.expert_parameters = [tuple(p) for p in m.expert_parameters]
        self._check_layout(m.world_size)
        try:
            self.layout = _native.BufferLayout(
                self.parameters, alignment=m.alignment, data_size=self.data_size
            )
            self.expert_layout = (
                _native.BufferLayout(
                    self.expert_parameters,
                    alignment=m.alignment,
                    data_size=self.data_size // self.expert_size,
                )
                if self.expert_parameters
                else None
            )
        except ValueError as error:
            raise self._bad_manifest(str(error)) from None
        self.index = {p[0]: i for i, p in enumerate(self.parameters)}
        self.expert_index = {p[0]: i for i, p in enumerate(self.expert_parameters)}
        self._handles: dict[int, Any] = {}

    def _bad_manifest(self, reason: str) -> ConfigError:
        return ConfigError(str(self.directory / MANIFEST), f"bad manifest: {reason}")

    def _check_layout(self, world_size: int) -> None:
        """The sizes multiply to the world size, and every parameter has a shape of its size
        (and a split that fits it)."""
        sizes = (self.tensor_size, self.data_size, self.pipeline_size)
        if math.prod(sizes) != world_size or self.data_size % self.expert_size:
            raise self._bad_manifest(f"sizes {sizes} and world_size {world_size} disagree")
        for name, numel, _, _ in self.parameters + self.expert_parameters:
            shape = self.shapes.get(name)
            if shape is None or math.prod(shape) != numel:
                raise self._bad_manifest(f"{name!r} has {numel} elements but shape {shape}")
            split = self.splits.get(name)
            if (
                split is not None
                and self.tensor_size > 1
                and not (
                    split.dim < len(shape)
                    and all(s % self.tensor_size == 0 for s in split.segments)
                    and sum(split.segments) == shape[split.dim] * self.tensor_size
                )
            ):
                raise self._bad_manifest(f"{name!r} has shape {shape} but split {split}")

    @property
    def counters(self) -> dict[str, Any]:
        return self.manifest

    def model_config(self) -> BaseModelConfig:
        registry.require(self.manifest.get("components", {}), str(self.directory / MANIFEST))
        try:
            raw = self.manifest["config"]["model"]["base_model"]
            return build(BaseModelConfig, raw)
        except (KeyError, TypeError):
            raise self._bad_manifest("no config.model.base_model") from None
        except ConfigError as error:
            raise self._bad_manifest(f"config.model.base_model.{error}") from None

    def same_layout(self, state: ShardedState) -> bool:
        """Written by ranks laid out as `state`'s are: its RNG streams apply."""
        saved = (self.tensor_size, self.data_size, self.pipeline_size, self.expert_size)
        return saved == (
            state.tensor_size,
            state.data_size,
            state.pipeline_size,
            state.expert_size,
        )

    def _handle(self, rank: int) -> Any:
        if rank not in self._handles:
            path = self.directory / rank_file(rank)
            try:
                self._handles[rank] = safe_open(path, "pt")
            except (OSError, SafetensorError) as error:
                raise ConfigError(str(path), f"cannot be read ({error})") from None
        return self._handles[rank]

    def _piece(self, rank: int, key: str, start: int, end: int) -> Tensor:
        handle = self._handle(rank)
        if key not in handle.keys():  # noqa: SIM118
            raise self._bad_manifest(f"{rank_file(rank)} has no tensor {key!r}")
        piece = handle.get_slice(key)
        if len(piece.get_shape()) != 1 or piece.get_shape()[0] < end:
            raise self._bad_manifest(
                f"{rank_file(rank)}: {key!r} has shape {piece.get_shape()}, not {end} elements"
            )
        return piece[start:end]

    def check_dtypes(self) -> None:
        """Every rank file's flat state is fp32, as this format writes it (a reader would
        otherwise convert other values silently): a `ConfigError` naming the file, the tensor
        and its dtype. Reads the files' headers only."""
        for rank in range(self.tensor_size * self.data_size * self.pipeline_size):
            handle = self._handle(rank)
            for key in handle.keys():  # noqa: SIM118
                if key.split(".")[0] not in STATE_KINDS:
                    continue
                dtype = handle.get_slice(key).get_dtype()
                if dtype != "F32":
                    raise ConfigError(
                        str(self.directory / rank_file(rank)),
                        f"{key!r} holds {dtype} values; this format's state is F32",
                    )

    def rank_tensor(self, rank: int, key: str) -> Tensor | None:
        """A tensor of rank `rank`'s file outside the flat state (RNG states), if present."""
        handle = self._handle(rank)
        return handle.get_tensor(key) if key in handle.keys() else None  # noqa: SIM118

    def _pieces(
        self, name: str, expert_rank: int | None
    ) -> Iterator[tuple[int, int, int, int, int, int]]:
        """(data rank, stage, parameter start, parameter end, shard start, shard end) of
        every saved piece of parameter `name` on one tensor rank (of an expert parameter, on
        expert rank `expert_rank`)."""
        experts = expert_rank is not None
        layout = self.expert_layout if experts else self.layout
        index = (self.expert_index if experts else self.index)[name]
        stage, _, _ = layout.parameter(index)
        for shard_rank in range(layout.data_size):
            data_rank = expert_rank + self.expert_size * shard_rank if experts else shard_rank
            for i, p0, p1, s0, s1 in layout.shard_parameters(stage, shard_rank):
                if i == index:
                    yield data_rank, stage, p0, p1, s0, s1

    def _numel(self, name: str) -> int:
        if name in self.expert_index:
            return self.expert_parameters[self.expert_index[name]][1]
        return self.parameters[self.index[name]][1]

    def tensor_slice(
        self, name: str, kind: str, tensor_rank: int, expert_rank: int | None = None
    ) -> Tensor:
        """Parameter `name` as tensor rank `tensor_rank` (and for an expert parameter, expert
        rank `expert_rank`) held it (flat, fp32)."""
        numel = self._numel(name)
        flat = torch.empty(numel, dtype=torch.float32)
        self._copy_pieces(name, kind, tensor_rank, expert_rank, 0, numel, flat)
        return flat

    def whole(self, name: str, kind: str = "master") -> Tensor:
        """Parameter `name` whole, its tensor slices merged (and expert shares
        concatenated)."""
        shape = self.shapes[name]
        split = self.splits.get(name)
        shares = []
        experts = name in self.expert_index
        for expert_rank in range(self.expert_size) if experts else [None]:
            slices = [
                self.tensor_slice(name, kind, t, expert_rank).view(shape)
                for t in range(self.tensor_size if split is not None else 1)
            ]
            shares.append(slices[0] if len(slices) == 1 else split.merge(slices))  # type: ignore[union-attr]
        return shares[0] if len(shares) == 1 else torch.cat(shares)

    def whole_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's shape whole, from the manifest alone (its tensor slices merged,
        its expert shares concatenated); `ConfigError` where a slice's shape and its element
        count disagree."""
        shapes = {}
        for name, numel, *_ in self.parameters + self.expert_parameters:
            if name not in self.shapes:
                raise ConfigError(str(self.directory / MANIFEST), f"{name}: has no shape")
            shape = list(self.shapes[name])
            if math.prod(shape) != numel:
                raise ConfigError(
                    str(self.directory / MANIFEST),
                    f"{name}: shape {tuple(shape)} has {math.prod(shape)} elements, not {numel}",
                )
            split = self.splits.get(name)
            if split is not None:
                shape[split.dim] *= self.tensor_size
            if name in self.expert_index:
                shape[0] *= self.expert_size
            shapes[name] = tuple(shape)
        return shapes

    def full_tensors(self, kind: str = "master") -> Iterator[tuple[str, Tensor]]:
        for name, *_ in self.parameters + self.expert_parameters:
            yield name, self.whole(name, kind)

    def restore(self, state: ShardedState, kinds: tuple[str, ...]) -> None:
        """Fill `state`'s shards from this checkpoint, whatever layout wrote it."""
        names = {spec[0] for part, _ in state.parts() for spec in part.specs}
        if set(self.index) | set(self.expert_index) != names:
            raise ConfigError(str(self.directory), "holds the parameters of another model")
        for part, experts in state.parts():
            self._restore_part(state, part, experts, kinds)

    def _restore_part(
        self, state: ShardedState, part: ShardedState, experts: bool, kinds: tuple[str, ...]
    ) -> None:
        names = [spec[0] for spec in part.specs]
        layout = part.layout()
        same_slices = self.tensor_size == state.tensor_size
        if experts:  # saved as this rank's share of the experts
            same_slices = same_slices and self.expert_size == state.expert_size
        for stage, shard in part.shards.items():
            for index, p0, p1, s0, _ in layout.shard_parameters(stage, part.data_rank):
                name = names[index]
                same = same_slices and (name in self.expert_index) == experts
                for kind in kinds:
                    target = shard[kind][s0 : s0 + p1 - p0]
                    if same:
                        expert_rank = state.expert_rank if experts else None
                        self._copy_pieces(
                            name, kind, state.tensor_rank, expert_rank, p0, p1, target
                        )
                        continue
                    whole = self.whole(name, kind)
                    if experts:
                        whole = whole.chunk(state.expert_size)[state.expert_rank]
                    split = part.splits[name]
                    if split is not None and state.tensor_size > 1:
                        whole = split.local(whole, state.tensor_rank, state.tensor_size)
                    target.copy_(whole.reshape(-1)[p0:p1])

    def _copy_pieces(
        self,
        name: str,
        kind: str,
        tensor_rank: int,
        expert_rank: int | None,
        p0: int,
        p1: int,
        target: Tensor,
    ) -> None:
        """Elements [p0, p1) of the parameter's slice on `tensor_rank` (and `expert_rank`),
        from the saved data shards that overlap them."""
        for data_rank, stage, q0, q1, t0, _ in self._pieces(name, expert_rank):
            start, end = max(p0, q0), min(p1, q1)
            if start < end:
                pipeline_rank = stage % self.pipeline_size
                rank = tensor_rank + self.tensor_size * (data_rank + self.data_size * pipeline_rank)
                key = stage_key(kind, stage, expert_rank is not None)
                values = self._piece(rank, key, t0 + start - q0, t0 + end - q0)
                target[start - p0 : end - p0].copy_(values)
