"""Command-line overrides `a.b.c=value` and the merging of several config files."""

from __future__ import annotations

import re
from typing import Any

from fastllm.config.section import ConfigError
from fastllm.config.yaml_io import parse_yaml

Key = list[str | int]

_SEGMENT = re.compile(r"(?P<name>[A-Za-z_][\w-]*|\d+)(?P<indices>(?:\[\d+\])*)")


def parse_key(text: str) -> Key:
    """`a.b[2].c` or `a.b.2.c` → ["a", "b", 2, "c"]."""
    key: Key = []
    for segment in text.split("."):
        match = _SEGMENT.fullmatch(segment)
        if match is None:
            raise ConfigError(
                text, "is not a valid key (expected names separated by dots, e.g. a.b[0].c)"
            )
        name = match.group("name")
        key.append(int(name) if name.isdigit() else name)
        key.extend(int(index) for index in re.findall(r"\d+", match.group("indices")))
    return key


def format_key(key: Key) -> str:
    text = ""
    for part in key:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text


def apply_override(config: dict[str, Any], argument: str) -> None:
    """Set one `key=value` (value parsed as YAML) in a raw config mapping, in place."""
    text, sep, value_text = argument.partition("=")
    if not sep:
        raise ConfigError(argument, "an override must have the form key=value")
    key = parse_key(text.strip())
    value = parse_yaml(value_text, f"override {text.strip()}")
    node: Any = config
    for depth, part in enumerate(key):
        last = depth == len(key) - 1
        here = format_key(key[: depth + 1])
        if isinstance(part, int):
            if not isinstance(node, list):
                raise ConfigError(
                    format_key(key[:depth]), f"is not a list, cannot take index [{part}]"
                )
            if part > len(node):
                raise ConfigError(here, f"index out of range (the list has {len(node)} items)")
            if part == len(node):
                node.append(value if last else [] if isinstance(key[depth + 1], int) else {})
            elif last:
                node[part] = value
        else:
            if not isinstance(node, dict):
                raise ConfigError(
                    format_key(key[:depth]), f"is not a mapping, cannot take key {part!r}"
                )
            if last:
                node[part] = value
            elif not isinstance(node.get(part), dict | list):
                node[part] = [] if isinstance(key[depth + 1], int) else {}
        if not last:
            node = node[part]


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """`update` laid over `base`: mappings merge key by key, anything else is replaced."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged
