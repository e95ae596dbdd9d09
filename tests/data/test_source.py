"""Python data sources packed into samples (`fastllm.data.source`): documents laid end to end,
spans masked, each rank's share read forward, and a position that restores the same samples."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fastllm.config import ConfigError
from fastllm.data.samples import Samples
from fastllm.data.source import BlendedSamples, Document, SourceSamples, source_choices

SEQUENCE = 7  # samples of 8 tokens


class Counting:
    """Document k: k + 1 tokens, 100k, 100k + 1, …, its first token masked when k is odd."""

    def __init__(self, limit: int | None = None) -> None:
        self.read, self.limit = 0, limit

    def next_document(self) -> Document | None:
        k = self.read
        if k == self.limit:
            return None
        self.read += 1
        return Document(list(range(100 * k, 100 * k + k + 1)), [(0, 1)] if k % 2 else [])

    def state(self) -> dict[str, Any]:
        return {"read": self.read}

    def restore(self, state: dict[str, Any]) -> None:
        self.read = state["read"]


def samples(source: Counting | None = None, **options: Any) -> SourceSamples:
    """Three steps of 4 samples (unless `step_ends` says otherwise)."""
    options = {"step_ends": np.array([4, 8, 12]), **options}
    return SourceSamples(
        source or Counting(), sequence_length=SEQUENCE, vocab_size=10_000, **options
    )


def documents(count: int) -> tuple[np.ndarray, np.ndarray]:
    """The documents' tokens end to end, and their loss mask."""
    source = Counting()
    tokens, mask = [], []
    for _ in range(count):
        document = source.next_document()
        assert document is not None
        tokens += document.tokens
        mask += [
            0 if document.loss_masking_spans and i == 0 else 1 for i in range(len(document.tokens))
        ]
    return np.array(tokens), np.array(mask)


def test_documents_are_packed_end_to_end_with_their_spans_masked() -> None:
    read = samples().read(0, 12)
    tokens, mask = documents(20)
    length = SEQUENCE + 1
    np.testing.assert_array_equal(read.tokens.reshape(-1), tokens[: 12 * length])
    np.testing.assert_array_equal(read.loss_mask.reshape(-1), mask[: 12 * length])
    # Sample 1 (tokens 8 … 15): the rest of document 3 (tokens 6 … 9), then document 4.
    np.testing.assert_array_equal(read.document_ids[1], [0, 0, 1, 1, 1, 1, 1, 2])


def test_a_rank_reads_its_share_after_skipping_the_others() -> None:
    whole = samples().read(0, 12)
    ranks = [samples(), samples()]
    for step in range(3):
        for rank, stream in enumerate(ranks):
            share = stream.read(step * 4 + rank * 2, 2)
            np.testing.assert_array_equal(share.tokens, whole.tokens[step * 4 + rank * 2 :][:2])
            assert stream.position(step * 4 + 4) == ranks[0].position(step * 4 + 4)
    with pytest.raises(ValueError, match="read forward"):
        ranks[0].read(0, 1)


def test_a_position_restores_the_samples_after_it() -> None:
    whole = samples().read(0, 12)
    first = samples()
    first.read(0, 4)
    position = first.position(4)
    assert position["used"] > 0  # sample 4 begins inside a document
    resumed = samples(start=4, position=position).read(4, 8)
    np.testing.assert_array_equal(resumed.tokens, whole.tokens[4:])
    np.testing.assert_array_equal(resumed.loss_mask, whole.loss_mask[4:])
    np.testing.assert_array_equal(resumed.document_ids, whole.document_ids[4:])
    with pytest.raises(ConfigError, match="needs the source's position"):
        samples(start=4)


def test_a_source_that_ends_too_soon_or_leaves_the_vocabulary_is_refused() -> None:
    with pytest.raises(ConfigError, match="ended after 5 documents"):
        samples(Counting(limit=5)).read(0, 12)
    with pytest.raises(ConfigError, match="document 1 holds token id 100, outside"):
        SourceSamples(
            Counting(), sequence_length=SEQUENCE, step_ends=np.array([1]), vocab_size=100
        ).read(0, 1)


class Prepared:
    """Stands for a prepared dataset's stream: sample j is all -(j + 1)."""

    is_preference = False

    def read(self, first: int, count: int) -> Samples:
        tokens = -np.arange(first + 1, first + count + 1)[:, None] * np.ones(SEQUENCE + 1, int)
        return Samples(tokens, np.zeros_like(tokens, np.int32), np.ones_like(tokens, np.uint8))


def test_a_blend_takes_each_sample_from_the_source_or_the_datasets_as_drawn() -> None:
    chosen = source_choices(0.5, 12, seed=3)
    assert chosen.any() and not chosen.all()
    np.testing.assert_array_equal(chosen, source_choices(0.5, 12, seed=3))
    before = np.concatenate([[0], np.cumsum(chosen)])
    blend = BlendedSamples(samples(step_ends=before[4::4]), Prepared(), chosen)  # type: ignore[arg-type]
    read = np.concatenate([blend.read(first, 4).tokens for first in (0, 4, 8)])
    alone = samples(step_ends=before[4::4]).read(0, int(chosen.sum())).tokens
    np.testing.assert_array_equal(read[chosen], alone)
    np.testing.assert_array_equal(read[~chosen][:, 0], -np.arange(1, (~chosen).sum() + 1))
    assert blend.position(8) == blend.source.position(int(before[8]))
