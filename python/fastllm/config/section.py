"""The base of every config section, and the error every config check raises."""

from __future__ import annotations

import msgspec


class ConfigError(ValueError):
    """A config value is wrong. `path` is the full dotted key (`model.base_model.vocab_size`),
    or a file location (`run.yaml:12:3`) for a file that could not be read."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
        self.message = message


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A config section: typed fields, unknown keys rejected. A class attribute
    `aliases: ClassVar[dict[str, str]]` maps accepted synonyms to field names.

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
