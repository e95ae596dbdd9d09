"""The base of every config section, the error every config check raises, and the error of a
machine that cannot do what a valid input asks (the command line's exit codes 2 and 1)."""

from __future__ import annotations

import msgspec


class ConfigError(ValueError):
    """A config value is wrong. `path` is the full dotted key (`model.base_model.vocab_size`),
    or a file location (`run.yaml:12:3`) for a file that could not be read."""

    def __init__(self, path: str, message: str) -> None:
        # A key or a message can quote input of any size (a fuzzed key, an expanded alias):
        # the error stays a readable line.
        path, message = _cut(path, 200), _cut(message, 2000)
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
        self.message = message


class MachineError(Exception):
    """The input is valid but this machine cannot do what it asks: a file it cannot write (disk
    full, read-only), memory it does not have."""


def brief(value: object, limit: int = 200) -> str:
    """`repr(value)`, cut to `limit` characters: an error quotes the value, not all of it."""
    return _cut(repr(value), limit)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A config section: typed fields, unknown keys rejected. A class attribute
    `aliases: ClassVar[dict[str, str]]` maps accepted synonyms to field names, and
    `moved: ClassVar[dict[str, str]]` says where each of its former keys went (the error of
    such a key says it: "unknown key: it {moved[key]}").

    `validate()` checks fields against each other and fills defaults that derive from other
    fields. It runs after the section's children were validated and raises
    `ConfigError(key, message)` with a key relative to the section; the loader adds the path.
    """

    def validate(self) -> None:
        """Cross-field checks; the default has none."""


def check_positive(value: int | float | None, key: str) -> None:
    if value is not None and not value > 0:
        raise ConfigError(key, f"must be positive, got {value!r}")


def check_non_negative(value: int | float | None, key: str) -> None:
    if value is not None and not value >= 0:
        raise ConfigError(key, f"must be non-negative, got {value!r}")
