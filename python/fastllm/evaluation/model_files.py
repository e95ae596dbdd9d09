"""What lm-eval reads from a model's directory besides the weights, as its `hf` backend reads
it: the tokenizer, the context length, the tokens that end a generation. Light to import
(`fastllm evaluate` checks its inputs before torch loads)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from fastllm.config import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(directory: Path, key: str, remedy: str) -> PreTrainedTokenizerBase:
    """The tokenizer of `directory` as lm-eval's hf backend loads it (AutoTokenizer); a
    `ConfigError` naming `key`, saying what to do (`remedy`) when it has no tokenizer files."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not directory.is_dir():
        raise ConfigError(key, f"{directory}: no such directory")
    if not any((directory / name).is_file() for name in names):
        raise ConfigError(
            key,
            f"{directory} has no tokenizer files ({', '.join(names)}): {remedy}",
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as error:
        raise ConfigError(key, f"{directory}: not a tokenizer ({error})") from None


def _hf_config(directory: Path) -> dict[str, Any]:
    """The Hugging Face config of the model: config.json, or the one a fastllm export keeps
    in metadata.json; empty when there is none."""
    for name, field in (("config.json", None), ("metadata.json", "hf_config")):
        path = directory / name
        if path.is_file():
            value = json.loads(path.read_text(encoding="utf-8"))
            value = value.get(field) if field else value
            if isinstance(value, dict):
                return value
    return {}


def context_length(directory: Path, tokenizer: PreTrainedTokenizerBase) -> int:
    """The context length lm-eval's hf backend would use: the config's, else the
    tokenizer's, else 2048."""
    from lm_eval.models.utils import resolve_max_length

    return resolve_max_length(SimpleNamespace(**_hf_config(directory)), tokenizer)


def generation_eos(directory: Path) -> list[int] | None:
    """The end-of-sequence tokens of generation_config.json (what `generate` stops at in the
    hf backend), if the directory has one."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return None
    eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    return None if eos is None else [eos] if isinstance(eos, int) else list(eos)
