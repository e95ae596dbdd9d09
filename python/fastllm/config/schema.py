"""Turning a raw mapping into a typed, checked config.

Three passes, so every error names the full key path: a walk over the raw mapping along the
Struct types (unknown keys with the nearest valid key, union variants by their `type`, choices),
msgspec's conversion (types), then each section's `validate()` (fields against each other).
"""

from __future__ import annotations

import difflib
import math
import re
import types
import typing
from typing import Any, TypeVar

import msgspec

from fastllm.config import registry
from fastllm.config.overrides import format_key, parse_key
from fastllm.config.section import ConfigError, Section, brief

S = TypeVar("S", bound=Section)


def build(cls: type[S], raw: dict[str, Any]) -> S:
    """The config of type `cls` described by `raw`, checked and with derived defaults filled."""
    config = _convert(cls, _check(cls, raw, []), [])
    _validate(config, [])
    return config


class _Built:
    """A component's config, converted where `_check` met it: msgspec cannot convert a field
    typed as an extension point's base class into the subclass that `type` names, so the
    fields holding components are left out of the conversion of their parent and set after."""

    def __init__(self, config: msgspec.Struct) -> None:
        self.config = config


def _convert(cls: type[S], checked: Any, key: list[str | int]) -> S:
    """`checked` (what `_check` returned for `cls` at `key`) converted to a `cls`."""
    built: list[tuple[list[str | int], msgspec.Struct]] = []
    plain = _take_built(checked, [], built)
    try:
        config = msgspec.convert(plain, cls)
    except msgspec.ValidationError as error:
        raise _explain(error, plain, key) from None
    for path, component in built:
        parent: Any = config
        for part in path[:-1]:
            parent = parent[part] if isinstance(parent, dict | list) else getattr(parent, str(part))
        if isinstance(parent, dict | list):
            parent[path[-1]] = component
        else:
            setattr(parent, str(path[-1]), component)
    return config


def _take_built(value: Any, path: list[str | int], built: list[Any]) -> Any:
    """`value` without its `_Built` items, each added to `built` with its path."""
    if isinstance(value, dict):
        kept = {}
        for name, item in value.items():
            if isinstance(item, _Built):
                built.append(([*path, name], item.config))
            else:
                kept[name] = _take_built(item, [*path, name], built)
        return kept
    if isinstance(value, list):
        if any(isinstance(item, _Built) for item in value):
            raise TypeError(f"{format_key(path)}: a list of components is not supported")
        return [_take_built(item, [*path, i], built) for i, item in enumerate(value)]
    return value


def _suggest(word: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _union_variants(tp: Any) -> list[Any]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [arg for arg in typing.get_args(tp) if arg is not type(None)]
    return [tp]


def _tag(cls: Any) -> str | None:
    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        return cls.__struct_config__.tag
    return None


def _check(tp: Any, value: Any, key: list[str | int], default: Any = None) -> Any:
    """`value` with union tags filled in; raises on unknown keys, tags, choices and numbers
    out of range."""
    if value is None:
        return value
    _check_number(value, key)
    variants = _union_variants(tp)
    points = [v for v in variants if registry.is_point(v)]
    if points and isinstance(value, dict):
        return _check_component(points[0], value, key, default)
    tagged = [v for v in variants if _tag(v) is not None]
    if tagged and isinstance(value, dict):
        return _check_variant(tagged, value, key, default)
    literals = [
        a for v in variants if typing.get_origin(v) is typing.Literal for a in typing.get_args(v)
    ]
    if literals and isinstance(value, str) and str not in variants:
        if value not in literals:
            choices = ", ".join(str(c) for c in literals)
            raise ConfigError(
                format_key(key),
                f"invalid value {brief(value)}; expected one of {choices}"
                + _suggest(value, [c for c in literals if isinstance(c, str)]),
            )
        return value
    for variant in variants:
        if (
            isinstance(variant, type)
            and issubclass(variant, msgspec.Struct)
            and isinstance(value, dict)
        ):
            return _check_struct(variant, value, key)
        if typing.get_origin(variant) is list:
            (item,) = typing.get_args(variant)
            if isinstance(value, str | int | float) and item in (str, int, float):
                value = [value]  # `path: /data/x` is a list of one
            if isinstance(value, list):
                return [_check(item, v, [*key, i]) for i, v in enumerate(value)]
        if typing.get_origin(variant) is dict and isinstance(value, dict):
            _, item = typing.get_args(variant)
            for name in value:
                if not isinstance(name, str):
                    raise ConfigError(format_key([*key, str(name)]), "a name must be a string")
            return {name: _check(item, v, [*key, name]) for name, v in value.items()}
    return value


_INT64 = range(-(2**63), 2**63)


def _check_number(value: Any, key: list[str | int]) -> None:
    """No config value is infinite or NaN (a checkpoint's manifest could not hold it, and no
    setting means it), and integers fit in 64 bits (what Rust, torch and numpy take)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(format_key(key), f"must be a finite number, got {value}")
    if isinstance(value, int) and not isinstance(value, bool) and value not in _INT64:
        raise ConfigError(format_key(key), f"must fit in a signed 64-bit integer, got {value}")


def _check_variant(
    variants: list[Any], value: dict[str, Any], key: list[str | int], default: Any
) -> Any:
    tag_field = variants[0].__struct_config__.tag_field
    by_tag = {_tag(v): v for v in variants}
    tag = value.get(tag_field)
    if tag is None:
        chosen = default if default in variants else variants[0]
        value = {tag_field: _tag(chosen), **value}
    elif not isinstance(tag, str) or tag not in by_tag:
        raise ConfigError(
            format_key([*key, tag_field]),
            f"unknown {tag_field} {brief(tag)}; expected one of {', '.join(map(str, by_tag))}"
            + _suggest(str(tag), map(str, by_tag)),
        )
    else:
        chosen = by_tag[tag]
    return _check_struct(chosen, value, key)


def _check_component(
    point: type[registry.Component], value: dict[str, Any], key: list[str | int], default: Any
) -> _Built:
    """A component of extension point `point`, chosen by its `type` (the point's tag field;
    the field's default component when there is none)."""
    tag_field = point.__struct_config__.tag_field
    assert tag_field is not None
    name = value.get(tag_field)
    type_key = format_key([*key, tag_field])
    if name is None:  # the field's default, else fastllm's first (`losses`: label)
        first = next(iter(registry.builtins(point.point).values()), None)
        chosen = default if isinstance(default, type) and issubclass(default, point) else first
        if chosen is None:  # fastllm has none (`data.source`)
            raise ConfigError(type_key, "is required: name the component (type or module:Class)")
        cls: type[msgspec.Struct] = chosen
        value = {tag_field: registry.name_of(cls), **value}
    elif not isinstance(name, str):
        raise ConfigError(type_key, f"unknown type {brief(name)}; expected a name or module:Class")
    else:
        cls = registry.lookup(point.point, name, type_key)
        value = {**value, tag_field: registry.name_of(cls)}
    return _Built(_convert(cls, _check_struct(cls, value, key), key))


def _check_struct(cls: type[msgspec.Struct], value: dict[str, Any], key: list[str | int]) -> Any:
    fields = {f.encode_name: f for f in msgspec.structs.fields(cls)}
    tag_field = cls.__struct_config__.tag_field
    checked: dict[str, Any] = {}
    for alias, name in getattr(cls, "aliases", {}).items():
        if alias in value:
            if name in value:
                raise ConfigError(
                    format_key([*key, alias]), f"is a synonym of {name}: give only one"
                )
            value = {(name if k == alias else k): v for k, v in value.items()}
    for name, item in value.items():
        if name == tag_field:
            checked[name] = item
            continue
        field = fields.get(name) if isinstance(name, str) else None
        if field is None:
            moved = getattr(cls, "moved", {}).get(name)
            if moved is not None:
                raise ConfigError(format_key([*key, str(name)]), f"unknown key: it {moved}")
            hint = _suggest(name, fields) if isinstance(name, str) else ""
            raise ConfigError(
                format_key([*key, str(name)]),
                "unknown key" + (hint or f"; valid keys: {', '.join(fields)}"),
            )
        default = field.default_factory if field.default_factory is not msgspec.NODEFAULT else None
        checked[name] = _check(field.type, item, [*key, name], default)
    return checked


_AT = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>.*)`)?$", re.S)


def _explain(error: msgspec.ValidationError, raw: Any, prefix: list[str | int]) -> ConfigError:
    """msgspec's message with the key path in our notation and the offending value (`raw`,
    what was converted at `prefix`)."""
    match = _AT.match(str(error))
    assert match is not None
    message, path = match.group("message"), (match.group("path") or "").lstrip(".")
    key = parse_key(path) if path else []
    value: Any = raw
    for part in key:
        try:
            value = value[part]
        except (KeyError, IndexError, TypeError):
            return ConfigError(format_key([*prefix, *key]), message)
    message = message[0].lower() + message[1:]
    return ConfigError(format_key([*prefix, *key]), f"{message.replace('`', '')}: {brief(value)}")


def _validate(config: msgspec.Struct, key: list[str | int]) -> None:
    """Validate children first, so a section sees its children's derived defaults."""
    for field in msgspec.structs.fields(config):
        item = getattr(config, field.name)
        if isinstance(item, msgspec.Struct):
            _validate(item, [*key, field.encode_name])
        elif isinstance(item, list | dict):
            pairs = enumerate(item) if isinstance(item, list) else item.items()
            for index, element in pairs:
                if isinstance(element, msgspec.Struct):
                    _validate(element, [*key, field.encode_name, index])
    if isinstance(config, Section):
        try:
            config.validate()
        except ConfigError as error:
            raise ConfigError(format_key([*key, *parse_key(error.path)]), error.message) from None
