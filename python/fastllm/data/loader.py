"""Batches for one data-parallel rank, prepared ahead of the training step by a background
thread into pinned memory, resumable from a consumed-samples count."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fastllm.data.samples import PROMPT, SampleStream
from fastllm.data.source import BlendedSamples, SourceSamples


@dataclass
class Batch:
    """One micro-batch: inputs, next-token labels (-100: no loss) and document ids, each
    (micro_batch_size, sequence_length); and for preference pairs, their parts and positions.

    `document_ids[r, t]`: which document (preference pair) of row r token t belongs to, counted
    0, 1, 2, … from the row's start; padding is one more after the last. A pair never spans
    two rows, so never two micro-batches.

    A preference pair of P prompt, C chosen and R rejected tokens (as prepared) takes
    P + C + R + 1 positions of its row, one document, in three parts (`parts[r, t]`: 0 prompt,
    1 chosen, 2 rejected, -1 padding; `samples.PROMPT`, …):

        part 0: p[0] … p[P-2]               the prompt but its last token
        part 1: p[P-1] c[0] … c[C-1]        the prompt's last token, then the chosen answer
        part 2: p[P-1] r[0] … r[R-1]        the prompt's last token again, then the rejected one

    so that each answer's part starts with the token that predicts its first token, and each
    label lies in its token's part. Attention for a pair: a token of part k attends to the
    earlier tokens of its own part and to part 0 of its pair, never to the other answer's part
    (tokens of different documents never attend to each other). `position_ids` restart at each
    document: part 0 is at 0 … P-2, and both answer parts at P-1 … (the positions their tokens
    have in `prompt + answer`).

    `labels[r, t]` is the token at t + 1 when that token is an answer's own (c[i] or r[i]),
    else -100: the chosen part's labels are c[0] … c[C-1] then -100 (at c[C-1]), the rejected
    part's r[0] … r[R-1] then -100, the prompt's all -100. So log p(chosen | prompt) is the sum
    of the label log-probabilities over `parts == 1` (labels != -100) of the pair, and
    log p(rejected | prompt) over `parts == 2`; r[0] is predicted by the repeated p[P-1], whose
    context is the prompt's, never the chosen answer.

    `parts` and `position_ids` are None for other datasets, whose positions follow from
    `document_ids`. Every field but the last two is per token, so micro-batches and sequence
    splits cut them like the inputs; the last two are per pair of each row."""

    input_ids: Tensor
    labels: Tensor
    document_ids: Tensor
    parts: Tensor | None = None
    position_ids: Tensor | None = None
    pair_ids: Tensor | None = None
    """Preference pairs: (micro_batch_size, most pairs in a row) int64, which pair of the
    stream (`SampleStream.sample_pairs`) each document of a row is: row r's document k is pair
    `pair_ids[r, k]`; -1 past a row's last pair."""
    reference_log_probs: Tensor | None = None
    """(micro_batch_size, most pairs in a row, 2) fp32: a reference model's log-probabilities
    of the chosen and the rejected answer of those pairs, when the loader was given them (DPO's
    `reference_log_probs: precomputed`); NaN past a row's last pair."""


def pair_positions(document_ids: np.ndarray, parts: np.ndarray) -> np.ndarray:
    """Position ids of rows of preference pairs (see `Batch`): the index within the token's
    part, plus, in an answer's part, the length of its pair's part 0."""
    rows, length = parts.shape
    index = np.broadcast_to(np.arange(length), (rows, length))
    starts = np.ones((rows, length), dtype=bool)
    starts[:, 1:] = (parts[:, 1:] != parts[:, :-1]) | (document_ids[:, 1:] != document_ids[:, :-1])
    part_start = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    # Prompt tokens per (row, document): documents are numbered below `length + 1` in a row.
    key = np.arange(rows)[:, None] * (length + 1) + document_ids
    prompt_lengths = np.bincount(key[parts == PROMPT], minlength=rows * (length + 1))
    return index - part_start + np.where(parts > PROMPT, prompt_lengths[key], 0)


class DataLoader:
    """Steps of `batch_size` samples from `stream`; this rank gets its contiguous share of each
    step (`batch_size / world_size` samples) as micro-batches of `micro_batch_size`.

    Step s covers samples [s * batch_size, (s + 1) * batch_size) of the stream, so every
    sample is seen once whatever the number of ranks, and a run resumed at `consumed_samples`
    continues exactly where it stopped.

    `reference_log_probs`: for a stream of preference pairs, the (num_pairs, 2) log-probabilities
    of each pair's chosen and rejected answer under a reference model, by pair id; each batch
    then carries those of its pairs."""

    def __init__(
        self,
        stream: SampleStream | SourceSamples | BlendedSamples,
        *,
        batch_size: int,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        consumed_samples: int = 0,
        prefetch: int = 4,
        pin_memory: bool | None = None,
        reference_log_probs: Tensor | None = None,
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
        if reference_log_probs is not None and reference_log_probs.shape != (stream.num_pairs, 2):
            raise ValueError(
                f"reference_log_probs: {tuple(reference_log_probs.shape)}, not the "
                f"({stream.num_pairs}, 2) of the stream's pairs"
            )
        self.reference_log_probs = reference_log_probs

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
        parts = position_ids = pair_ids = reference = None
        if samples.parts is not None and samples.pair_ids is not None:
            pair_parts = samples.parts[:, :-1]
            parts = torch.from_numpy(np.ascontiguousarray(pair_parts))
            position_ids = torch.from_numpy(
                pair_positions(samples.document_ids[:, :-1], pair_parts)
            )
            pair_ids = torch.from_numpy(samples.pair_ids)
            if self.reference_log_probs is not None:
                reference = self.reference_log_probs[pair_ids.clamp(min=0)]
                reference[pair_ids < 0] = float("nan")
        if self.pin_memory:
            input_ids, labels, document_ids = (
                t.pin_memory() for t in (input_ids, labels, document_ids)
            )
            if parts is not None and position_ids is not None:
                parts, position_ids = parts.pin_memory(), position_ids.pin_memory()
            if reference is not None:  # the rest stays on the host (engine.batch)
                reference = reference.pin_memory()
        m = self.micro_batch_size

        def rows(t: Tensor | None, i: int) -> Tensor | None:
            return None if t is None else t[i : i + m]

        return [
            Batch(
                input_ids[i : i + m],
                labels[i : i + m],
                document_ids[i : i + m],
                rows(parts, i),
                rows(position_ids, i),
                rows(pair_ids, i),
                rows(reference, i),
            )
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
