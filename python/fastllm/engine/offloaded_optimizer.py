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

The update runs beside the next step. It starts once the global gradient norm is known
(clipping scales every chunk by it), on a side stream of its own, stage by stage in the order
the forward passes run them, and nothing in it blocks the host; `UpdateFence`
(engine/update_fence.py) marks each stage's end on that stream and the last copy back. The
next step's first use of a stage's weights waits on the device for that stage's update alone:
its forward pass (a module hook, or the pipeline runner's wait), the ZeRO-3 gather of its
shard, the ZeRO-1/2 all-gather of it, a tied head's copy. Whatever reads or writes the state
in host memory (a checkpoint, an export of the masters, a restore, the expert biases'
correction, the tensor-parallel debug check) waits on the host for every copy back; the next
update's copies in wait on the device. What still waits for more than its stage: ZeRO-1/2
over several data ranks start every stage's all-gather as the step ends, the compute stream
waiting for the whole update; ZeRO-3 gathers a stage ahead, so a stage's forward pass waits
for the next stage's update too; the expert biases' correction waits for all of it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fastllm.engine.buffers import ALIGNMENT, Shard
from fastllm.engine.update_fence import UpdateFence

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


@dataclass
class _Slot:
    """Room on the device for one chunk of each streamed kind."""

    tensors: dict[str, Tensor]
    free: Any = None
    """The download stream's mark past the copy back of the slot's last chunk."""


class OffloadedState:
    """Streams the host-resident optimizer state of shards through two chunk-sized slots on
    the device, beside the compute stream (`fence`'s streams: on a CPU, the same copies, one
    after the other)."""

    def __init__(
        self, shards: Sequence[Shard], device: torch.device, fence: UpdateFence, chunk: int = CHUNK
    ) -> None:
        """`shards`: every shard the optimizer updates, their state in host memory; `fence`:
        where the update marks its progress for the work that follows it."""
        if chunk % ALIGNMENT:  # the chunks of a decay run start where its elements align
            raise ValueError(f"a chunk is a multiple of {ALIGNMENT} elements, got {chunk}")
        self.fence, self.streams, self.chunk = fence, fence.streams, chunk
        kinds = _streamed(shards[0]) if shards else {}
        size = min(chunk, max((shard.grad.numel() for shard in shards), default=0))
        self.slots = [
            _Slot(
                {kind: torch.empty(size, dtype=t.dtype, device=device) for kind, t in kinds.items()}
            )
            for _ in range(2)
        ]

    @property
    def device_bytes(self) -> int:
        """What the slots take on the device."""
        return sum(t.numel() * t.element_size() for s in self.slots for t in s.tensors.values())

    def update(
        self,
        stages: Sequence[tuple[int, Sequence[Shard]]],
        update: Callable[[Shard, StateSpan], None],
    ) -> None:
        """Queue `update` (in place, on the device) of each chunk of the state of each
        stage's shards, the stages in the order given, on the update stream, which `update`'s
        kernels run on. The fence gets a mark past each stage's last chunk, and one past the
        last copy back; nothing here waits for the device."""
        streams, fence = self.streams, self.fence
        streams.wait("update", streams.record("compute"))  # the gradients are reduced
        fence.before_copies_in()
        chunks = 0
        for stage, shards in stages:
            for shard in shards:
                # The stage's gradients may be given back (transient buffers) as the step
                # ends: their memory is not reused before the update has read them.
                streams.keep(shard.grad, "update")
                host = _streamed(shard)
                for start in range(0, shard.grad.numel(), self.chunk):
                    end = min(start + self.chunk, shard.grad.numel())
                    slot = self.slots[chunks % 2]
                    chunks += 1
                    views = {kind: slot.tensors[kind][: end - start] for kind in host}
                    self._load(slot, host, views, start)
                    master = views.get("master")
                    if master is None and shard.master is not None:  # fp32: the weights
                        master = shard.master[start:end]
                    span = StateSpan(
                        start,
                        end,
                        master,
                        views.get("master_low"),
                        views["exp_avg"],
                        views["exp_avg_sq"],
                    )
                    with streams.on("update"):
                        update(shard, span)
                    self._store(slot, host, views, start)
            fence.stage_updated(stage)
        fence.state_stored()

    def _load(
        self, slot: _Slot, host: dict[str, Tensor], views: dict[str, Tensor], start: int
    ) -> None:
        streams = self.streams
        if slot.free is not None:  # the slot's previous chunk has left
            streams.wait("upload", slot.free)
        with streams.on("upload"):
            for kind, tensor in host.items():
                views[kind].copy_(tensor[start : start + views[kind].numel()], non_blocking=True)
        streams.wait("update", streams.record("upload"))

    def _store(
        self, slot: _Slot, host: dict[str, Tensor], views: dict[str, Tensor], start: int
    ) -> None:
        streams = self.streams
        streams.wait("download", streams.record("update"))
        with streams.on("download"):
            for kind, tensor in host.items():
                tensor[start : start + views[kind].numel()].copy_(views[kind], non_blocking=True)
        slot.free = streams.record("download")


def _streamed(shard: Shard) -> dict[str, Tensor]:
    """The shard's state in host memory, by kind. In fp32 training the masters are the compute
    weights themselves, on the GPU: only the moments travel."""
    state = {kind: getattr(shard, kind) for kind in STREAMED}
    if state["master"] is shard.weight:
        del state["master"]
    return {kind: tensor for kind, tensor in state.items() if tensor is not None}
