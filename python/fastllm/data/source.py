"""Python data sources (`data.source`): documents yielded by user code, packed (or, with
truncated sampling, cut) here into the samples of a run as the Rust sampler does prepared
datasets, FIM-transformed by the same native code, with the source's position at each step
boundary kept for the checkpoint, so that a resumed run reads exactly the samples the
uninterrupted run would have."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from fastllm import _native
from fastllm.config import ConfigError, registry
from fastllm.config.data import DataSourceConfig
from fastllm.data.samples import Samples, SampleStream


@dataclass
class Document:
    """One document: its token ids, and the `[begin, end)` token ranges not trained on (a
    prompt: the labels of those tokens are masked)."""

    tokens: Sequence[int] | np.ndarray
    loss_masking_spans: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class SourceContext:
    """What fastllm tells a source when it makes it."""

    seed: int
    """`model.distributed.seed`: the source draws any order or randomness from it alone."""
    vocab_size: int
    """`model.base_model.vocab_size`: every token id must be below it."""


class DataSource(Protocol):
    """The runtime part of a `data_source` component, made as `Class(config, context)`.

    `next_document` gives the next document, the same sequence for the same config and
    seed; None once the source has no more (the run is refused if it needed more). `state`
    is the position before the next document, as plain JSON data (ints, strings, lists,
    dicts), a new value at each call: it is saved in checkpoints, and `restore(state)` on a
    new source of the same config and seed goes back there."""

    def next_document(self) -> Document | None: ...
    def state(self) -> Any: ...
    def restore(self, state: Any) -> None: ...


def make_source(config: DataSourceConfig, context: SourceContext) -> DataSource:
    """The source of `config` (its `implementation`, imported now)."""
    source: DataSource = registry.implementation(config)(config, context)
    return source


class SourceSamples:
    """`step_ends[-1]` samples of `sequence_length + 1` tokens packed from `source`'s documents
    in order (a document continues into the next sample), read strictly forward (the loader's
    thread does): every rank packs every sample and keeps its share of each step. Its position
    at the end of each step (`step_ends`: its samples before the end of each step, increasing),
    known once the step is read, is kept until `position(samples)` is asked for it.

    `truncate`: each sample is one document instead, cut to the sample's length or padded (as
    `data.sampling: truncated` samples prepared datasets: token 0, or FIM's pad token; one more
    document id; not trained); a document whose loss-masking spans leave its sample no trained
    label is skipped. `fim`: sample k is transformed as the Rust sampler transforms its
    samples, with k's draws; a document with loss-masking spans is then refused.
    `start`, `position`: a resumed run's samples read and the position saved with them."""

    is_preference = False
    num_pairs = 0

    def __init__(
        self,
        source: DataSource,
        *,
        sequence_length: int,
        step_ends: np.ndarray,
        vocab_size: int,
        truncate: bool = False,
        fim: _native.Fim | None = None,
        start: int = 0,
        position: dict[str, Any] | None = None,
        key: str = "data.source",
    ) -> None:
        self.source, self.key = source, key
        self.truncate, self.fim = truncate, fim
        self.sample_length = sequence_length + 1
        self.num_samples, self.vocab_size = int(step_ends[-1]), vocab_size
        self._step_ends, self._step_end_set = step_ends, set(step_ends.tolist())
        self._cursor = start
        self._pending: tuple[np.ndarray, np.ndarray] | None = None
        """The rest of the document the last sample ended in: its tokens and loss mask."""
        self._pending_state: Any = None
        """The source's state before that document, and how many of its tokens were used."""
        self._used = 0
        self._documents = 0
        if position is not None:
            self._restore(position)
        elif start:
            raise ConfigError(key, f"resuming after {start} samples needs the source's position")
        self._positions: dict[int, dict[str, Any]] = {start: self._position()}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.num_samples

    def position(self, samples: int) -> dict[str, Any]:
        """The position after `samples` samples (a step boundary already read); the ones
        before it are forgotten."""
        with self._lock:
            for earlier in [s for s in self._positions if s < samples]:
                del self._positions[earlier]
            return self._positions[samples]

    def read(self, first: int, count: int) -> Samples:
        if first < self._cursor:
            raise ValueError(f"{self.key}: samples are read forward: {first} after {self._cursor}")
        while self._cursor < first:
            self._next_sample()
        shape = (count, self.sample_length)
        tokens = np.empty(shape, dtype=np.int64)
        document_ids = np.empty(shape, dtype=np.int32)
        loss_mask = np.empty(shape, dtype=np.uint8)
        real = np.empty(count, dtype=np.int64)
        for row in range(count):
            parts = self._next_sample()
            real[row] = length = len(parts[0])
            for buffer, part in zip((tokens, document_ids, loss_mask), parts, strict=True):
                buffer[row, :length] = part
        if self.fim is not None:  # it pads after its transform, with its pad token
            flat = (tokens.reshape(-1), document_ids.reshape(-1), loss_mask.reshape(-1))
            self.fim.fill(first, *flat, real.tolist())
        else:  # as the Rust sampler pads without FIM
            padding = np.arange(self.sample_length) >= real[:, None]
            tokens[padding], document_ids[padding], loss_mask[padding] = 0, 1, 0
        end = self._step_ends[np.searchsorted(self._step_ends, self._cursor)]
        while self._cursor < end:  # the later ranks' share: the step's position
            self._next_sample()
        return Samples(tokens, document_ids, loss_mask)

    def _next_sample(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The next sample's real tokens, document ids and loss mask (truncated: fewer than
        `sample_length` when its document is shorter)."""
        if self._cursor >= self.num_samples:
            raise ValueError(f"{self.key}: sample {self._cursor} is past the run's last")
        parts = self._truncated_sample() if self.truncate else self._packed_sample()
        self._cursor += 1
        if self._cursor in self._step_end_set:
            with self._lock:
                self._positions[self._cursor] = self._position()
        return parts

    def _packed_sample(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The next `sample_length` tokens of the documents laid end to end."""
        tokens, ids, mask = [], [], []
        filled = 0
        while filled < self.sample_length:
            if self._pending is None:
                self._read_document()
            assert self._pending is not None
            take = min(self.sample_length - filled, len(self._pending[0]) - self._used)
            part = slice(self._used, self._used + take)
            tokens.append(self._pending[0][part])
            mask.append(self._pending[1][part])
            ids.append(np.full(take, len(ids), dtype=np.int32))
            filled += take
            self._used += take
            if self._used == len(self._pending[0]):
                self._pending = None
        return np.concatenate(tokens), np.concatenate(ids), np.concatenate(mask)

    def _truncated_sample(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The next document's first `sample_length` tokens (as one document), skipping those
        whose spans leave them no trained label (the first token is only ever an input), as
        the Rust sampler skips such samples of datasets with spans."""
        while True:
            self._read_document()
            assert self._pending is not None
            tokens, mask = (part[: self.sample_length] for part in self._pending)
            self._pending = None
            if mask.all() or mask[1:].any():
                return tokens, np.zeros(len(tokens), dtype=np.int32), mask

    def _read_document(self) -> None:
        """The next document of the source that has a token, checked."""
        while True:
            state = self.source.state()
            document = self.source.next_document()
            if document is None:
                raise ConfigError(
                    self.key,
                    f"the source ended after {self._documents} documents, before the "
                    f"{self.num_samples} samples the run trains on",
                )
            where = f"{self.key}: document {self._documents}"
            self._documents += 1
            tokens = np.asarray(document.tokens, dtype=np.int64).reshape(-1)
            if not len(tokens):
                continue
            outside = tokens[(tokens < 0) | (tokens >= self.vocab_size)]
            if len(outside):
                raise ConfigError(
                    self.key,
                    f"{where} holds token id {int(outside[0])}, outside "
                    f"model.base_model.vocab_size {self.vocab_size}",
                )
            mask = np.ones(len(tokens), dtype=np.uint8)
            for begin, end in document.loss_masking_spans:
                if not 0 <= begin <= end <= len(tokens):
                    raise ConfigError(
                        self.key,
                        f"{where}: loss-masking span {(begin, end)} outside its {len(tokens)} tokens",
                    )
                mask[begin:end] = 0
            if self.fim is not None and not mask.all():
                raise ConfigError(
                    "data.fim",
                    f"{where} has loss-masking spans, which FIM would move; turn one of them off",
                )
            self._pending, self._pending_state, self._used = (tokens, mask), state, 0
            return

    def _position(self) -> dict[str, Any]:
        """Plain data: the source's state before the document in progress, the tokens of it
        already packed, and the documents read."""
        if self._pending is None:
            return {"source": self.source.state(), "used": 0, "documents": self._documents}
        return {"source": self._pending_state, "used": self._used, "documents": self._documents - 1}

    def _restore(self, position: dict[str, Any]) -> None:
        self.source.restore(position["source"])
        self._documents = position["documents"]
        if position["used"]:
            self._read_document()
            self._used = position["used"]


class BlendedSamples:
    """The samples of a source blended with those of prepared datasets: sample i is the next
    of the source where `from_source[i]`, else the next of `prepared` (both read in order)."""

    is_preference = False
    num_pairs = 0

    def __init__(
        self, source: SourceSamples, prepared: SampleStream, from_source: np.ndarray
    ) -> None:
        if prepared.is_preference:
            raise ConfigError("data.path", "preference pairs do not blend with data.source")
        self.source, self.prepared, self.from_source = source, prepared, from_source
        self.sample_length = source.sample_length
        self._before = np.concatenate([[0], np.cumsum(from_source)])
        """The source's samples before sample i of the blend."""

    def __len__(self) -> int:
        return len(self.from_source)

    def position(self, samples: int) -> dict[str, Any]:
        return self.source.position(int(self._before[samples]))

    def read(self, first: int, count: int) -> Samples:
        chosen = self.from_source[first : first + count]
        source_first = int(self._before[first])
        ours = self.source.read(source_first, int(chosen.sum()))  # also when none: to the step end
        theirs = ours
        if not chosen.all():
            theirs = self.prepared.read(first - source_first, int((~chosen).sum()))
        parts = []
        for name in ("tokens", "document_ids", "loss_mask"):
            rows = np.empty((count, self.sample_length), dtype=getattr(ours, name).dtype)
            rows[chosen], rows[~chosen] = getattr(ours, name), getattr(theirs, name)
            parts.append(rows)
        return Samples(*parts)


def source_choices(share: float, num_samples: int, seed: int) -> np.ndarray:
    """Which samples of a blend come from the source (each with probability `share`), drawn
    from the run's seed alone."""
    return np.random.default_rng([seed, SOURCE_DRAW]).random(num_samples) < share


SOURCE_DRAW = 0x5017CE
"""Salt of the draw of `source_choices`: another stream than any other drawn from the seed."""
