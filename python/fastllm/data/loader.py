"""Batches for one data-parallel rank, prepared ahead of the training step by a background
thread into pinned memory, resumable from a consumed-samples count."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from fastllm.data.samples import SampleStream


@dataclass
class Batch:
    """One micro-batch: inputs, next-token labels (-100: no loss) and document ids."""

    input_ids: Tensor
    labels: Tensor
    document_ids: Tensor


class DataLoader:
    """Steps of `batch_size` samples from `stream`; this rank gets its contiguous share of each
    step (`batch_size / world_size` samples) as micro-batches of `micro_batch_size`.

    Step s covers samples [s * batch_size, (s + 1) * batch_size) of the stream, so every
    sample is seen once whatever the number of ranks, and a run resumed at `consumed_samples`
    continues exactly where it stopped."""

    def __init__(
        self,
        stream: SampleStream,
        *,
        batch_size: int,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        consumed_samples: int = 0,
        prefetch: int = 4,
        pin_memory: bool | None = None,
    ) -> None:
        if batch_size % world_size or (batch_size // world_size) % micro_batch_size:
            raise ValueError(
                f"batch_size {batch_size} must split into {world_size} ranks times micro-batches of {micro_batch_size}"
            )
        self.stream, self.batch_size, self.micro_batch_size = stream, batch_size, micro_batch_size
        self.rank, self.world_size = rank, world_size
        self.consumed_samples = consumed_samples
        self.prefetch = max(prefetch, 1)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory

    @property
    def steps_left(self) -> int:
        return (len(self.stream) - self.consumed_samples) // self.batch_size

    def _step(self, first: int) -> list[Batch]:
        per_rank = self.batch_size // self.world_size
        samples = self.stream.read(first + self.rank * per_rank, per_rank)
        tokens = torch.from_numpy(samples.tokens)
        labels = tokens[:, 1:].clone()
        labels[torch.from_numpy(samples.loss_mask[:, 1:]) == 0] = -100
        input_ids, document_ids = tokens[:, :-1], torch.from_numpy(samples.document_ids[:, :-1])
        if self.pin_memory:
            input_ids, labels, document_ids = (
                t.pin_memory() for t in (input_ids, labels, document_ids)
            )
        m = self.micro_batch_size
        return [
            Batch(input_ids[i : i + m], labels[i : i + m], document_ids[i : i + m])
            for i in range(0, per_rank, m)
        ]

    def __iter__(self) -> Iterator[list[Batch]]:
        """Steps until the stream is exhausted; `consumed_samples` advances as steps are taken."""
        ready: queue.Queue[list[Batch] | BaseException | None] = queue.Queue(self.prefetch)
        stop = threading.Event()
        first_step = self.consumed_samples

        def produce() -> None:
            try:
                for first in range(
                    first_step, first_step + self.steps_left * self.batch_size, self.batch_size
                ):
                    if stop.is_set():
                        return
                    ready.put(self._step(first))
                ready.put(None)
            except BaseException as error:  # surfaced in the consumer
                ready.put(error)

        worker = threading.Thread(target=produce, name="fastllm-data-loader", daemon=True)
        worker.start()
        try:
            while (item := ready.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                self.consumed_samples += self.batch_size
                yield item
        finally:
            stop.set()
            while worker.is_alive():  # unblock a producer waiting on a full queue
                try:
                    ready.get_nowait()
                except queue.Empty:
                    worker.join(timeout=0.01)
