"""The arithmetic data source: a `data_source` component. Exercise k is drawn from the seed and
k alone, so its position is the number of exercises read."""

from __future__ import annotations

from typing import Any

import numpy as np
from tokenizers import Tokenizer

from fastllm.config import ConfigError
from fastllm.data.source import Document, SourceContext
from fastllm_example_plugin.config import ArithmeticSourceConfig


class ArithmeticSource:
    def __init__(self, config: ArithmeticSourceConfig, context: SourceContext) -> None:
        try:
            self.tokenizer = Tokenizer.from_file(config.tokenizer)
        except Exception as error:  # a missing or unreadable file, named by its key
            raise ConfigError("data.source.tokenizer", f"{config.tokenizer}: {error}") from None
        eos = self.tokenizer.token_to_id(config.end_of_document)
        if eos is None:
            raise ConfigError(
                "data.source.end_of_document",
                f"{config.end_of_document!r} is not a token of {config.tokenizer}",
            )
        self.config, self.seed, self.eos, self.read = config, context.seed, eos, 0

    def next_document(self) -> Document:
        a, b = np.random.default_rng([self.seed, self.read]).integers(
            0, self.config.max_operand + 1, size=2
        )
        self.read += 1
        question = self.tokenizer.encode(f"{a} + {b} =", add_special_tokens=False).ids
        answer = self.tokenizer.encode(f" {a + b}\n", add_special_tokens=False).ids
        return Document([*question, *answer, self.eos], [(0, len(question))])

    def state(self) -> dict[str, Any]:
        return {"read": self.read}

    def restore(self, state: dict[str, Any]) -> None:
        self.read = state["read"]
