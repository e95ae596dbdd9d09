"""`data`: the token datasets a run trains on, how samples are cut, blended and transformed."""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from fastllm.config.registry import Component
from fastllm.config.section import ConfigError, Section, check_non_negative, check_positive


class FimConfig(Section):
    rate: float = 0.5
    """Share of documents turned into fill-in-the-middle examples."""
    spm_rate: float = 0.5
    """Share of those in suffix-prefix-middle order (the rest: prefix-suffix-middle)."""
    max_middle_len: int | None = None
    """Longest middle part (characters, or tokens with split: token); none: unbounded."""
    split: Literal["character", "token"] = "character"
    """Where split points fall: between characters (detokenize, split, retokenize, as StarCoder)
    or between tokens (exact, no tokenizer needed)."""
    prefix_token: str = "<fim_prefix>"
    """Token before the prefix."""
    middle_token: str = "<fim_middle>"
    """Token before the middle."""
    suffix_token: str = "<fim_suffix>"
    """Token before the suffix."""
    pad_token: str = "<fim_pad>"
    """Token that pads a sample shortened by the transformation."""
    tokenizer: str | None = None
    """tokenizer.json holding the four tokens (and, with split: character, the text's tokens)
    for a run on `data.source` without `data.path`; required there. With `data.path` FIM
    reads the first dataset's tokenizer, and this key is refused."""
    eos_token: str | None = None
    """End-of-document token of `tokenizer` (default `<|endoftext|>`); with `data.path` the
    first dataset's, recorded by `prepare`, and this key is refused."""

    def validate(self) -> None:
        for key in ("rate", "spm_rate"):
            if not 0 <= getattr(self, key) <= 1:
                raise ConfigError(key, f"must be between 0 and 1, got {getattr(self, key)}")
        check_positive(self.max_middle_len, "max_middle_len")


class DatasetConfig(Section):
    """A named dataset of `data.datasets`."""

    path: list[str] = msgspec.field(default_factory=list)
    """Prepared datasets (directories written by `fastllm prepare`), blended by their token
    counts."""

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("path", "no dataset given")


class DataSourceConfig(Component, kw_only=True):
    """A Python data source (`data.source`): documents yielded by code of another package,
    packed into samples by fastllm. Its `implementation` is a class taking
    `(config, context: fastllm.data.source.SourceContext)` that follows
    `fastllm.data.source.DataSource` (docs/extending.md)."""

    point = "data_source"

    share: float = 1.0
    """Share of the training samples drawn from the source when `data.path` also gives
    prepared datasets (each sample drawn from the run's seed; the rest from the prepared
    datasets, blended among themselves by `data.weights`); 1 without `data.path`."""

    def validate(self) -> None:
        if not 0.0 < self.share <= 1.0:
            raise ConfigError("share", f"must be in (0, 1], got {self.share}")


class DataConfig(Section):
    path: list[str] = msgspec.field(default_factory=list)
    """Prepared datasets (directories written by `fastllm prepare`)."""
    weights: list[float] | None = None
    """Share of each dataset in the blend; default proportional to their token counts."""
    sampling: Literal["packed", "truncated"] = "packed"
    """packed: documents concatenated across sample boundaries (no token wasted); truncated:
    one document per sample, cut or padded."""
    fim: FimConfig | None = None
    """Fill-in-the-middle transformation of documents (none: off)."""
    validation_path: list[str] = msgspec.field(default_factory=list)
    """Held-out datasets for the validation loss (`training.validation`)."""
    datasets: dict[str, DatasetConfig] = msgspec.field(default_factory=dict)
    """Named held-out datasets, which `training.evaluators` read by name:
    `datasets: {wiki: {path: [DIR]}}`."""
    source: DataSourceConfig | None = None
    """A Python data source to train on instead of `data.path`, chosen by its `type` (a
    component of another package: docs/extending.md); none: the prepared datasets."""
    cache_dir: str | None = None
    """Where sampling indices are cached; default EXPERIMENT_DIR/cache/sampling."""
    prefetch: int = 4
    """Batches prepared ahead of the training step by the loader's background thread."""

    def validate(self) -> None:
        check_non_negative(self.prefetch, "prefetch")
        if self.source is not None:
            self._check_source()
        if self.fim is not None:
            self._check_fim_tokenizer()
        if self.weights is None:
            return
        if len(self.weights) != len(self.path):
            raise ConfigError(
                "weights", f"has {len(self.weights)} entries but path has {len(self.path)}"
            )
        for i, weight in enumerate(self.weights):
            if not (math.isfinite(weight) and weight > 0):
                raise ConfigError(f"weights[{i}]", f"must be finite and positive, got {weight}")

    def _check_source(self) -> None:
        """How the source's share fits `data.path` (phases, the remaining refusal of a
        source, are refused by `training.phases`)."""
        assert self.source is not None
        share = self.source.share
        if self.path and share == 1.0:
            raise ConfigError(
                "source.share", "is 1: the prepared datasets of data.path would never be read"
            )
        if not self.path and share != 1.0:
            raise ConfigError("source.share", f"is {share}, and data.path gives no other data")

    def _check_fim_tokenizer(self) -> None:
        """FIM's tokenizer: `fim.tokenizer` on a source alone, which has no dataset to take it
        from; else the first dataset's."""
        assert self.fim is not None
        if self.source is not None and not self.path:
            if self.fim.tokenizer is None:
                raise ConfigError(
                    "fim.tokenizer",
                    "is required for FIM on a data.source without data.path: the tokenizer.json "
                    "of the FIM tokens",
                )
            return
        for key in ("tokenizer", "eos_token"):
            if getattr(self.fim, key) is not None:
                raise ConfigError(
                    f"fim.{key}",
                    "is for a data.source without data.path; FIM reads the tokenizer of "
                    "data.path[0] otherwise",
                )
