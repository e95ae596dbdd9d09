"""`fastllm prepare` and `fastllm tokenizer train`: raw text in, token datasets out."""

from __future__ import annotations

from typing import Literal

import msgspec

from fastllm.config.section import ConfigError, Section, check_positive


class InputConfig(Section):
    path: list[str] = msgspec.field(default_factory=list)
    """Input files, directories or glob patterns, read in the order given (directories in
    sorted order)."""
    format: Literal["auto", "jsonl", "chat", "preference", "parquet", "text", "files"] = "auto"
    """jsonl (also .gz and .zst), chat (jsonl of conversations), preference (jsonl of preference
    pairs, see docs/preference-data.md), parquet, text (one document per file), files (a source
    tree: every matching file is a document); auto picks by extension, `preference` for jsonl
    whose first record has `chosen_text` and `rejected_text`, `chat` for jsonl whose first
    record has `messages_field` and not `field`, and `files` for directories."""
    field: str = "text"
    """Field holding the document text in jsonl records and parquet rows."""
    extensions: list[str] | None = None
    """For `files`: file extensions to keep, e.g. [.py, .rs] (default: every UTF-8 file)."""
    messages_field: str = "messages"
    """For chat: field holding the conversation, a list of {role, content} messages."""
    chat_template: str | None = None
    """For chat and preference: a Jinja template file to render conversations with (default:
    the tokenizer's chat_template.jinja or tokenizer_config.json `chat_template`)."""
    train_on: Literal["assistant", "last_assistant", "all"] = "assistant"
    """For chat: the tokens trained on; assistant: every assistant turn ({% generation %} blocks
    where the template has them), last_assistant: the last one, all: every token. The rest is
    masked from the loss."""
    loss_masking_spans: str | None = None
    """For jsonl text: field holding character spans [[begin, end], ...] (end included, as
    Fast-LLM's) excluded from the loss."""
    prompt_text: str = "prompt"
    """For preference: field holding the prompt, a string or a list of messages; a record
    without it holds two whole conversations (or texts) whose shared start is the prompt
    (TRL's implicit prompt)."""
    chosen_text: str = "chosen"
    """For preference: field holding the chosen answer, a string or a list of messages."""
    rejected_text: str = "rejected"
    """For preference: field holding the rejected answer, a string or a list of messages."""
    max_pair_tokens: int | None = None
    """For preference: a pair of more tokens (prompt and both answers) is a bad record (none:
    any length; training leaves out pairs longer than its sequence)."""

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("path", "at least one input is required")
        if self.loss_masking_spans is not None and self.format not in ("auto", "jsonl"):
            raise ConfigError(
                "loss_masking_spans",
                f"spans are read from jsonl text records, not with format: {self.format}"
                + (
                    " (a conversation's masks come from its template)"
                    if self.format == "chat"
                    else ""
                ),
            )
        check_positive(self.max_pair_tokens, "max_pair_tokens")
        if self.format not in ("auto", "chat", "preference") and self.chat_template is not None:
            raise ConfigError(
                "chat_template",
                f"applies to chat and preference inputs, not to format: {self.format}",
            )
        if self.format not in ("auto", "chat") and self.train_on != "assistant":
            raise ConfigError(
                "train_on",
                f"applies to chat inputs, not to format: {self.format}"
                + (" (a pair trains on both answers)" if self.format == "preference" else ""),
            )
        if self.format not in ("auto", "preference"):
            defaults = {
                "prompt_text": "prompt",
                "chosen_text": "chosen",
                "rejected_text": "rejected",
                "max_pair_tokens": None,
            }
            for key, default in defaults.items():
                if getattr(self, key) != default:
                    raise ConfigError(
                        key, f"applies to preference inputs, not to format: {self.format}"
                    )


class TokenizerConfig(Section):
    path: str = ""
    """tokenizer.json, or a Hugging Face tokenizer directory holding one."""
    eos_token: str | None = None
    """End-of-document token (default: the tokenizer's, e.g. <|endoftext|> or </s>)."""
    bos_token: str | None = None
    """Beginning-of-document token (default: the tokenizer's, if it has one)."""

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("path", "is required")


class OutputConfig(Section):
    path: str = ""
    """Directory to write the dataset to; it must not exist (see --overwrite)."""
    shard_size_tokens: int = 1_000_000_000
    """Tokens per shard file (the last shard holds the rest)."""

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("path", "is required")
        check_positive(self.shard_size_tokens, "shard_size_tokens")


class PrepareConfig(Section):
    input: InputConfig = msgspec.field(default_factory=InputConfig)
    """What to read."""
    tokenizer: TokenizerConfig = msgspec.field(default_factory=TokenizerConfig)
    """How to tokenize."""
    output: OutputConfig = msgspec.field(default_factory=OutputConfig)
    """Where to write."""
    workers: int | None = None
    """Tokenizer threads (default: every core)."""
    add_eos: bool = True
    """Append the end-of-document token to each text document and to each answer of a
    preference pair of strings (conversations are framed by their chat template)."""
    add_bos: bool = False
    """Prepend the beginning-of-document token to each text document and to the prompt of a
    preference pair of strings."""
    strict: bool = False
    """Fail on the first bad record instead of counting and skipping it."""

    def validate(self) -> None:
        check_positive(self.workers, "workers")


class TokenizerTrainingConfig(Section):
    input: InputConfig = msgspec.field(default_factory=InputConfig)
    """Text to learn the vocabulary from (same inputs as `fastllm prepare`)."""
    output: str = ""
    """Directory to write tokenizer.json (and tokenizer_config.json) to."""
    vocab_size: int = 8192
    """Size of the vocabulary, special tokens included."""
    special_tokens: list[str] = msgspec.field(
        default_factory=lambda: [
            "<|endoftext|>",
            "<fim_prefix>",
            "<fim_middle>",
            "<fim_suffix>",
            "<fim_pad>",
        ]
    )
    """Tokens never split; the first is the end-of-document token."""
    min_frequency: int = 2
    """Pairs seen fewer times are not merged."""
    max_documents: int | None = None
    """Train on at most this many documents (default: all)."""

    def validate(self) -> None:
        if not self.output:
            raise ConfigError("output", "is required")
        check_positive(self.vocab_size, "vocab_size")
        if self.vocab_size <= 256 + len(self.special_tokens):
            raise ConfigError(
                "vocab_size",
                f"must exceed the 256 byte tokens plus the special tokens, got {self.vocab_size}",
            )
        check_positive(self.max_documents, "max_documents")
