"""`fastllm tokenizer train`: a byte-level BPE (GPT-2 style, as StarCoder's) learned with
`tokenizers` from the same inputs `fastllm prepare` reads, through the Rust reader."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from fastllm import _native
from fastllm.config import ConfigError
from fastllm.config.prepare import TokenizerTrainingConfig


def _documents(config: TokenizerTrainingConfig, bad: list[str]) -> Iterator[str]:
    reader = _native.DocumentReader(
        paths=config.input.path,
        format=config.input.format,
        field=config.input.field,
        extensions=config.input.extensions,
    )
    count = 0
    while (batch := reader.next_batch(4 << 20)) is not None:
        documents, bad_records = batch
        bad += bad_records
        for document in documents:
            if config.max_documents is not None and count >= config.max_documents:
                return
            count += 1
            yield document


def train_tokenizer(config: TokenizerTrainingConfig) -> tuple[Path, int]:
    """Write OUTPUT/tokenizer.json and tokenizer_config.json; returns the directory and the
    number of bad records skipped."""
    output = Path(config.output)
    if output.exists():
        raise ConfigError("output", f"{output} already exists")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        special_tokens=config.special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bad: list[str] = []
    try:
        tokenizer.train_from_iterator(_documents(config, bad), trainer)
    except ValueError as error:
        raise ConfigError("input.path", str(error)) from None
    partial = output.with_name(f".{output.name}.partial-{os.getpid()}")
    try:
        partial.mkdir(parents=True)
        tokenizer.save(str(partial / "tokenizer.json"))
        settings = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": config.special_tokens[0] if config.special_tokens else None,
            "additional_special_tokens": config.special_tokens[1:],
            "clean_up_tokenization_spaces": False,
        }
        (partial / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
        os.replace(partial, output)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return output, len(bad)
