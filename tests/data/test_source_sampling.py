"""Truncated sampling and FIM over a Python data source: the samples the Rust sampler makes of
the same documents, each sample index transformed alike whichever rank reads it, a resumed
run reading the same samples, and what does not compose refused by key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fastllm import _native
from fastllm.config import ConfigError
from fastllm.config.data import DataConfig, DataSourceConfig, FimConfig
from fastllm.data import Samples, SampleStream, TokenDataset
from fastllm.data.fim import FimSettings, tokenizer_fim
from fastllm.data.source import Document, SourceSamples
from tests.data.conftest import TrainedTokenizer, prepare, stdlib_files, write_jsonl

SEQUENCE = 48  # samples of 49 tokens
COUNT = 24
STEPS = np.array([8, 16, 24])
SEED = 7
VOCABULARY = 600


@pytest.fixture(scope="module")
def dataset(tokenizer: TrainedTokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Paragraphs of stdlib sources, some longer than a sample, some shorter."""
    directory = tmp_path_factory.mktemp("paragraphs")
    paragraphs = [p for f in stdlib_files("json") for p in f.read_text().split("\n\n") if p]
    return prepare(
        write_jsonl(directory / "paragraphs.jsonl", paragraphs), tokenizer.path, directory / "data"
    )


class Listed:
    """Yields the documents given, in order; its state is how many it gave."""

    def __init__(self, documents: list[Document]) -> None:
        self.documents, self.read = documents, 0

    def next_document(self) -> Document | None:
        if self.read == len(self.documents):
            return None
        self.read += 1
        return self.documents[self.read - 1]

    def state(self) -> dict[str, Any]:
        return {"read": self.read}

    def restore(self, state: dict[str, Any]) -> None:
        self.read = state["read"]


def prepared(dataset: Path, cache: Path, sampling: str, fim: FimConfig | None) -> SampleStream:
    config = DataConfig(path=[str(dataset)], sampling=sampling, fim=fim)  # type: ignore[arg-type]
    return SampleStream(
        [str(dataset)],
        config,
        sequence_length=SEQUENCE,
        num_samples=COUNT,
        seed=SEED,
        cache_dir=cache,
        vocab_size=VOCABULARY,
    )


def from_source(documents: list[Document], **options: Any) -> SourceSamples:
    options = {"step_ends": STEPS, **options}
    return SourceSamples(
        Listed(documents), sequence_length=SEQUENCE, vocab_size=VOCABULARY, **options
    )


def native_fim(settings: FimSettings | None) -> _native.Fim:
    """FIM with the run's seed itself (a run salts it for its source: `source_fim`)."""
    assert settings is not None
    return _native.Fim(settings.options, seed=SEED, tokenizer=settings.tokenizer)


def assert_same(got: Samples, expected: Samples) -> None:
    np.testing.assert_array_equal(got.tokens, expected.tokens)
    np.testing.assert_array_equal(got.document_ids, expected.document_ids)
    np.testing.assert_array_equal(got.loss_mask, expected.loss_mask)


def in_order(dataset: Path) -> list[Document]:
    """The documents of a prepared dataset, in its order."""
    documents = TokenDataset(dataset)
    return [Document(documents[i]) for i in range(len(documents))]


def rows(samples: Samples, first: int, count: int) -> Samples:
    return Samples(
        *(
            part[first : first + count]
            for part in (samples.tokens, samples.document_ids, samples.loss_mask)
        )
    )


def visited(dataset: Path, samples: Samples) -> list[Document]:
    """The documents of a truncated stream's samples, whole, in its order: each found by its
    first tokens."""
    documents = TokenDataset(dataset)
    length = SEQUENCE + 1
    by_start = {tuple(documents[i][:length].tolist()): i for i in range(len(documents))}
    order = [
        by_start[tuple(row[ids == 0].tolist())]
        for row, ids in zip(samples.tokens, samples.document_ids, strict=True)
    ]
    return [Document(documents[i]) for i in order]


@pytest.mark.parametrize("split", [None, "token", "character"])
def test_truncated_source_samples_are_the_rust_samplers_of_the_same_documents(
    split: str | None, dataset: Path, tmp_path: Path
) -> None:
    """A source yielding the documents the Rust sampler visits gives its samples: cut,
    padded (token 0, or FIM's pad), one more document id and no loss on the padding, and with
    FIM the same transform of each sample."""
    plain = prepared(dataset, tmp_path, "truncated", None).read(0, COUNT)
    documents = visited(dataset, plain)
    assert min(len(d.tokens) for d in documents) <= SEQUENCE < max(len(d.tokens) for d in documents)
    fim = None if split is None else FimConfig(rate=0.7, split=split)  # type: ignore[arg-type]
    stream = prepared(dataset, tmp_path, "truncated", fim)
    expected = stream.read(0, COUNT)
    transform = None if fim is None else native_fim(stream.fim)
    got = from_source(documents, truncate=True, fim=transform).read(0, COUNT)
    assert_same(got, expected)
    assert (expected.loss_mask == 0).any()  # some documents were padded
    if fim is not None:
        assert not np.array_equal(expected.tokens, plain.tokens)


def test_fim_over_a_packed_source_transforms_each_sample_by_its_index_on_any_rank(
    dataset: Path, tmp_path: Path
) -> None:
    documents = in_order(dataset)
    settings = prepared(dataset, tmp_path, "packed", FimConfig(rate=0.7, split="character")).fim
    plain = from_source(documents).read(0, COUNT)
    expected = Samples(plain.tokens.copy(), plain.document_ids.copy(), plain.loss_mask.copy())
    flat = (
        expected.tokens.reshape(-1),
        expected.document_ids.reshape(-1),
        expected.loss_mask.reshape(-1),
    )
    native_fim(settings).fill(0, *flat, [SEQUENCE + 1] * COUNT)
    assert not np.array_equal(expected.tokens, plain.tokens)
    ranks = [from_source(documents, fim=native_fim(settings)) for _ in range(2)]
    for first in range(0, COUNT, 4):  # steps of 8: each rank's share of 4
        share = ranks[first // 4 % 2].read(first, 4)
        assert_same(share, rows(expected, first, 4))


@pytest.mark.parametrize(
    ("truncate", "split"), [(True, None), (False, "token"), (True, "character")]
)
def test_a_resumed_source_reads_the_samples_of_the_uninterrupted_run(
    truncate: bool, split: str | None, dataset: Path, tmp_path: Path
) -> None:
    documents = in_order(dataset)
    fim = None if split is None else FimConfig(rate=0.7, split=split)  # type: ignore[arg-type]
    settings = prepared(dataset, tmp_path, "packed", fim).fim if fim else None

    def samples(**options: Any) -> SourceSamples:
        transform = None if settings is None else native_fim(settings)
        return from_source(documents, truncate=truncate, fim=transform, **options)

    whole = samples().read(0, COUNT)
    first = samples()
    first.read(0, 8)
    position = first.position(8)
    assert position["used"] == 0 if truncate else position["used"] > 0
    assert_same(samples(start=8, position=position).read(8, 16), rows(whole, 8, 16))


def test_truncated_samples_cut_pad_and_skip_documents_their_spans_leave_untrained() -> None:
    documents = [
        Document(list(range(1, 61)), [(0, 3)]),  # cut to 49 tokens, its first 3 masked
        Document([5, 6, 7], [(1, 3)]),  # no trained label: skipped
        Document([9]),  # one token, no span: kept
        Document([11, 12, 13], [(0, 1)]),  # only the first token, an input anyway, masked
    ]
    read = from_source(documents, truncate=True, step_ends=np.array([3])).read(0, 3)
    length = SEQUENCE + 1
    np.testing.assert_array_equal(read.tokens[0], range(1, length + 1))
    np.testing.assert_array_equal(read.loss_mask[0], [0, 0, 0] + [1] * (length - 3))
    assert (read.document_ids[0] == 0).all()
    for row, tokens, mask in ((1, [9], [1]), (2, [11, 12, 13], [0, 1, 1])):
        padding = length - len(tokens)
        np.testing.assert_array_equal(read.tokens[row], tokens + [0] * padding)
        np.testing.assert_array_equal(read.loss_mask[row], mask + [0] * padding)
        np.testing.assert_array_equal(read.document_ids[row], [0] * len(tokens) + [1] * padding)


def test_fim_refuses_a_source_document_with_loss_masking_spans(
    dataset: Path, tmp_path: Path
) -> None:
    settings = prepared(dataset, tmp_path, "packed", FimConfig(split="token")).fim
    documents = [Document([1, 2, 3]), Document([4, 5, 6], [(0, 1)])]
    samples = from_source(documents, fim=native_fim(settings), step_ends=np.array([1]))
    with pytest.raises(
        ConfigError, match=r"^data.fim: data.source: document 1 has loss-masking spans"
    ):
        samples.read(0, 1)


def test_fim_tokenizer_of_a_source_alone_resolves_as_the_datasets_does(
    dataset: Path, tmp_path: Path
) -> None:
    fim = FimConfig(rate=0.7, split="character")
    from_dataset = prepared(dataset, tmp_path, "packed", fim).fim
    tokenizer = str(dataset / "tokenizer.json")
    named = tokenizer_fim(FimConfig(rate=0.7, split="character", tokenizer=tokenizer), VOCABULARY)
    assert named.tokenizer == tokenizer
    documents = in_order(dataset)
    one, other = (
        from_source(documents, fim=native_fim(s)).read(0, COUNT) for s in (from_dataset, named)
    )
    assert_same(one, other)


@pytest.mark.parametrize(
    ("changes", "vocab_size", "refused"),
    [
        (
            {"tokenizer": "missing.json"},
            VOCABULARY,
            r"^data.fim.tokenizer: missing.json: no such file",
        ),
        ({"eos_token": "<eos>"}, VOCABULARY, r"^data.fim.eos_token: '<eos>' is not a token of"),
        ({"pad_token": "<pad>"}, VOCABULARY, r"^data.fim.pad_token: '<pad>' is not a token of"),
        (
            {},
            100,
            r"^data.fim: the FIM tokenizer .* has 600 tokens but model.base_model.vocab_size is 100",
        ),
    ],
)
def test_a_bad_fim_tokenizer_of_a_source_is_refused_by_key(
    changes: dict[str, str], vocab_size: int, refused: str, dataset: Path
) -> None:
    options = {"tokenizer": str(dataset / "tokenizer.json"), **changes}
    with pytest.raises(ConfigError, match=refused):
        tokenizer_fim(FimConfig(**options), vocab_size)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("config", "refused"),
    [
        (DataConfig(source=DataSourceConfig(), fim=FimConfig()), "fim.tokenizer: is required"),
        (
            DataConfig(path=["d"], fim=FimConfig(tokenizer="t.json")),
            "fim.tokenizer: is for a data.source",
        ),
        (
            DataConfig(path=["d"], fim=FimConfig(eos_token="</s>")),
            "fim.eos_token: is for a data.source",
        ),
    ],
)
def test_the_fim_tokenizer_key_is_required_on_a_source_alone_and_refused_elsewhere(
    config: DataConfig, refused: str
) -> None:
    with pytest.raises(ConfigError, match=refused):
        config.validate()
    source = DataConfig(
        source=DataSourceConfig(), sampling="truncated", fim=FimConfig(tokenizer="t.json")
    )
    source.validate()  # truncated sampling and FIM compose with a source
