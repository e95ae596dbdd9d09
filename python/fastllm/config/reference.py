"""The generated pages of the documentation that the config package knows: the configuration
reference (from the Structs and their field docs) and the table of settings that do not compose
(from `layout.COMPATIBILITY`), so that neither can drift from the code.
`python -m fastllm.config.reference [DIRECTORY]` rewrites them (`make reference`; default
docs/reference); tests fail when a committed page is stale."""

from __future__ import annotations

import ast
import functools
import inspect
import itertools
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

import msgspec

from fastllm.config.layout import COMPATIBILITY, Condition, Incompatibility
from fastllm.config.section import Section
from fastllm.config.trainer import TrainerConfig

DIRECTORY = Path("docs/reference")
"""Where `make reference` writes the generated pages, from the repository root."""


@functools.cache
def _own_field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under the fields of one class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for statement, following in itertools.pairwise(body):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def field_docs(cls: type) -> dict[str, str]:
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if isinstance(base, type) and issubclass(base, Section) and base is not Section:
            docs.update(_own_field_docs(base))
    return docs


def _variants(tp: Any) -> list[Any]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(tp) if a is not type(None)]
    return [tp]


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is typing.Literal:
        return " or ".join(f"`{a}`" for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) is dict:
        return f"{_type_name(typing.get_args(tp)[1])} by name"
    if _is_struct(tp):
        return "section"
    return getattr(tp, "__name__", str(tp))


def _default_text(field: msgspec.structs.FieldInfo) -> str:
    if field.default is not msgspec.NODEFAULT:
        value = field.default
    elif field.default_factory is not msgspec.NODEFAULT:
        value = field.default_factory()
        if isinstance(value, msgspec.Struct):
            tag = value.__struct_config__.tag
            return f"type `{tag}`" if tag else "(section)"
    else:
        return "required"
    if value is None:
        return "`null`"
    if value == "":
        return '`""`'
    return f"`{str(value).lower() if isinstance(value, bool) else value}`"


def _section(cls: type[msgspec.Struct], key: str, lines: list[str], tag: str | None = None) -> None:
    docs = field_docs(cls)
    heading = f"## `{key}`" + (f" with `type: {tag}`" if tag else "")
    lines += ["", heading, ""]
    if tag and cls.__doc__ and cls.__doc__ is not Section.__doc__:
        lines += [" ".join(cls.__doc__.split()), ""]
    fields = msgspec.structs.fields(cls)
    nested: list[tuple[str, Any, msgspec.structs.FieldInfo]] = []
    if fields:
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
    for field in fields:
        by_name = typing.get_origin(field.type) is dict  # its sections are documented at NAME
        listed = typing.get_origin(field.type) is list  # its sections, at [N]
        variants = _variants(
            typing.get_args(field.type)[1 if by_name else 0] if by_name or listed else field.type
        )
        structs = [v for v in variants if _is_struct(v)]
        if structs and len(structs) > 1 and not by_name:
            kind = "`type:` " + " or ".join(f"`{v.__struct_config__.tag}`" for v in structs)
        else:
            kind = _type_name(field.type)
        doc = docs.get(field.encode_name, "").replace("|", "\\|")
        lines.append(
            f"| `{field.encode_name}` | {kind.replace('|', '/')} | {_default_text(field)} | {doc} |"
        )
        if structs:
            child = f"{key}.{field.encode_name}" + (".NAME" if by_name else "[N]" if listed else "")
            nested.append((child, structs, field))
    for child_key, structs, _ in nested:
        if len(structs) == 1:
            _section(structs[0], child_key, lines)
        else:
            for variant in structs:
                _section(variant, child_key, lines, tag=variant.__struct_config__.tag)


def reference(root: type[msgspec.Struct] = TrainerConfig) -> str:
    """The markdown reference of every key under `root`."""
    lines: list[str] = []
    for field in msgspec.structs.fields(root):
        by_name = typing.get_origin(field.type) is dict  # sections by name, at NAME
        inner = typing.get_args(field.type)[1] if by_name else field.type
        (struct,) = [v for v in _variants(inner) if _is_struct(v)]
        _section(struct, field.encode_name + (".NAME" if by_name else ""), lines)
    return "\n".join(lines).strip() + "\n"


def generated_notice(command: str) -> str:
    """The comment that opens a generated page: what writes it."""
    return f"<!-- generated by `make reference` ({command}): edit the code, not this page -->"


CONFIG_INTRO = """\
# Configuration reference

{notice}

A run is described by one YAML file whose sections are the headings below (`model.distributed`
is the `distributed` section inside `model`). Several files merge in order, later ones win, and
any key can be overridden on the command line as `KEY=VALUE` with the value parsed as YAML
(`fastllm config show -c FILE training.train_iters=10` prints the result with every default).
A section with variants is chosen with `type:`, for example
`normalization: {{type: layer_norm}}`; a variant has its own table. Unknown keys, wrong types and
values that do not fit together are refused before any work starts, naming the key (exit code
2).

This page is generated by `make reference` from the documentation of each field in
`python/fastllm/config/`; a test fails when it is out of date.
"""


def config_page() -> str:
    """The configuration reference page: every key of `TrainerConfig`."""
    notice = generated_notice("python -m fastllm.config.reference")
    return CONFIG_INTRO.format(notice=notice) + "\n" + reference(TrainerConfig)


COMPATIBILITY_INTRO = """\
# Settings that do not compose yet

{notice}

Each row is a pair of settings that fastllm refuses together, and why (a key alone means
the switch is on, or the count above 0). The table is
`COMPATIBILITY` in `python/fastllm/config/layout.py`, the one place the check reads: loading a
training config (every command that reads one, `fastllm train` included) raises an error naming
the first key of the first row that holds and the value of both keys, and the command exits
with code 2. A row is removed when the combination is implemented. This page is generated by
`make reference` from that table; a test fails when it is out of date.
"""

# The table, between these lines, is what other pages include (pymdownx.snippets sections).
TABLE_START = "<!-- --8<-- [start:table] -->"
TABLE_END = "<!-- --8<-- [end:table] -->"


def compatibility_table(rows: tuple[Incompatibility, ...] = COMPATIBILITY) -> str:
    """The rows of `COMPATIBILITY` as a markdown table."""
    lines = ["| setting | is refused with | because |", "|---|---|---|"]
    for row in rows:
        cells = (_condition(row.setting), _condition(row.other), row.reason)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _condition(condition: Condition) -> str:
    """`key` and what it is compared with: `schedule.micro_batch_splits` > 1."""
    assert condition.text.startswith(condition.key), condition
    return f"`{condition.key}`{condition.text[len(condition.key) :]}"


def compatibility_page() -> str:
    notice = generated_notice("python -m fastllm.config.reference")
    intro = COMPATIBILITY_INTRO.format(notice=notice)
    return f"{intro}\n{TABLE_START}\n{compatibility_table()}{TABLE_END}\n"


PAGES = {"config.md": config_page, "compatibility.md": compatibility_page}
"""The pages this module generates, by file name under `DIRECTORY`."""


def write(path: Path, text: str) -> bool:
    """Write `text` to `path` unless it holds it already; true when the file changed."""
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return True


def main(directory: Path, pages: dict[str, Any]) -> None:
    """Write each of `pages` (file name → function giving its text) into `directory`."""
    for name, page in pages.items():
        path = directory / name
        print(f"{path}: {'updated' if write(path, page()) else 'up to date'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DIRECTORY, PAGES)
