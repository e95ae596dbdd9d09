"""Reading config files and writing resolved configs, in YAML."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import yaml

from fastllm.config.section import ConfigError

MAX_DEPTH = 64
"""Nesting levels a config file may have (a real one has about 6): deeper input would exhaust
Python's recursion limit in the loader and the checks."""
MAX_NODES = 2**20
"""Values a config file may hold, each alias counted as the values it stands for: a few
aliases of aliases (a "billion laughs") would otherwise expand into more than memory holds."""


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader that reads `1e-4` as a float (YAML 1.1 wants `1.0e-4`), rejects duplicate
    keys instead of silently keeping the last one, and refuses input past `MAX_DEPTH` and
    `MAX_NODES`."""

    yaml_implicit_resolvers: ClassVar = {
        k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0
        self._expanded: dict[int, int] = {}
        """Values of each composed node with its aliases expanded, by id (nodes live as long
        as the document)."""

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        mark = self.peek_event().start_mark
        if self.check_event(yaml.AliasEvent):
            node = super().compose_node(parent, index)
            # An alias inside its own anchor (a cycle) counts one: the checks refuse it.
            self._count(self._expanded.get(id(node), 1), mark)
            return node
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested more than {MAX_DEPTH} levels deep", mark
            )
        before = self._nodes
        node = super().compose_node(parent, index)
        self._depth -= 1
        self._count(1, mark)
        self._expanded[id(node)] = self._nodes - before
        return node

    def _count(self, nodes: int, mark: yaml.Mark) -> None:
        self._nodes += nodes
        if self._nodes > MAX_NODES:
            raise yaml.composer.ComposerError(
                None, None, f"more than {MAX_NODES:,} values (aliases expanded)", mark
            )

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            mark = key_node.start_mark
            if not isinstance(key_node, yaml.ScalarNode):  # a list or mapping as a key
                raise yaml.constructor.ConstructorError(None, None, "a key must be a scalar", mark)
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str, source: str) -> Any:
    """Parse YAML text; errors name `source` with the line and column."""
    try:
        return yaml.load(text, Loader=_ConfigLoader)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        raise ConfigError(where, f"invalid YAML: {error.problem or error.context}") from None
    except yaml.reader.ReaderError as error:  # its text spans two lines
        raise ConfigError(
            source,
            f"invalid YAML: character #x{error.character:04x} at offset {error.position} "
            f"({error.reason})",
        ) from None
    except yaml.YAMLError as error:
        raise ConfigError(source, f"invalid YAML: {' '.join(str(error).split())}") from None


def load_yaml_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML config file (an empty file is an empty mapping)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(path), "no such config file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(str(path), f"cannot read config file: {error}") from None
    data = parse_yaml(text, str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            str(path), f"must hold a mapping of keys to values, not {type(data).__name__}"
        )
    return data


def dump_yaml(config: msgspec.Struct) -> str:
    """The config with every field, defaults included, in YAML that loads back to it."""
    return yaml.safe_dump(msgspec.to_builtins(config), sort_keys=False, allow_unicode=True)
