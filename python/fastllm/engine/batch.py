"""A step's micro-batches, prepared once for the runner: this rank's sequence-data chunks on
the device, the document ids attention keeps within, the pieces of `schedule.micro_batch_splits`,
and each piece's share of the global batch's trained tokens (the weight of its loss).

The weights of all pieces of all ranks of a step sum to 1, so the summed weighted losses are
the mean loss over the trained tokens of the whole global batch, whatever the micro-batching,
the pieces and the data-parallel split."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from fastllm.data import Batch
from fastllm.parallel.dimension import Dimension
from fastllm.parallel.sequence_data import SequenceDataDimension

Piece = tuple[Tensor, Tensor, Tensor | None]
"""Token ids, labels and attention document ids (None: plain causal) of a micro-batch or of
one piece of it (its document ids then from the start of the sequences), on the device."""

IGNORED = -100
"""The label of a position that trains nothing."""


@dataclass(frozen=True)
class MicroBatch:
    pieces: list[Piece]
    """Its `schedule.micro_batch_splits` pieces (one without splits)."""
    weights: list[float]
    """Each piece's trained tokens over those of the global batch (over every data rank)."""


class BatchPreparer:
    def __init__(
        self,
        *,
        data: Dimension,
        sequence_data: SequenceDataDimension,
        splits: int,
        cross_document_attention: bool,
        device: torch.device,
    ) -> None:
        self.data, self.sequence_data, self.splits = data, sequence_data, splits
        self.cross_document_attention, self.device = cross_document_attention, device

    def prepare(self, batches: Sequence[Batch]) -> list[MicroBatch]:
        """The step's micro-batches of this rank (every data rank calls it: the token count
        of the global batch is summed over them)."""
        labels = [self.sequence_data.chunk(batch.labels) for batch in batches]
        counts = [self._piece_counts(chunk) for chunk in labels]
        total = float(sum(sum(piece) for piece in counts))
        if self.data.size > 1:
            summed = torch.tensor(total, device=self.device)
            dist.all_reduce(summed, group=self.data.group)
            total = summed.item()
        return [
            MicroBatch(
                self._cut(
                    self.sequence_data.chunk(batch.input_ids).to(self.device, non_blocking=True),
                    chunk.to(self.device, non_blocking=True),
                    self._attention_documents(batch),
                ),
                [count / total if total else 0.0 for count in piece_counts],
            )
            for batch, chunk, piece_counts in zip(batches, labels, counts, strict=True)
        ]

    def _cut(self, input_ids: Tensor, labels: Tensor, documents: Tensor | None) -> list[Piece]:
        """The micro-batch's pieces: their token ids and labels, and the document ids from the
        start of the sequences to the end of each piece (what its keys cover). Uncut, the
        micro-batch itself (with sequence-data parallelism, its document ids reach to the end
        of this rank's chunk)."""
        if self.splits == 1:
            return [(input_ids, labels, documents)]
        length = input_ids.shape[1] // self.splits
        return [
            (
                input_ids[:, end - length : end],
                labels[:, end - length : end],
                None if documents is None else documents[:, :end],
            )
            for end in range(length, input_ids.shape[1] + 1, length)
        ]

    def _piece_counts(self, labels: Tensor) -> list[int]:
        """Trained tokens of each piece of this rank's chunk of a micro-batch."""
        trained = (labels != IGNORED).reshape(labels.shape[0], self.splits, -1)
        return trained.sum(dim=(0, 2)).tolist()

    def _attention_documents(self, batch: Batch) -> Tensor | None:
        """The document ids attention must keep within, on the device; None when it may cross
        documents (`batch.cross_document_attention`) or each sequence is a single document,
        where plain causal attention (the fastest kernels) is the same. With sequence-data
        parallelism, those of the sequences up to the end of this rank's chunk."""
        ids = batch.document_ids
        if self.cross_document_attention or bool((ids == ids[:, :1]).all()):
            return None
        return self.sequence_data.prefix(ids).to(self.device, non_blocking=True)
