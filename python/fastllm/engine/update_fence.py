"""What the next step waits for of an offloaded optimizer update (engine/offloaded_optimizer.py)
that runs beside it: per stage, the point of the update stream past the update of the stage's
weights, and the point of the download stream past the last copy of the state back to host
memory.

The update never blocks the host. The first use of a stage's weights on the compute stream (its
forward pass, the all-gather or refresh of its shard, a tied copy) waits for that stage alone,
so that its forward pass runs while the later stages still update; whatever reads or writes the
state in host memory (a checkpoint, a restore, an export, the next update's copies in) waits
for the copies back. The streams are behind `Streams`: CUDA's on a GPU; on a CPU, where an
operation is done when it returns, `Immediate`, which orders nothing; in tests, a recording
one."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

Stream = Literal["compute", "upload", "update", "download"]
"""`compute`: the current stream, where the passes run; the others, the update's own."""


class Streams(Protocol):
    def on(self, stream: Stream) -> AbstractContextManager[Any]:
        """Work queued inside runs on `stream`."""
        ...

    def record(self, stream: Stream) -> Any:
        """A mark of what `stream` has queued so far."""
        ...

    def wait(self, stream: Stream, mark: Any) -> None:
        """What `stream` queues from now on runs after `mark`."""
        ...

    def synchronize(self, mark: Any) -> None:
        """The host waits for `mark`."""
        ...

    def keep(self, tensor: Tensor, stream: Stream) -> None:
        """`tensor`'s memory is not reused, once freed, before `stream` has run what it has
        queued so far."""
        ...


class Immediate:
    """A CPU's: each operation is done when it returns."""

    def on(self, stream: Stream) -> AbstractContextManager[Any]:
        return nullcontext()

    def record(self, stream: Stream) -> None:
        return None

    def wait(self, stream: Stream, mark: Any) -> None:
        pass

    def synchronize(self, mark: Any) -> None:
        pass

    def keep(self, tensor: Tensor, stream: Stream) -> None:
        pass


class CudaStreams:
    """Three side streams of a GPU, CUDA events for marks."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = {name: torch.cuda.Stream(device) for name in ("upload", "update", "download")}

    def _stream(self, stream: Stream) -> torch.cuda.Stream:
        if stream == "compute":
            return torch.cuda.current_stream(self.device)
        return self.side[stream]

    def on(self, stream: Stream) -> AbstractContextManager[Any]:
        return torch.cuda.stream(self._stream(stream))

    def record(self, stream: Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self._stream(stream))
        return event

    def wait(self, stream: Stream, mark: Any) -> None:
        self._stream(stream).wait_event(mark)

    def synchronize(self, mark: Any) -> None:
        mark.synchronize()

    def keep(self, tensor: Tensor, stream: Stream) -> None:
        tensor.record_stream(self._stream(stream))


def device_streams(device: torch.device) -> Streams:
    return CudaStreams(device) if device.type == "cuda" else Immediate()


class UpdateFence:
    """The marks of the last update still to be waited for."""

    def __init__(self, streams: Streams) -> None:
        self.streams = streams
        self.updated: dict[int, Any] = {}
        """Per stage: the update stream's mark past its weights' update, until the compute
        stream waits for it."""
        self.stored: Any = None
        """The download stream's mark past the last copy back to host memory, until the host
        waits for it."""

    def stage_updated(self, stage: int) -> None:
        """The update stream has queued the update of `stage`'s weights."""
        self.updated[stage] = self.streams.record("update")

    def state_stored(self) -> None:
        """The download stream has queued the update's last copy back."""
        self.stored = self.streams.record("download")

    def before_copies_in(self) -> None:
        """The upload stream's later copies read the state the last update stored."""
        if self.stored is not None:
            self.streams.wait("upload", self.stored)

    def wait(self, stage: int) -> None:
        """The compute stream's later work reads `stage`'s updated weights."""
        mark = self.updated.pop(stage, None)
        if mark is not None:
            self.streams.wait("compute", mark)

    def wait_all(self) -> None:
        """The compute stream's later work reads every stage's updated weights."""
        for stage in sorted(self.updated):
            self.wait(stage)

    def wait_for_state(self) -> None:
        """The host reads or writes the state (in host memory, and the weights through the
        compute stream): every update and every copy back done."""
        self.wait_all()
        if self.stored is not None:
            self.streams.synchronize(self.stored)
            self.stored = None
