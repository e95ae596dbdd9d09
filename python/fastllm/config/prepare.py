"""`fastllm prepare` and `fastllm tokenizer train`: raw text in, token datasets out."""

from __future__ import annotations

import re
from typing import ClassVar, Literal

import msgspec

from fastllm.config.section import ConfigError, Section, brief, check_positive


class RecordsConfig(Section, tag_field="type"):
    """Where a record holds its text, conversation or preference pair: the keys every input
    type shares."""

    # The formats whose records are text (where loss-masking spans apply).
    text_formats: ClassVar[tuple[str, ...]] = ()
    format: str = "auto"
    field: str = "text"
    """Field holding the document text in records (a JSON key, a Parquet or dataset column)."""
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
    """For text records: field holding character spans [[begin, end], ...] (end included, as
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
    transform: str | None = None
    """A Python function `package.module:function` (importable where prepare runs) applied to
    every record (a dict) before tokenization; it returns the document: a text (str), a
    conversation (a list of {role, content} messages) or a preference pair (a dict with
    `chosen`, `rejected` and optionally `prompt`). The first record's result sets the kind;
    the record fields above are then not read."""

    def validate(self) -> None:
        if self.transform is not None:
            self._validate_transform()
        if self.loss_masking_spans is not None and self.format not in self.text_formats:
            raise ConfigError(
                "loss_masking_spans",
                f"spans are read from text records, not with format: {self.format}"
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

    def _validate_transform(self) -> None:
        assert self.transform is not None
        if not _IMPORT_PATH.fullmatch(self.transform):
            raise ConfigError(
                "transform",
                f"expected an import path package.module:function, got {brief(self.transform)}",
            )
        read_fields = {
            "field": "text",
            "messages_field": "messages",
            "loss_masking_spans": None,
            "prompt_text": "prompt",
            "chosen_text": "chosen",
            "rejected_text": "rejected",
        }
        for key, default in read_fields.items():
            if getattr(self, key) != default:
                raise ConfigError(
                    key,
                    "is not read with a transform: the transform's result is the document "
                    "(set it in the transform)",
                )


_IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


class InputConfig(RecordsConfig, tag="files"):
    """Local files: JSON lines, Parquet, text files or source trees."""

    text_formats: ClassVar[tuple[str, ...]] = ("auto", "jsonl")
    path: list[str] = msgspec.field(default_factory=list)
    """Input files, directories or glob patterns, read in the order given (directories in
    sorted order)."""
    format: Literal["auto", "jsonl", "chat", "preference", "parquet", "text", "files"] = "auto"
    """jsonl (also .gz and .zst), chat (jsonl of conversations), preference (jsonl of preference
    pairs, see docs/preference-data.md), parquet, text (one document per file), files (a source
    tree: every matching file is a document); auto picks by extension, `preference` for jsonl
    whose first record has `chosen_text` and `rejected_text`, `chat` for jsonl whose first
    record has `messages_field` and not `field`, and `files` for directories. With a
    `transform`, the records it receives are a JSON object per line, a row per Parquet row, and
    {text, path} per text file."""
    extensions: list[str] | None = None
    """For `files`: file extensions to keep, e.g. [.py, .rs] (default: every UTF-8 file)."""

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("path", "at least one input is required")
        super().validate()


class HuggingfaceInputConfig(RecordsConfig, tag="huggingface"):
    """A Hugging Face dataset: a directory written by `save_to_disk`, or what `load_dataset`
    reads from local files or its cache (no download: prepare reads what is on this machine).
    Read a batch of rows at a time, never whole."""

    text_formats: ClassVar[tuple[str, ...]] = ("auto", "text")
    path: str = ""
    """A `save_to_disk` directory, or `load_dataset`'s path: a packaged builder (json, parquet,
    csv, arrow, text) with `data_files`, a directory of data files, or the name of a dataset
    already in the local cache."""
    format: Literal["auto", "text", "chat", "preference"] = "auto"
    """What the rows hold: text (column `field`), chat (column `messages_field`) or preference
    (columns `prompt_text`, `chosen_text`, `rejected_text`); auto: preference when the chosen
    and rejected columns exist, chat when the messages column exists and the text column does
    not, else text."""
    config_name: str | None = None
    """load_dataset's `name`: the dataset's configuration."""
    data_directory: str | None = None
    """load_dataset's `data_dir`."""
    data_files: list[str] | None = None
    """load_dataset's `data_files`: files or glob patterns."""
    split: str = "train"
    """The split to read (a dataset saved without splits is read whole)."""
    streaming: bool = True
    """Let load_dataset read the files as they are; false: it first converts them into its
    Arrow cache (a copy on disk, memory-mapped), which a dataset already prepared in the cache
    reuses. Not used for a `save_to_disk` directory, which is memory-mapped."""

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("path", "is required")
        super().validate()


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
    input: InputConfig | HuggingfaceInputConfig = msgspec.field(default_factory=InputConfig)
    """What to read: `type: files` (the default) or `type: huggingface`."""
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
        if self.input.transform is not None:
            raise ConfigError("input.transform", "applies to `fastllm prepare`, not here")
        check_positive(self.vocab_size, "vocab_size")
        if self.vocab_size <= 256 + len(self.special_tokens):
            raise ConfigError(
                "vocab_size",
                f"must exceed the 256 byte tokens plus the special tokens, got {self.vocab_size}",
            )
        check_positive(self.max_documents, "max_documents")
