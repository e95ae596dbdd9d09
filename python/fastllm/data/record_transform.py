"""Prepare-time record transforms: a user function from a record (a dict) to the document
`prepare` tokenizes, a text, a conversation or a preference pair, applied on the fly."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from typing import Any, Literal

from fastllm.config import ConfigError

Kind = Literal["jsonl", "chat", "preference"]
"""What a transform returns, named as the records `prepare` reads: text, chat or preference."""

_KIND_NAMES: dict[Kind, str] = {
    "jsonl": "a text (str)",
    "chat": "a conversation (list of messages)",
    "preference": "a preference pair (dict)",
}

Transform = Callable[[dict[str, Any]], Any]


def load_transform(path: str) -> Transform:
    """The function `package.module:function` names; errors name the key `input.transform`."""
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise ConfigError(
            "input.transform", f"cannot import {module_name}: {type(error).__name__}: {error}"
        ) from error
    target: Any = module
    for part in attribute.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigError("input.transform", f"{module_name} has no {attribute}")
    if not callable(target):
        raise ConfigError("input.transform", f"{path} is not callable")
    return target


def kind_of(result: Any) -> Kind | None:
    """What a transform's result is, or None for a result that is no document."""
    if isinstance(result, str):
        return "jsonl"
    if isinstance(result, list):
        return "chat"
    if isinstance(result, dict):
        return "preference"
    return None


def apply(
    transform: Transform, record: dict[str, Any], location: str, kind: Kind | None
) -> tuple[Kind, str]:
    """The kind of document `transform` makes of `record` and the document as `prepare` reads a
    fed record (the text, or a JSON object of messages or of a pair), checked to be of `kind`
    (None: any). Errors name the record."""
    try:
        result = transform(record)
    except Exception as error:
        raise ConfigError(
            "input.transform", f"{location}: {type(error).__name__}: {error}"
        ) from error
    found = kind_of(result)
    if found is None:
        raise ConfigError(
            "input.transform",
            f"{location}: returned {type(result).__name__}; expected a text (str), a "
            "conversation (list of messages) or a preference pair (dict)",
        )
    if kind is not None and found != kind:
        raise ConfigError(
            "input.transform",
            f"{location}: returned {_KIND_NAMES[found]}, but the first record's result was "
            f"{_KIND_NAMES[kind]}; a dataset holds one kind",
        )
    if found == "jsonl":
        return found, result
    if found == "preference" and not {"chosen", "rejected"} <= result.keys():
        raise ConfigError(
            "input.transform",
            f"{location}: a preference pair needs the keys chosen and rejected (and optionally "
            f"prompt), got {sorted(result)}",
        )
    document = {"messages": result} if found == "chat" else result
    try:
        return found, json.dumps(document, ensure_ascii=False)
    except (TypeError, ValueError) as error:
        raise ConfigError(
            "input.transform", f"{location}: the result is not JSON data: {error}"
        ) from error
