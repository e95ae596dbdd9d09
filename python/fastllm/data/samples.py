"""The sample stream of a run: the configured datasets cut into samples, blended and (with FIM)
transformed, in a fixed order — sample i is the same whatever reads it, which makes data-parallel
splits and resumes exact."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastllm import _native
from fastllm.config import ConfigError, MachineError
from fastllm.config.bounds import INDEX_BYTES_PER_SAMPLE
from fastllm.config.data import DataConfig, FimConfig
from fastllm.data.dataset import TokenDataset
from fastllm.data.errors import BuildStopped
from fastllm.data.fim import FimSettings, fim_settings


@dataclass
class Samples:
    """`count` samples of `sample_length` tokens (the sequence plus the next token)."""

    tokens: np.ndarray  # (count, sample_length) int64
    document_ids: (
        np.ndarray
    )  # (count, sample_length) int32, index of the document within the sample
    loss_mask: np.ndarray  # (count, sample_length) uint8, 0 on padding and masked tokens
    parts: np.ndarray | None = None
    """Preference pairs only: (count, sample_length) int8, the part of its pair each token
    belongs to (PROMPT, CHOSEN, REJECTED, PADDING). A pair of P prompt, C chosen and R rejected
    tokens takes P + C + R + 1 positions: the prompt but its last token, that token then the
    chosen answer, that token again then the rejected answer; loss_mask is 1 on the answers'
    own tokens."""
    pair_ids: np.ndarray | None = None
    """Preference pairs only: (count, most pairs in a sample) int64, which pair of the stream
    (`SampleStream.sample_pairs`) each document of a sample is: document k of sample i is pair
    `pair_ids[i, k]`; -1 past a sample's last pair."""


PROMPT, CHOSEN, REJECTED, PADDING = 0, 1, 2, -1
"""The values of `Samples.parts` and `Batch.parts`."""


def check_index_fits(num_samples: int, key: str) -> None:
    """`MachineError` when the sampling index of `num_samples` cannot fit this machine's available
    memory: refused here in one line, not as an abort inside the Rust allocator."""
    need = num_samples * INDEX_BYTES_PER_SAMPLE
    available = available_memory()
    if available is not None and need > available:
        raise MachineError(
            f"{key}: the sampling index of {num_samples:,} samples needs about "
            f"{need / 2**30:,.1f} GiB, more than the {available / 2**30:,.1f} GiB of memory "
            "available (training.train_iters × batch.batch_size samples)"
        )


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux's MemAvailable); None elsewhere."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class SampleStream:
    def __init__(
        self,
        paths: list[str],
        config: DataConfig,
        *,
        sequence_length: int,
        num_samples: int,
        seed: int,
        cache_dir: str | Path,
        weights: list[float] | None = None,
        key: str = "data.path",
        vocab_size: int | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        """`vocab_size`: the model's; a dataset whose tokenizer has more tokens, or that holds a
        token id outside it, is refused (before sampling, and again in every batch read).
        `stop`: asked every 50 ms while the sampling indices are built (a minute and more for
        a long run's); once it returns true the build ends with `BuildStopped`."""
        if not paths:
            raise ConfigError(key, "no dataset given")
        check_index_fits(num_samples, key)
        datasets = []
        for i, path in enumerate(paths):
            try:
                datasets.append(TokenDataset(path))
            except (OSError, ValueError) as error:
                raise ConfigError(f"{key}[{i}]", str(error)) from None
            # The tokenizer its metadata names says why ids do not fit; the scan finds any id.
            tokens = datasets[-1].metadata.get("vocab_size")
            if vocab_size is not None and tokens is not None and tokens > vocab_size:
                raise ConfigError(
                    f"{key}[{i}]",
                    f"{path} holds token ids up to {tokens - 1} (a {tokens}-token tokenizer) but "
                    f"model.base_model.vocab_size is {vocab_size}",
                )
            try:
                if vocab_size is not None:
                    datasets[-1].check_token_range(vocab_size, cache_dir)
            except _native.TokenRangeError as error:
                raise ConfigError(f"{key}[{i}]", _beyond_vocabulary(error)) from None
            except OSError as error:  # caching the range: a full or read-only disk
                raise MachineError(f"{key}[{i}]: {error}") from None
            except ValueError as error:
                raise ConfigError(f"{key}[{i}]", str(error)) from None
        for i, dataset in enumerate(datasets):
            _check_loss_spans(dataset, f"{key}[{i}]")
            _check_preference_spans(dataset, f"{key}[{i}]")
            if config.fim and dataset.is_preference:
                raise ConfigError(
                    "data.fim",
                    f"{key}[{i}]: {dataset.path} holds preference pairs, whose answers FIM would "
                    "move; turn one of them off",
                )
            if config.fim and dataset.has_loss_spans:
                raise ConfigError(
                    "data.fim",
                    f"{key}[{i}]: {dataset.path} has loss-masking spans (a {dataset.metadata.get('format')} "
                    "dataset), which FIM would move; turn one of them off",
                )
        prefixes = [prefix for dataset in datasets for prefix in dataset.prefixes]
        shard_weights = _shard_weights(datasets, weights)
        self.fim = _fim_options(config.fim, datasets, key, vocab_size) if config.fim else None
        """FIM's resolved settings (`data.fim`), which a data source blended in shares."""
        self.datasets = datasets
        self.key = key
        try:  # a weight of 0 or an empty dataset in the blend, found while building the index
            self._source = _native.SampleSource(
                [str(p) for p in prefixes],
                sequence_length=sequence_length,
                num_samples=num_samples,
                seed=seed,
                truncate=config.sampling == "truncated",
                weights=shard_weights,
                cache_dir=str(cache_dir),
                threads=min(8, os.cpu_count() or 1),
                fim=None if self.fim is None else self.fim.options,
                tokenizer=None if self.fim is None else self.fim.tokenizer,
                vocab_size=vocab_size,
                stop=stop,
            )
        except _native.Cancelled:
            raise BuildStopped(key) from None
        except ValueError as error:
            raise ConfigError(key, str(error)) from None
        self.sample_length = self._source.sample_length
        self.skipped_samples = self._source.skipped_samples
        """Samples skipped for having no trained token (every label masked)."""
        self.is_preference = self._source.is_preference
        """The datasets hold preference pairs: samples have `parts`."""
        self.skipped_pairs = self._source.skipped_pairs
        """Preference pairs left out for being longer than the sequence (never cut)."""
        shards = [count for dataset in datasets for count in dataset.shard_documents]
        self._pair_offsets = np.cumsum([0, *shards])
        """Where each shard's pairs start in the stream's numbering (`pair_ids`)."""
        if os.environ.get("RANK", "0") == "0":
            if self.skipped_samples:
                print(
                    f"fastllm: {key}: {self.skipped_samples:,} sample(s) without a trained "
                    "token skipped",
                    flush=True,
                )
            if self.skipped_pairs:
                print(
                    f"fastllm: {key}: {self.skipped_pairs:,} preference pair(s) longer than the "
                    f"sequence ({sequence_length} tokens, a pair taking one more than it stores) "
                    "left out",
                    flush=True,
                )

    def __len__(self) -> int:
        return len(self._source)

    @property
    def num_pairs(self) -> int:
        """Pairs of its datasets (preference pairs), numbered 0 … num_pairs - 1 over the
        datasets in order, each dataset's in its own order: the pair ids of `sample_pairs`."""
        return int(self._pair_offsets[-1])

    def sample_pairs(self, sample: int) -> np.ndarray:
        """The pair ids of sample `sample` of preference pairs, by its document order."""
        shard, pairs = self._source.sample_pairs(sample)
        return np.asarray(pairs, dtype=np.int64) + self._pair_offsets[shard]

    def read(self, first: int, count: int) -> Samples:
        shape = (count, self.sample_length)
        tokens = np.empty(shape, dtype=np.int64)
        document_ids = np.empty(shape, dtype=np.int32)
        loss_mask = np.empty(shape, dtype=np.uint8)
        parts = np.empty(shape, dtype=np.int8) if self.is_preference else None
        try:  # a token outside the vocabulary (the range checked up front came from a cache)
            self._source.fill(
                first,
                tokens.reshape(-1),
                document_ids.reshape(-1),
                loss_mask.reshape(-1),
                None if parts is None else parts.reshape(-1),
            )
        except _native.TokenRangeError as error:
            raise ConfigError(self.key, _beyond_vocabulary(error)) from None
        pair_ids = None
        if self.is_preference:
            pairs = [self.sample_pairs(first + i) for i in range(count)]
            pair_ids = np.full((count, max(map(len, pairs), default=0)), -1, dtype=np.int64)
            for row, ids in zip(pair_ids, pairs, strict=True):
                row[: len(ids)] = ids
        return Samples(tokens, document_ids, loss_mask, parts, pair_ids)


def _beyond_vocabulary(error: _native.TokenRangeError) -> str:
    return f"{error} (model.base_model.vocab_size)"


def _check_loss_spans(dataset: TokenDataset, key: str) -> None:
    """A dataset prepared with loss-masking spans has them beside every shard: training
    without them would silently train on the prompts."""
    if not dataset.metadata.get("loss_masking_spans"):
        return
    for prefix, has_spans in zip(dataset.prefixes, dataset.shard_has_loss_spans, strict=True):
        if not has_spans:
            raise ConfigError(
                key,
                f"{prefix}.spans is missing: {dataset.path}/metadata.json says its shards have "
                "loss-masking spans",
            )


def _check_preference_spans(dataset: TokenDataset, key: str) -> None:
    """A dataset prepared from preference pairs has their spans beside every shard: without
    them its pairs would be read as plain text."""
    if dataset.metadata.get("format") != "preference":
        return
    for prefix, is_preference in zip(dataset.prefixes, dataset.shard_is_preference, strict=True):
        if not is_preference:
            raise ConfigError(
                key,
                f"{prefix}.preference is missing: {dataset.path}/metadata.json says its shards "
                "hold preference pairs",
            )


def _shard_weights(datasets: list[TokenDataset], weights: list[float] | None) -> list[float] | None:
    """Each dataset's weight spread over its shards by token count (None: all by token count)."""
    if weights is None:
        return None
    shard_weights = []
    for dataset, weight in zip(datasets, weights, strict=True):
        tokens = dataset.shard_tokens
        total = sum(tokens) or 1
        shard_weights += [weight * count / total for count in tokens]
    return shard_weights


def _fim_options(
    config: FimConfig, datasets: list[TokenDataset], key: str, vocab_size: int | None
) -> FimSettings:
    """FIM applies the first dataset's tokenizer to the whole blend: the others must have
    been made with the same one."""
    from tokenizers import Tokenizer

    dataset = datasets[0]
    tokenizer_file = dataset.path / "tokenizer.json"
    if not tokenizer_file.is_file():  # datasets keep a copy; else the file prepare read
        tokenizer_file = Path(dataset.metadata.get("tokenizer", {}).get("path", tokenizer_file))
    if not tokenizer_file.is_file():
        raise ConfigError(
            "data.fim", f"{dataset.path}: its tokenizer.json is needed for the FIM tokens"
        )
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    digest = dataset.metadata.get("tokenizer", {}).get("sha256")
    for i, other in enumerate(datasets):
        other_size = other.metadata.get("vocab_size")
        if other_size is not None and other_size > tokenizer.get_vocab_size():
            raise ConfigError(
                f"{key}[{i}]",
                f"{other.path} has a vocabulary of {other_size} tokens but the FIM tokenizer "
                f"{tokenizer_file} only {tokenizer.get_vocab_size()}",
            )
        other_digest = other.metadata.get("tokenizer", {}).get("sha256")
        if digest and other_digest and other_digest != digest:
            raise ConfigError(
                f"{key}[{i}]",
                f"{other.path} was made with another tokenizer than {dataset.path}; FIM "
                "needs one tokenizer for the whole blend",
            )
    eos = (dataset.metadata.get("eos_token") or {}).get("id")
    if eos is None:
        raise ConfigError(
            "data.fim", f"{dataset.path}/metadata.json records no end-of-document token"
        )
    return fim_settings(config, tokenizer_file, tokenizer, eos, vocab_size)
