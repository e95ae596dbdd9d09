"""The sample stream and the loader: packing covers every token, labels are the next tokens,
data-parallel ranks split steps exactly, resuming continues exactly, blending follows weights."""

from __future__ import annotations

import os
import random
import shutil
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from fastllm.config import ConfigError, MachineError
from fastllm.config.data import DataConfig
from fastllm.data import DataLoader, Samples, SampleStream, TokenDataset
from fastllm.data.errors import BuildStopped
from tests.data.conftest import TrainedTokenizer, prepare, run_cli, write_jsonl
from tests.data.megatron import read_dataset


def stream(path: Path | list[Path], cache: Path, **options) -> SampleStream:
    paths = [str(p) for p in (path if isinstance(path, list) else [path])]
    config = DataConfig(
        path=paths,
        weights=options.pop("weights", None),
        sampling=options.pop("sampling", "packed"),
    )
    options.setdefault("seed", 1234)
    return SampleStream(paths, config, cache_dir=cache, weights=config.weights, **options)


def pieces_of(samples: Samples) -> list[tuple[int, ...]]:
    """The packed token stream cut where document ids change: sample i holds stream tokens
    [i·L, i·L + L], so each sample after the first adds its tokens from position 1."""
    tokens, ids = samples.tokens, samples.document_ids
    flat = np.concatenate([tokens[0], tokens[1:, 1:].reshape(-1)])
    # A boundary between stream positions p - 1 and p, seen inside the sample holding both.
    starts_in_sample = np.diff(ids, axis=1) != 0  # (count, L): between positions k and k + 1
    length = tokens.shape[1] - 1
    boundaries = [i * length + k + 1 for i, k in zip(*np.nonzero(starts_in_sample), strict=True)]
    cuts = sorted(set(boundaries))
    return [tuple(piece.tolist()) for piece in np.split(flat, cuts)]


def test_packed_epochs_hold_every_document_once(dataset: Path, tmp_path: Path) -> None:
    documents = [tuple(d) for d in read_dataset(dataset)]
    total = sum(map(len, documents))
    length = 37
    count = (2 * total) // length - 5  # most of two epochs
    samples = stream(dataset, tmp_path, sequence_length=length, num_samples=count).read(0, count)

    assert samples.tokens.shape == (count, length + 1)
    assert (samples.loss_mask == 1).all()
    assert np.array_equal(samples.tokens[:-1, -1], samples.tokens[1:, 0])  # shared tokens
    ids = samples.document_ids
    assert (ids[:, 0] == 0).all()
    assert set(np.diff(ids, axis=1).ravel().tolist()) <= {0, 1}

    pieces = pieces_of(samples)
    assert sum(map(len, pieces)) == count * length + 1
    epoch, rest = pieces[: len(documents)], pieces[len(documents) :]
    assert Counter(epoch) == Counter(documents)  # every document once: every token once
    assert epoch != documents  # shuffled
    assert Counter(rest[:-1]) <= Counter(documents)  # the second epoch: whole documents
    assert any(d[: len(rest[-1])] == rest[-1] for d in documents)  # cut at the end


def test_labels_are_the_inputs_shifted_by_one(dataset: Path, tmp_path: Path) -> None:
    packed = stream(dataset, tmp_path / "packed", sequence_length=32, num_samples=64)
    loader = DataLoader(packed, batch_size=8, micro_batch_size=4)
    for step, micro_batches in enumerate(loader):
        expected = packed.read(step * 8, 8)
        input_ids = torch.cat([b.input_ids for b in micro_batches])
        labels = torch.cat([b.labels for b in micro_batches])
        document_ids = torch.cat([b.document_ids for b in micro_batches])
        assert input_ids.shape == (8, 32)
        assert torch.equal(input_ids, torch.from_numpy(expected.tokens[:, :-1]))
        assert torch.equal(labels, torch.from_numpy(expected.tokens[:, 1:]))
        assert torch.equal(labels[:, :-1], input_ids[:, 1:])
        assert torch.equal(document_ids, torch.from_numpy(expected.document_ids[:, :-1]))
    assert loader.consumed_samples == 64

    # Truncated: one document per sample, no loss past its last token.
    documents = read_dataset(dataset)
    truncated = stream(
        dataset, tmp_path / "truncated", sequence_length=32, num_samples=40, sampling="truncated"
    )
    batches = list(DataLoader(truncated, batch_size=40, micro_batch_size=40))
    [[batch]] = batches
    expected = truncated.read(0, 40)
    short = 0
    for sample, mask, input_ids, labels in zip(
        expected.tokens, expected.loss_mask, batch.input_ids, batch.labels, strict=True
    ):
        real = int(mask.sum())
        assert any(d[:33] == sample[:real].tolist() for d in documents)  # a document, cut
        short += real < 33
        assert labels[: real - 1].tolist() == sample[1:real].tolist()
        assert (labels[real - 1 :] == -100).all()
        assert input_ids.tolist() == sample[:-1].tolist()
    assert short > 0  # some documents were shorter than a sample


def test_two_ranks_together_see_exactly_what_one_rank_sees(dataset: Path, tmp_path: Path) -> None:
    source = stream(dataset, tmp_path, sequence_length=16, num_samples=96)
    alone = list(DataLoader(source, batch_size=8, micro_batch_size=4))
    ranks = [
        list(DataLoader(source, batch_size=8, micro_batch_size=2, rank=rank, world_size=2))
        for rank in (0, 1)
    ]
    assert len(alone) == len(ranks[0]) == len(ranks[1]) == 12
    for step in range(12):
        for field in ("input_ids", "labels", "document_ids"):
            one = torch.cat([getattr(b, field) for b in alone[step]])
            two = torch.cat([getattr(b, field) for rank in ranks for b in rank[step]])
            assert torch.equal(one, two), (step, field)
    # And ranks see different samples.
    assert not torch.equal(ranks[0][0][0].input_ids, ranks[1][0][0].input_ids)


def test_restarted_loader_continues_exactly_where_an_uninterrupted_one_is(
    dataset: Path, tmp_path: Path
) -> None:
    def steps(loader: DataLoader) -> list[torch.Tensor]:
        return [
            torch.cat([b.input_ids for b in step] + [b.labels for b in step]) for step in loader
        ]

    uninterrupted = steps(
        DataLoader(
            stream(dataset, tmp_path / "a", sequence_length=16, num_samples=80),
            batch_size=8,
            micro_batch_size=2,
        )
    )
    assert len(uninterrupted) == 10

    first = DataLoader(
        stream(dataset, tmp_path / "b", sequence_length=16, num_samples=80),
        batch_size=8,
        micro_batch_size=2,
    )
    seen = []
    for step in first:  # stopped after 3 steps, with more prefetched
        seen.append(torch.cat([b.input_ids for b in step] + [b.labels for b in step]))
        if len(seen) == 3:
            break
    assert first.consumed_samples == 24
    # A new process: a new stream (its index rebuilt in another cache) and loader.
    resumed = DataLoader(
        stream(dataset, tmp_path / "c", sequence_length=16, num_samples=80),
        batch_size=8,
        micro_batch_size=2,
        consumed_samples=first.consumed_samples,
    )
    assert resumed.steps_left == 7
    rest = steps(resumed)
    assert len(seen) + len(rest) == 10
    for step, (a, b) in enumerate(zip(seen + rest, uninterrupted, strict=True)):
        assert torch.equal(a, b), step


def make_disjoint_datasets(tokenizer: TrainedTokenizer, directory: Path) -> tuple[Path, Path]:
    """Words of letters between spaces and numbers between commas: the byte-level pre-tokenizer
    never puts letters, digits and punctuation in one token, so each token tells which dataset
    it came from."""
    rng = random.Random(0)
    words = [
        "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(1, 8))) for _ in range(300)
    ]
    letters = [" ".join(rng.choices(words, k=rng.randint(5, 200))) for _ in range(60)]
    digits = [
        ",".join(str(rng.randint(0, 10**6)) for _ in range(rng.randint(5, 200))) for _ in range(60)
    ]
    return (
        prepare(
            write_jsonl(directory / "letters.jsonl", letters), tokenizer.path, directory / "letters"
        ),
        prepare(
            write_jsonl(directory / "digits.jsonl", digits), tokenizer.path, directory / "digits"
        ),
    )


def test_blending_follows_the_weights_and_keeps_each_datasets_own_order(
    tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    letters, digits = make_disjoint_datasets(tokenizer, tmp_path)
    vocabularies = [
        {t for d in read_dataset(p) for t in d} - {tokenizer.eos} for p in (letters, digits)
    ]
    assert not vocabularies[0] & vocabularies[1]

    def sources(samples: Samples) -> np.ndarray:
        found = []
        for sample in samples.tokens:
            tokens = set(sample.tolist()) - {tokenizer.eos}
            in_letters, in_digits = tokens <= vocabularies[0], tokens <= vocabularies[1]
            assert in_letters != in_digits
            found.append(0 if in_letters else 1)
        return np.array(found)

    blend = stream(
        [letters, digits],
        tmp_path / "cache",
        sequence_length=16,
        num_samples=400,
        weights=[3.0, 1.0],
    )
    samples = blend.read(0, 400)
    source = sources(samples)
    assert abs((source == 0).sum() - 300) <= 1
    assert all(
        abs((source[:n] == 0).sum() - 0.75 * n) <= 1 for n in range(1, 401)
    )  # at every prefix
    # Each dataset's samples, in order, are those of that dataset's own stream.
    for d, path in enumerate((letters, digits)):
        count = int((source == d).sum())
        alone = stream(path, tmp_path / "cache", sequence_length=16, num_samples=count).read(
            0, count
        )
        assert np.array_equal(samples.tokens[source == d], alone.tokens)

    # Without weights: in proportion to the token counts.
    tokens = [sum(map(len, read_dataset(p))) for p in (letters, digits)]
    source = sources(
        stream([letters, digits], tmp_path / "cache", sequence_length=16, num_samples=400).read(
            0, 400
        )
    )
    assert abs((source == 0).sum() - 400 * tokens[0] / sum(tokens)) <= 1


def foreign_copy(dataset: Path, directory: Path) -> Path:
    """The shards of `dataset` without its metadata.json, as a Megatron dataset made elsewhere."""
    directory.mkdir()
    for file in [*dataset.glob("*.bin"), *dataset.glob("*.idx")]:
        shutil.copy(file, directory / file.name)
    return directory


def flip_token(shard: Path, value: int, *, keep_stat: bool = False) -> int:
    """Sets the token in the middle of `shard` (a uint16 `.bin`) to `value`; returns its
    document. `keep_stat`: the file keeps its size and modification time, as a cache key sees
    it."""
    stat = shard.stat()
    tokens = np.fromfile(shard, dtype=np.uint16)
    position = len(tokens) // 2
    tokens[position] = value
    tokens.tofile(shard)
    if keep_stat:
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    index = TokenDataset(shard.with_suffix(""))
    return int(np.searchsorted(np.cumsum(index.document_lengths()), position, side="right"))


def test_token_ids_beyond_the_vocabulary_are_refused_naming_the_bin_and_document(
    dataset: Path, tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    foreign = foreign_copy(dataset, tmp_path / "foreign")
    vocab_size = tokenizer.reference.get_vocab_size()
    cache = tmp_path / "cache"
    stream(foreign, cache, sequence_length=32, num_samples=4, vocab_size=vocab_size)
    assert len(list(cache.glob("token_range_*.txt"))) == 1, "the scan is cached beside the index"
    (shard,) = foreign.glob("*.bin")
    document = flip_token(shard, vocab_size)
    with pytest.raises(ConfigError) as raised:
        stream(foreign, cache, sequence_length=32, num_samples=4, vocab_size=vocab_size)
    assert raised.value.path == "data.path[0]"
    assert (
        f"{shard}: document {document} holds token id {vocab_size}, outside 0..{vocab_size} "
        "(model.base_model.vocab_size)" in str(raised.value)
    )


def test_a_full_disk_while_caching_the_token_range_is_a_machine_error_naming_the_file(
    dataset: Path, tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    # The range's cache is written through `NAME.tmpPID`; that name, in a second cache
    # directory, is a link to /dev/full, whose every write fails as a full disk does. (It was
    # exit 2, bad input, naming data.path[0].)
    vocab_size = tokenizer.reference.get_vocab_size()
    first = tmp_path / "first"
    stream(dataset, first, sequence_length=32, num_samples=4, vocab_size=vocab_size)
    (cached,) = first.glob("token_range_*.txt")
    full = tmp_path / "full"
    full.mkdir()
    (full / f"{cached.name}.tmp{os.getpid()}").symlink_to("/dev/full")
    with pytest.raises(MachineError) as raised:
        stream(dataset, full, sequence_length=32, num_samples=4, vocab_size=vocab_size)
    assert str(raised.value) == (
        f"data.path[0]: {full / cached.name}: No space left on device (os error 28)"
    )


def test_a_flipped_token_id_fails_training_with_exit_2_whatever_metadata_json_says(
    dataset: Path, tmp_path: Path
) -> None:
    from tests.training.conftest import train_arguments

    damaged = tmp_path / "damaged"
    shutil.copytree(dataset, damaged)
    (shard,) = damaged.glob("*.bin")
    document = flip_token(shard, 60000)
    result = run_cli(
        *train_arguments(
            damaged, tmp_path / "run", "model.base_model.vocab_size=4096", "training.train_iters=2"
        )
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("fastllm: error: data.path[0]: ")
    assert f"{shard}: document {document} holds token id 60000, outside 0..4096" in result.stderr


def test_every_batch_is_checked_against_the_vocabulary_past_a_cached_range(
    dataset: Path, tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(dataset, damaged)
    cache, vocab_size = tmp_path / "cache", tokenizer.reference.get_vocab_size()
    epoch = TokenDataset(damaged).num_tokens // 32 + 1  # samples reading every token
    options = {"sequence_length": 32, "num_samples": epoch, "vocab_size": vocab_size}
    stream(damaged, cache, **options)
    (shard,) = damaged.glob("*.bin")
    # Changed in place behind the cached range's back (same size and time): the batch check
    # alone stands between the id and the embedding.
    document = flip_token(shard, 60000, keep_stat=True)
    samples = stream(damaged, cache, **options)
    with pytest.raises(ConfigError) as raised:
        samples.read(0, len(samples))
    assert raised.value.path == "data.path"
    assert f"{shard}: document {document} holds token id 60000" in str(raised.value)


def test_an_invalid_metadata_json_is_refused_naming_the_file(dataset: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(dataset, damaged)
    for text in ('{"shards": [', '["shard_00000"]', '{"shards": [{"tokens": 3}]}'):
        (damaged / "metadata.json").write_text(text)
        with pytest.raises(ConfigError) as raised:
            stream(damaged, tmp_path / "cache", sequence_length=32, num_samples=4)
        assert f"{damaged / 'metadata.json'}: invalid metadata" in str(raised.value)


def test_a_stop_asked_for_during_the_index_build_ends_it_within_its_first_tenth(
    dataset: Path, tmp_path: Path
) -> None:
    # 60M packed samples take seconds to index; the stop is asked for on the third look
    # (about 100 ms in) and must end the build long before it would have finished.
    looks = []
    started = time.monotonic()
    with pytest.raises(BuildStopped):
        stream(
            dataset, tmp_path / "cache", sequence_length=48, num_samples=60_000_000,
            stop=lambda: looks.append(time.monotonic()) or len(looks) >= 3,
        )  # fmt: skip
    assert time.monotonic() - looks[-1] < 0.1, "stopped at once"
    assert time.monotonic() - started < 1.0
    assert not list((tmp_path / "cache").glob("sampling_*")), "no index was cached"
    built = stream(dataset, tmp_path / "cache", sequence_length=48, num_samples=1000, stop=list)
    assert len(built) == 1000, "a build that was not stopped is whole"
