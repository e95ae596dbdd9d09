"""Fill-in-the-middle through the sample stream: taking the sentinels out and putting the parts
back in order gives the original documents; rate 0 changes nothing."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from fastllm.config.data import DataConfig, FimConfig
from fastllm.data import Samples, SampleStream
from tests.data.conftest import TrainedTokenizer, prepare, stdlib_files, write_jsonl

LENGTH = 256
COUNT = 100


@pytest.fixture(scope="module")
def dataset(tokenizer: TrainedTokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The paragraphs of ASCII stdlib sources as documents: short enough that a sample holds
    several whole ones."""
    directory = tmp_path_factory.mktemp("paragraphs")
    texts = [f.read_text() for f in stdlib_files("json", "wsgiref")]
    paragraphs = [p for text in texts for p in text.split("\n\n") if p.strip()]
    assert all(p.isascii() for p in paragraphs)
    inputs = write_jsonl(directory / "paragraphs.jsonl", paragraphs)
    return prepare(inputs, tokenizer.path, directory / "data")


def stream(dataset: Path, cache: Path, fim: FimConfig | None) -> SampleStream:
    config = DataConfig(path=[str(dataset)], fim=fim)
    return SampleStream(
        [str(dataset)], config, sequence_length=LENGTH, num_samples=COUNT, seed=7, cache_dir=cache
    )


def read(dataset: Path, cache: Path, fim: FimConfig | None) -> Samples:
    return stream(dataset, cache, fim).read(0, COUNT)


def runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each run of equal document ids."""
    cuts = [0, *(np.nonzero(np.diff(ids))[0] + 1).tolist(), len(ids)]
    return list(itertools.pairwise(cuts))


@pytest.mark.parametrize("split", ["token", "character"])
def test_fim_rate_0_is_the_identity(split: str, dataset: Path, tmp_path: Path) -> None:
    plain = read(dataset, tmp_path, None)
    same = read(dataset, tmp_path, FimConfig(rate=0.0, split=split))
    assert np.array_equal(same.tokens, plain.tokens)
    assert np.array_equal(same.document_ids, plain.document_ids)
    assert np.array_equal(same.loss_mask, plain.loss_mask)


@pytest.mark.parametrize("max_middle_len", [None, 5])
@pytest.mark.parametrize("split", ["token", "character"])
def test_fim_parts_put_back_in_order_give_the_original_documents(
    split: str,
    max_middle_len: int | None,
    dataset: Path,
    tokenizer: TrainedTokenizer,
    tmp_path: Path,
) -> None:
    vocabulary = tokenizer.reference
    prefix, middle, suffix, pad = (
        vocabulary.token_to_id(f"<fim_{name}>") for name in ("prefix", "middle", "suffix", "pad")
    )
    eos = tokenizer.eos
    plain = read(dataset, tmp_path, None)
    fim = FimConfig(rate=1.0, spm_rate=0.5, split=split, max_middle_len=max_middle_len)
    samples = read(dataset, tmp_path, fim)
    # A sample's transform depends on its index alone, not on the batch that reads it.
    again = stream(dataset, tmp_path, fim).read(37, 5)
    assert np.array_equal(again.tokens, samples.tokens[37:42])

    def text(tokens: list[int]) -> str:
        return vocabulary.decode(tokens, skip_special_tokens=False)

    checked, forms = 0, {"psm": 0, "spm or empty prefix": 0}
    for i in range(COUNT):
        tokens, ids, mask = samples.tokens[i], samples.document_ids[i], samples.loss_mask[i]
        real = int(mask.sum())
        assert (mask[:real] == 1).all()
        assert (tokens[real:] == pad).all()
        assert (ids[real:] == ids[real - 1] + 1).all()
        segments = runs(ids[:real])
        assert [ids[start] for start, _ in segments] == list(range(len(segments)))
        if real == LENGTH + 1:
            segments = segments[:-1]  # the last one may be cut
        for start, end in segments:
            run = tokens[start:end].tolist()
            original = plain.tokens[i][plain.document_ids[i] == ids[start]].tolist()
            content, tail = (run[:-1], [eos]) if run[-1] == eos else (run, [])
            assert tail == original[len(original) - len(tail) :]
            if original[: len(original) - len(tail)] == []:
                assert content == []  # an empty segment is left alone
                continue
            assert content[0] == prefix
            assert content.count(prefix) == content.count(suffix) == content.count(middle) == 1
            at_suffix, at_middle = content.index(suffix), content.index(middle)
            if at_suffix == 1:  # SPM (or PSM with an empty prefix): P S suffix M prefix+middle
                forms["spm or empty prefix"] += 1
                pieces = [content[at_middle + 1 :], content[2:at_middle]]
                parts = pieces[1:]  # the prefix and middle in pieces[0] are not told apart
                middle_length = None
            else:  # PSM: P prefix S suffix M middle
                forms["psm"] += 1
                pieces = [
                    content[1:at_suffix],
                    content[at_middle + 1 :],
                    content[at_suffix + 1 : at_middle],
                ]
                parts = pieces
                middle_length = len(pieces[1]) if split == "token" else len(text(pieces[1]))
            if split == "token":
                assert [t for piece in pieces for t in piece] + tail == original
            else:
                assert "".join(map(text, pieces)) + text(tail) == text(original)
                for part in parts:  # each part re-encoded by the tokenizer
                    assert part == vocabulary.encode(text(part), add_special_tokens=False).ids
            if max_middle_len is not None and middle_length is not None:
                assert middle_length <= max_middle_len
            checked += 1
    assert checked > COUNT / 2
    assert min(forms.values()) > COUNT / 10, forms


def test_a_dataset_with_a_larger_vocabulary_than_the_fim_tokenizer_is_refused(
    dataset: Path, tmp_path: Path
) -> None:
    import json
    import shutil

    from fastllm.config import ConfigError

    copy = tmp_path / "bigger"
    shutil.copytree(dataset, copy)
    metadata = json.loads((copy / "metadata.json").read_text())
    metadata["vocab_size"] = 100_000
    (copy / "metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(ConfigError, match=r"vocabulary of 100000 tokens but the FIM tokenizer"):
        stream(copy, tmp_path / "cache", FimConfig(rate=0.5, split="character"))


def test_a_fim_tokenizer_larger_than_the_model_is_refused_naming_it(
    dataset: Path, tmp_path: Path
) -> None:
    """The ids FIM inserts (its sentinels; with character splits any token it re-encodes)
    never reach the batches' range check: the tokenizer must fit the model, also when the
    dataset's ids do and its metadata records no vocabulary size."""
    import json
    import shutil

    from tokenizers import Tokenizer

    from fastllm.config import ConfigError
    from fastllm.data import TokenDataset

    copy = tmp_path / "unsized"
    shutil.copytree(dataset, copy)
    metadata = json.loads((copy / "metadata.json").read_text())
    del metadata["vocab_size"]
    (copy / "metadata.json").write_text(json.dumps(metadata))
    tokenizer = Tokenizer.from_file(str(copy / "tokenizer.json"))
    tokenizer.add_special_tokens(["<|beyond|>"])  # one id past every id of the documents
    tokenizer.save(str(copy / "tokenizer.json"))
    data = TokenDataset(copy)
    fits = max(int(data[i].max()) for i in range(len(data))) + 1
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    assert fits < size
    config = DataConfig(path=[str(copy)], fim=FimConfig(rate=0.5, split="character"))
    with pytest.raises(ConfigError, match=rf"has {size} tokens but .*vocab_size is {fits}"):
        SampleStream(
            [str(copy)],
            config,
            sequence_length=LENGTH,
            num_samples=COUNT,
            seed=7,
            cache_dir=tmp_path / "cache",
            vocab_size=fits,
        )
