"""Activation offload: what the first blocks store for the backward pass goes to host memory
during the forward pass and comes back ahead of their backward passes, applied to a plain
model from the outside.

Each tensor a block saves (through autograd's saved-tensor hooks, so whatever op saves it)
is copied, on a side stream, into pinned host memory as soon as it is saved; the device
memory is the allocator's again once the copy is done and the forward pass has let go of the
tensor. A tensor saved twice (a layer's output saved as the next op's input) is copied once.
When the backward pass reaches a block, the copies of the two blocks before it start back, so
that each has a block's backward pass of time to arrive. Parameters and small tensors stay
where they are. The copies run beside the compute, so what this costs is host-device
bandwidth: the forward pass must leave time for the bytes to cross (about 55 GB/s each way
on an H200 host), or the memory is freed later than it could be.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fastllm.model import GPTModel

MIN_BYTES = 1 << 20
"""Smaller saved tensors stay on the device: their copies would cost more than they free."""

AHEAD = 2
"""Blocks whose copies start back when the backward pass reaches a block."""


@dataclass
class _Offloaded:
    """One storage's bytes in host memory, and once fetched, back on the device."""

    host: Tensor
    copied: Any
    """The event after the copy to the host (None on the CPU)."""
    device: torch.device
    back: Tensor | None = None
    arrived: Any = None


@dataclass
class _Saved:
    """What a pack hook returns for an offloaded tensor: its storage and its view of it."""

    storage: _Offloaded
    dtype: torch.dtype
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass
class _Pass:
    """The storages one block offloaded in one forward pass."""

    storages: dict[int, _Offloaded] = field(default_factory=dict)
    sources: list[Tensor] = field(default_factory=list)
    """The device tensors sent, held until the block's forward pass ends: a storage freed
    and reallocated within it must not look like one already sent."""


class ActivationOffload:
    def __init__(self, model: GPTModel, layers: int) -> None:
        """Offload what blocks 0 … layers - 1 save."""
        self.cuda = next(model.parameters()).is_cuda
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.offloaded_bytes = 0
        """Bytes sent to the host so far (what the tests and benchmarks read)."""
        self._recent: list[weakref.ref[_Pass] | None] = [None] * len(model.layers)
        """Per block: the pass of its latest forward, held by the prefetch hooks that will
        read it (held here, it would keep the fetched copies after the backward pass)."""
        for index, block in enumerate(model.layers):
            block.forward = functools.partial(  # type: ignore[method-assign]
                self._forward, index, block.forward, index < layers
            )

    def _forward(self, index: int, forward: Any, offload: bool, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        current = _Pass() if offload else None
        self._recent[index] = None if current is None else weakref.ref(current)
        if current is not None:
            with torch.autograd.graph.saved_tensors_hooks(
                functools.partial(self._pack, current), self._unpack
            ):
                out = forward(*args, **kwargs)
            current.sources.clear()
        else:
            out = forward(*args, **kwargs)
        x = out[0]
        recent = [self._recent[i] for i in range(max(0, index - AHEAD), index)]
        earlier = [p for p in (r() for r in recent if r is not None) if p is not None]
        if earlier and x.requires_grad:
            # Fires when the backward pass reaches this block's output, before its own work.
            x.register_hook(functools.partial(self._prefetch, earlier))
        return out

    def _pack(self, current: _Pass, tensor: Tensor) -> Any:
        size = tensor.numel() * tensor.element_size()
        storage = tensor.untyped_storage()
        if (
            isinstance(tensor, torch.nn.Parameter)
            or size < MIN_BYTES
            # A view of something larger (the flat weight buffers): not the block's to move.
            or storage.nbytes() > 2 * size
            or tensor.device.type != ("cuda" if self.cuda else "cpu")
        ):
            return tensor
        key = storage.data_ptr()
        offloaded = current.storages.get(key)
        if offloaded is None:
            offloaded = self._send(tensor, storage)
            current.storages[key] = offloaded
            current.sources.append(tensor)
        return _Saved(
            offloaded, tensor.dtype, tensor.storage_offset(), tuple(tensor.shape), tensor.stride()
        )

    def _send(self, tensor: Tensor, storage: torch.UntypedStorage) -> _Offloaded:
        source = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        self.offloaded_bytes += source.numel()
        if self.stream is None:
            return _Offloaded(source.clone(), None, tensor.device)
        host = torch.empty(source.shape, dtype=torch.uint8, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            host.copy_(source, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        # The allocator may hand the memory out again once the copy is done, not before.
        source.record_stream(self.stream)
        return _Offloaded(host, copied, tensor.device)

    def _prefetch(self, passes: list[_Pass], grad: Tensor) -> None:
        for offload_pass in passes:
            for offloaded in offload_pass.storages.values():
                self._fetch(offloaded)
            offload_pass.storages.clear()  # the saved tensors' own references remain

    def _fetch(self, offloaded: _Offloaded) -> None:
        if offloaded.back is not None:
            return
        if self.stream is None:
            offloaded.back = offloaded.host.clone()
            return
        with torch.cuda.stream(self.stream):  # its memory belongs to the side stream
            self.stream.wait_event(offloaded.copied)
            back = torch.empty(offloaded.host.shape, dtype=torch.uint8, device=offloaded.device)
            back.copy_(offloaded.host, non_blocking=True)
            offloaded.arrived = torch.cuda.Event()
            offloaded.arrived.record()
        offloaded.back = back

    def _unpack(self, saved: Any) -> Tensor:
        if not isinstance(saved, _Saved):
            return saved
        offloaded = saved.storage
        self._fetch(offloaded)  # at once, if no prefetch asked for it
        back = offloaded.back
        assert back is not None
        if offloaded.arrived is not None:
            torch.cuda.current_stream().wait_event(offloaded.arrived)
            back.record_stream(torch.cuda.current_stream())
        view = torch.empty(0, dtype=saved.dtype, device=back.device)
        return view.set_(back.untyped_storage(), saved.offset, saved.shape, saved.stride)


def apply_activation_offload(model: GPTModel, layers: int) -> ActivationOffload | None:
    """Offload what the first `layers` blocks save (none with 0)."""
    return ActivationOffload(model, layers) if layers > 0 else None
