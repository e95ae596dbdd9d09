"""`model.multi_stage.offload_optimizer`: the optimizer state in host memory, streamed through
the GPU for each step's update.

The fp32 masters (with bf16 compute weights their int16 low halves, the high halves being the
weights) and the two Adam moments of this rank's shards live in page-locked host memory. The
update runs on the GPU, chunk by chunk: a chunk's state is copied in on one side stream, the
fused AdamW kernel updates it with the gradients and compute weights already on the GPU, and
it is copied back on another, two chunks in flight, so that copies in, the kernel and copies
out overlap, each direction of the host link busy at once.

Why not update on the host, from gradients copied out? Per parameter, streaming moves 10 bytes
each way (low half and moments, in bf16 training) in both directions at once: at the ~55 GB/s
measured for activation offload on an H200 host, some 1.5 s for 8B parameters, the kernel's
time being negligible. The host update would move fewer bytes (the fp32 gradient out, 4, the
bf16 weight back, 2: ~0.6 s), but then read and write ~28 bytes per parameter in host memory in
a single pass, and torch's unfused CPU operations take a dozen: at ~200 GB/s of host memory
bandwidth and 16 cores, several seconds per step for 8B parameters, before the copies. Running
the GPU kernel also makes the update the very one of the GPU path, bit for bit (the same
kernel on the same values; the chunks split nothing but the elementwise work).

The copies back are waited for at the end of the step, so that whatever reads the host state
next (a checkpoint, the next step's copies in) sees it whole. Not done yet: overlapping the
update with the next step's forward pass."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fastllm.engine.buffers import ALIGNMENT, Shard

CHUNK = 1 << 25
"""Elements per streamed chunk: 320 MiB of state in bf16 training (a few ms each way), two on
the GPU at a time."""

STREAMED = ("master", "master_low", "exp_avg", "exp_avg_sq")
"""The state kinds a shard may hold in host memory."""


@dataclass(frozen=True)
class StateSpan:
    """A shard's optimizer state over its elements [start, end), where the update reads it."""

    start: int
    end: int
    master: Tensor | None
    """The fp32 masters (None when split: the compute weights with `master_low`)."""
    master_low: Tensor | None
    exp_avg: Tensor
    exp_avg_sq: Tensor

    @staticmethod
    def whole(shard: Shard) -> StateSpan:
        """The shard's own state, all of it."""
        return StateSpan(
            0, shard.grad.numel(), shard.master, shard.master_low, shard.exp_avg, shard.exp_avg_sq
        )


@dataclass(frozen=True)
class _Events:
    """What orders the use of a slot on the GPU's streams."""

    loaded: torch.cuda.Event = field(default_factory=torch.cuda.Event)
    """On the upload stream: the chunk's state is on the GPU."""
    updated: torch.cuda.Event = field(default_factory=torch.cuda.Event)
    """On the compute stream: the chunk's update is queued."""
    free: torch.cuda.Event = field(default_factory=torch.cuda.Event)
    """On the download stream: the chunk's state is back in host memory."""


@dataclass(frozen=True)
class _Slot:
    """Room on the device for one chunk of each streamed kind."""

    tensors: dict[str, Tensor]
    events: _Events | None
    """On a GPU only."""


class OffloadedState:
    """Streams the host-resident optimizer state of shards through two chunk-sized slots on
    the device (on a CPU device, the same copies, one after the other)."""

    def __init__(self, shards: Sequence[Shard], device: torch.device, chunk: int = CHUNK) -> None:
        """`shards`: every shard the optimizer updates, their state in host memory."""
        if chunk % ALIGNMENT:  # the chunks of a decay run start where its elements align
            raise ValueError(f"a chunk is a multiple of {ALIGNMENT} elements, got {chunk}")
        self.device, self.chunk = device, chunk
        self.cuda = device.type == "cuda"
        kinds = _streamed(shards[0]) if shards else {}
        size = min(chunk, max((shard.grad.numel() for shard in shards), default=0))
        self.slots = [
            _Slot(
                {
                    kind: torch.empty(size, dtype=t.dtype, device=device)
                    for kind, t in kinds.items()
                },
                _Events() if self.cuda else None,
            )
            for _ in range(2)
        ]
        if self.cuda:
            self.upload, self.download = torch.cuda.Stream(device), torch.cuda.Stream(device)

    @property
    def device_bytes(self) -> int:
        """What the slots take on the device."""
        return sum(t.numel() * t.element_size() for s in self.slots for t in s.tensors.values())

    def spans(self, shards: Sequence[Shard]) -> Iterator[tuple[Shard, StateSpan]]:
        """Each chunk of each shard's state, on the device, to be updated in place (queued)
        before the next one is asked for: it then goes back to host memory. When the iteration
        ends, all of it is back."""
        chunks = [
            (shard, start, min(start + self.chunk, shard.grad.numel()))
            for shard in shards
            for start in range(0, shard.grad.numel(), self.chunk)
        ]
        for i, (shard, start, end) in enumerate(chunks):
            slot, host = self.slots[i % 2], _streamed(shard)
            views = {kind: slot.tensors[kind][: end - start] for kind in host}
            self._load(slot, host, views, start)
            master = views.get("master")
            if master is None and shard.master is not None:  # fp32: the compute weights
                master = shard.master[start:end]
            yield (
                shard,
                StateSpan(
                    start,
                    end,
                    master,
                    views.get("master_low"),
                    views["exp_avg"],
                    views["exp_avg_sq"],
                ),
            )
            self._store(slot, host, views, start)
        if self.cuda:
            self.download.synchronize()

    def _load(
        self, slot: _Slot, host: dict[str, Tensor], views: dict[str, Tensor], start: int
    ) -> None:
        if slot.events is None:
            for kind, tensor in host.items():
                views[kind].copy_(tensor[start : start + views[kind].numel()])
            return
        with torch.cuda.stream(self.upload):
            self.upload.wait_event(slot.events.free)  # the slot's previous chunk has left
            for kind, tensor in host.items():
                views[kind].copy_(tensor[start : start + views[kind].numel()], non_blocking=True)
            slot.events.loaded.record(self.upload)
        torch.cuda.current_stream(self.device).wait_event(slot.events.loaded)

    def _store(
        self, slot: _Slot, host: dict[str, Tensor], views: dict[str, Tensor], start: int
    ) -> None:
        if slot.events is None:
            for kind, tensor in host.items():
                tensor[start : start + views[kind].numel()].copy_(views[kind])
            return
        slot.events.updated.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.download):
            self.download.wait_event(slot.events.updated)
            for kind, tensor in host.items():
                tensor[start : start + views[kind].numel()].copy_(views[kind], non_blocking=True)
            slot.events.free.record(self.download)


def _streamed(shard: Shard) -> dict[str, Tensor]:
    """The shard's state in host memory, by kind. In fp32 training the masters are the compute
    weights themselves, on the GPU: only the moments travel."""
    state = {kind: getattr(shard, kind) for kind in STREAMED}
    if state["master"] is shard.weight:
        del state["master"]
    return {kind: tensor for kind, tensor in state.items() if tensor is not None}
