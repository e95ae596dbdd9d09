"""A step's micro-batches, prepared once for the runner: this rank's sequence-data chunks on
the device, the document ids attention keeps within, the pieces of `schedule.micro_batch_splits`,
and each piece's share of the global batch's trained tokens (the weight of its loss).

The weights of all pieces of all ranks of a step sum to 1, so the summed weighted losses are
the mean loss over the trained tokens of the whole global batch, whatever the micro-batching,
the pieces and the data-parallel split."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

from fastllm.data import Batch
from fastllm.parallel.dimension import Dimension
from fastllm.parallel.sequence_data import SequenceDataDimension
from fastllm_kernels.branch_attention import plan_ahead, plans_taken_on

Piece = tuple[Tensor, Tensor, Tensor | None]
"""Token ids, labels and attention document ids (None: plain causal) of a micro-batch or of
one piece of it (its document ids then from the start of the sequences), on the device."""

IGNORED = -100
"""The label of a position that trains nothing."""


@dataclass(frozen=True)
class Pairs:
    """A micro-batch of preference pairs (`data.loader.Batch`), what attention, positions and
    the DPO loss read, on the device."""

    parts: Tensor
    """(batch, seq): 0 a pair's prompt, 1 its chosen answer, 2 its rejected one, -1 padding:
    attention's branch ids (each answer sees the prompt, never the other answer); with
    sequence-data parallelism, up to the end of this rank's chunk (the keys)."""
    positions: Tensor
    """(batch, seq): both answers continue the prompt's positions (this rank's chunk)."""
    spans: Tensor
    """(batch × seq,): 2p for the labelled tokens of pair p's chosen answer, 2p + 1 for its
    rejected one, -1 elsewhere; pairs p counted in the micro-batch, row by row (this rank's
    chunk: a pair may have tokens in several chunks, or none in this one)."""
    count: int
    """Pairs in the micro-batch."""
    share: float
    """`count` over the pairs of the global batch (over every data rank): the weight of its
    pair-averaged losses."""
    ids: Tensor | None = None
    """(count,) on the host: each pair's id in its sample stream (`Batch.pair_ids`)."""
    reference: Tensor | None = None
    """(2 × count,) fp32: the reference's log-probabilities of each pair's chosen and rejected
    answer, when the batch came with them (`Batch.reference_log_probs`)."""

    def piece(self, end: int, length: int) -> Pairs:
        """Those of the piece of `length` positions that ends at `end`: its positions and
        spans, and the branch ids of its keys (from the start of the sequences); the pairs
        still counted in the whole micro-batch (a pair may have tokens in several pieces)."""
        rows = self.positions.shape[0]
        return replace(
            self,
            parts=self.parts[:, :end],
            positions=self.positions[:, end - length : end],
            spans=self.spans.view(rows, -1)[:, end - length : end].reshape(-1),
        )


@dataclass(frozen=True)
class MicroBatch:
    pieces: list[Piece]
    """Its `schedule.micro_batch_splits` pieces (one without splits)."""
    weights: list[float]
    """Each piece's trained tokens over those of the global batch (over every data rank)."""
    pairs: Pairs | None = None
    """Preference pairs: their parts, positions and spans."""

    def pairs_of(self, piece: int) -> Pairs | None:
        """`pairs` as piece `piece` reads them (uncut: the micro-batch's)."""
        if self.pairs is None or len(self.pieces) == 1:
            return self.pairs
        length = self.pieces[piece][0].shape[1]
        return self.pairs.piece((piece + 1) * length, length)

    def whole(self) -> Piece:
        """The micro-batch uncut: its pieces joined (the last one's document ids cover all)."""
        if len(self.pieces) == 1:
            return self.pieces[0]
        input_ids, labels, _ = zip(*self.pieces, strict=True)
        return torch.cat(input_ids, dim=1), torch.cat(labels, dim=1), self.pieces[-1][2]


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
        spans = [_pair_spans(batch) if batch.parts is not None else None for batch in batches]
        pairs = float(sum(rows.numel() for _, rows, _ in filter(None, spans)))
        if self.data.size > 1:
            summed = torch.tensor([total, pairs], dtype=torch.float64, device=self.device)
            dist.all_reduce(summed, group=self.data.group)
            total, pairs = summed.tolist()
        micro_batches = [
            MicroBatch(
                self._cut(
                    self.sequence_data.chunk(batch.input_ids).to(self.device, non_blocking=True),
                    chunk.to(self.device, non_blocking=True),
                    self._attention_documents(batch),
                ),
                [count / total if total else 0.0 for count in piece_counts],
                None if span is None else self._pairs(batch, *span, pairs),
            )
            for batch, chunk, piece_counts, span in zip(batches, labels, counts, spans, strict=True)
        ]
        for batch, micro_batch in zip(batches, micro_batches, strict=True):
            self._plan_branches(batch, micro_batch)
        return micro_batches

    def _plan_branches(self, batch: Batch, micro_batch: MicroBatch) -> None:
        """Shared-prefix attention's plan of a micro-batch of pairs, built now from the
        host copies of its document and branch ids (`branch_attention.plan_ahead`) rather than
        in its first layer, which would wait for the device to copy them back. Pieces and
        sequence-data chunks give attention ids of their own (slices): their first layers
        still plan."""
        pairs, pieces = micro_batch.pairs, micro_batch.pieces
        if pairs is None or len(pieces) > 1 or self.sequence_data.split:
            return
        if not plans_taken_on(self.device):  # attention runs masks there
            return
        assert batch.parts is not None
        documents = pieces[0][2]  # whole sequences: the ids sent are the batch's own
        host_documents = None if documents is None else batch.document_ids
        plan_ahead(host_documents, batch.parts, documents, pairs.parts)

    def _pairs(
        self, batch: Batch, spans: Tensor, rows: Tensor, documents: Tensor, total: float
    ) -> Pairs:
        assert batch.parts is not None and batch.position_ids is not None
        device, count = self.device, rows.numel()
        ids = None if batch.pair_ids is None else batch.pair_ids[rows, documents]
        reference = None
        if batch.reference_log_probs is not None:
            reference = batch.reference_log_probs[rows, documents].reshape(-1)
            if reference.isnan().any():
                raise ValueError(
                    "reference log-probabilities missing for pairs of the batch: the table "
                    "given to the loader does not cover its pairs"
                )
            reference = reference.to(device, non_blocking=True)
        # With sequence-data parallelism: the branch ids of the keys (the prefix), and the
        # positions and spans of this rank's chunk. Each rank of the group counts every pair
        # of the micro-batch, in `total` too, so their shares of a pair add up to its own.
        sequence_data = self.sequence_data
        spans = sequence_data.chunk(spans.view(batch.parts.shape)).reshape(-1)
        return Pairs(
            sequence_data.prefix(batch.parts).to(device, torch.int64, non_blocking=True),
            sequence_data.chunk(batch.position_ids).to(device, non_blocking=True),
            spans.to(device, non_blocking=True),
            count,
            count / total if total else 0.0,
            ids,
            reference,
        )

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
        pairs = batch.parts is not None  # preference pairs: each keeps to itself, always
        if not pairs and (self.cross_document_attention or bool((ids == ids[:, :1]).all())):
            return None
        return self.sequence_data.prefix(ids).to(self.device, non_blocking=True)


def _pair_spans(batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
    """`Pairs.spans` of a micro-batch of preference pairs, and the row and the document (id)
    of each of its pairs, in their order: by row, then by document."""
    assert batch.parts is not None
    parts, labels = batch.parts.long(), batch.labels
    documents = batch.document_ids.long()
    rows = torch.arange(parts.shape[0])[:, None].expand_as(parts)
    answer = (labels != IGNORED) & (parts > 0)
    per_row = int(documents.max()) + 1
    keys = rows * per_row + documents  # one per pair of the micro-batch
    unique, pair = torch.unique(keys[answer], return_inverse=True)
    spans = torch.full(parts.shape, -1, dtype=torch.int64)
    spans[answer] = 2 * pair + parts[answer] - 1
    return spans.reshape(-1), unique // per_row, unique % per_row
