"""Fill-in-the-middle settings resolved against a tokenizer (the sentinels' ids, the
end-of-document id, the tokenizer's size against the model's), for the prepared datasets'
sampler and for data sources, which both transform samples with fastllm-data's `Fim`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fastllm import _native
from fastllm.config import ConfigError
from fastllm.config.data import FimConfig

if TYPE_CHECKING:
    from tokenizers import Tokenizer

DEFAULT_EOS = "<|endoftext|>"
"""`data.fim.eos_token` when not set: StarCoder's, as the sentinels' defaults are."""

SOURCE_FIM_SALT = 0x5017CEF1
"""Mixed into the seed of a source's FIM draws: another stream than the prepared datasets'
of the same run, whose samples are numbered from 0 too."""


@dataclass(frozen=True)
class FimSettings:
    """FIM with its tokens resolved: the options, and the tokenizer.json that character
    splits decode and re-encode with (None for token splits)."""

    options: _native.FimOptions
    tokenizer: str | None


def fim_settings(
    config: FimConfig, tokenizer_file: Path, tokenizer: Tokenizer, eos: int, vocab_size: int | None
) -> FimSettings:
    """The sentinels of `config` looked up in `tokenizer` (read from `tokenizer_file`). The ids
    FIM inserts (its special tokens, and with character splits any token of the tokenizer)
    must fit the model's `vocab_size`: the batches' range check covers the ids copied from
    documents only."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab_size is not None and size > vocab_size:
        raise ConfigError(
            "data.fim",
            f"the FIM tokenizer {tokenizer_file} has {size} tokens but "
            f"model.base_model.vocab_size is {vocab_size}",
        )

    def token(key: str) -> int:
        name = getattr(config, key)
        token_id = tokenizer.token_to_id(name)
        if token_id is None:
            raise ConfigError(f"data.fim.{key}", f"{name!r} is not a token of {tokenizer_file}")
        return int(token_id)

    options = _native.FimOptions(
        rate=config.rate,
        spm_rate=config.spm_rate,
        max_middle_len=config.max_middle_len,
        split=config.split,
        prefix=token("prefix_token"),
        middle=token("middle_token"),
        suffix=token("suffix_token"),
        pad=token("pad_token"),
        eos=eos,
    )
    return FimSettings(options, str(tokenizer_file) if config.split == "character" else None)


def tokenizer_fim(config: FimConfig, vocab_size: int | None) -> FimSettings:
    """FIM with the tokenizer `data.fim.tokenizer` names and its `eos_token` (a source without
    `data.path`)."""
    from tokenizers import Tokenizer

    assert config.tokenizer is not None
    path = Path(config.tokenizer)
    if not path.is_file():
        raise ConfigError("data.fim.tokenizer", f"{path}: no such file")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception on a bad file
        raise ConfigError("data.fim.tokenizer", f"{path}: not a tokenizer.json ({error})") from None
    eos_name = config.eos_token or DEFAULT_EOS
    eos = tokenizer.token_to_id(eos_name)
    if eos is None:
        raise ConfigError("data.fim.eos_token", f"{eos_name!r} is not a token of {path}")
    return fim_settings(config, path, tokenizer, int(eos), vocab_size)


def source_fim(settings: FimSettings, seed: int) -> _native.Fim:
    """The FIM transform of a data source's samples: sample k of the source gets the draws of
    (`seed` salted, k), whichever run reads it, and other draws than sample k of the prepared
    datasets blended with it."""
    return _native.Fim(settings.options, seed=seed ^ SOURCE_FIM_SALT, tokenizer=settings.tokenizer)
