"""The components a config chooses with `type:`, by extension point, open to code outside fastllm.

An extension point is a config base class that declares `point` (`NormalizationConfig`,
`MLPBaseConfig`, `LossConfig`, …). A component is a subclass with a msgspec tag, its name:
defining it registers it (fastllm's and other packages' alike). A `type:` value is found among
the components defined so far, then in the entry points of the group `fastllm.POINT` of the
installed packages (`squared_relu = my_plugin.config:SquaredReLUConfig`), then read as an
import path (`my_plugin.config:SquaredReLUConfig`); the entry point or module is imported only
then. docs/extending.md is the user's guide.

The config is all this package knows: a component's runtime part (a torch module, a loss
function) is named by its `implementation`, an import path that the model or the engine
imports, so that config never imports torch.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
from collections.abc import Iterator
from typing import Any, ClassVar

import msgspec

from fastllm.config.section import ConfigError, Section

GROUP = "fastllm.{point}"
"""The entry-point group of a point's components in installed packages."""


class Component(Section, tag_field="type"):
    """The base of the extension points. A point's base class sets `point`; each subclass with
    a tag of its own is a component of that point, named by the tag."""

    point: ClassVar[str] = ""
    """The extension point (set by the point's base class): `normalization`, `mlp`, …"""
    implementation: ClassVar[str | None] = None
    """`module:attribute` of the runtime part that the model or the engine builds from this
    config (the point says what it is called with); None: the point has none (or the
    component is not built, as `rotary: {type: none}`)."""
    unsupported_settings: ClassVar[dict[str, str]] = {}
    """Config keys (`model.distributed.tensor_parallel`) that must keep their defaults with
    this component, each with the reason: a layout it cannot run under is refused when the
    config is loaded, naming the component's key, the setting and the reason."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # The tag is not set yet (msgspec sets it after the class is made): keep the class,
        # read its tag when looked up.
        if "point" in cls.__dict__:
            _POINTS[cls.point] = cls
            _COMPONENTS[cls.point] = []
        else:
            _COMPONENTS[cls.point].append(cls)


_POINTS: dict[str, type[Component]] = {}
"""Each point's base class, by point."""
_COMPONENTS: dict[str, list[type[Component]]] = {}
"""Each point's components defined so far (imported modules), in definition order."""


def is_point(cls: Any) -> bool:
    """`cls` is an extension point's base class (a field of this type takes any component)."""
    return isinstance(cls, type) and cls in _POINTS.values()


def name_of(cls: type[Component]) -> str:
    tag = cls.__struct_config__.tag
    assert isinstance(tag, str), cls
    return tag


def is_builtin(cls: type) -> bool:
    """Defined by fastllm itself (not by a plugin)."""
    return cls.__module__.split(".")[0] == "fastllm"


def registered(point: str) -> dict[str, type[Component]]:
    """The components of `point` defined so far, by name. A subclass that inherits its
    parent's tag is not a component of its own."""
    found: dict[str, type[Component]] = {}
    for cls in _COMPONENTS[point]:
        name = name_of(cls)
        inherited = any(
            isinstance(base, type) and issubclass(base, Component) and base.point == point
            and base is not cls and base.__struct_config__.tag == name
            for base in cls.__mro__
        )  # fmt: skip
        if not inherited:
            found.setdefault(name, cls)
    return found


def installed(point: str) -> dict[str, type[Component]]:
    """The components of `point`: those defined so far, and those of every installed package
    (their entry points are imported; one that fails raises a `ConfigError`)."""
    for entry in _entry_points(point):
        _load_entry_point(point, entry, f"{GROUP.format(point=point)} {entry.name}")
    return registered(point)


def builtins(point: str) -> dict[str, type[Component]]:
    """The components fastllm itself defines."""
    return {name: cls for name, cls in registered(point).items() if is_builtin(cls)}


def lookup(point: str, name: str, key: str) -> type[Component]:
    """The component of `point` named `name` (a registered name, an entry point's or an import
    path `module:Class`); a `ConfigError` at `key` (the `type` key) naming it otherwise."""
    found = registered(point).get(name)
    if found is not None:
        return found
    for entry in _entry_points(point):
        if entry.name == name:
            return _checked(point, _load_entry_point(point, entry, key), name, key)
    if ":" in name:
        return _checked(point, _import(name, key, f"type {name!r}"), None, key)
    names = sorted({*registered(point), *(entry.name for entry in _entry_points(point))})
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    raise ConfigError(
        key,
        f"unknown type {name!r}; expected one of {', '.join(names)}, the import path of a "
        f"{_POINTS[point].__name__} subclass (module:Class), or a name that an installed "
        f"package registers in the entry-point group {GROUP.format(point=point)}"
        + (f"; did you mean {close[0]}?" if close else ""),
    )


def _entry_points(point: str) -> Iterator[importlib.metadata.EntryPoint]:
    yield from importlib.metadata.entry_points(group=GROUP.format(point=point))


def _load_entry_point(point: str, entry: importlib.metadata.EntryPoint, key: str) -> Any:
    where = f"entry point of {GROUP.format(point=point)}: {entry.value}"
    return _import(entry.value, key, f"type {entry.name!r} ({where})")


def _import(path: str, key: str, what: str) -> Any:
    """The object at `module:attribute`, a `ConfigError` at `key` naming `what` if it cannot
    be imported."""
    module_name, _, attribute = path.partition(":")
    try:
        value: Any = importlib.import_module(module_name)
        for part in attribute.split(".") if attribute else ():
            value = getattr(value, part)
    except Exception as error:  # any import error of the component's code, named
        raise ConfigError(
            key, f"{what} cannot be imported: {type(error).__name__}: {error}"
        ) from error
    return value


def _checked(point: str, cls: Any, name: str | None, key: str) -> type[Component]:
    base = _POINTS[point]
    if not (isinstance(cls, type) and issubclass(cls, base) and cls is not base):
        raise ConfigError(key, f"{cls!r} is not a {base.__name__} subclass (a {point} component)")
    if name is not None and name_of(cls) != name:
        raise ConfigError(
            key, f"entry point {name!r} names {cls.__qualname__}, whose type is {name_of(cls)!r}"
        )
    return cls


def implementation(config: Component) -> Any:
    """The runtime part of `config`'s component, imported (a `ConfigError` naming the type if
    it cannot be)."""
    cls = type(config)
    path = cls.implementation
    if path is None:
        raise TypeError(f"{cls.point} type {name_of(cls)!r} has no implementation")
    name = name_of(cls)
    return _import(path, f"{cls.point} type {name!r}", f"its implementation {path}")


def class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def components(config: msgspec.Struct, key: str = "") -> Iterator[tuple[str, Component]]:
    """Every component chosen in `config`, with its dotted key."""
    if isinstance(config, Component):
        yield key, config
    for field in msgspec.structs.fields(config):
        item = getattr(config, field.name)
        child = f"{key}.{field.encode_name}" if key else field.encode_name
        items = item.items() if isinstance(item, dict) else [(None, item)]
        for name, value in items:
            if isinstance(value, msgspec.Struct):
                yield from components(value, child if name is None else f"{child}.{name}")


def record(config: msgspec.Struct) -> dict[str, dict[str, str]]:
    """The components of `config` that fastllm does not define, to save with a checkpoint:
    by point, each name's class as an import path."""
    used: dict[str, dict[str, str]] = {}
    for _, component in components(config):
        cls = type(component)
        if not is_builtin(cls):
            used.setdefault(cls.point, {})[name_of(cls)] = class_path(cls)
    return used


def require(recorded: dict[str, dict[str, str]], where: str) -> None:
    """Import the components a checkpoint `recorded`, so that its config reads; one
    `ConfigError` at `where` naming every one that cannot be imported."""
    missing: list[str] = []
    for point, classes in recorded.items():
        for name, path in classes.items():
            if point in _POINTS and name in registered(point):
                continue
            try:
                _import(path, where, path)
            except ConfigError as error:
                missing.append(f"{point} type {name!r}: {error.message}")
    if missing:
        raise ConfigError(
            where,
            "was written with components that are not installed: "
            + "; ".join(missing)
            + ". Install the packages that provide them",
        )


def check_settings(config: msgspec.Struct, defaults: msgspec.Struct) -> None:
    """A `ConfigError` at the key of the first component of `config` whose
    `unsupported_settings` are not at their value in `defaults` (the root's defaults)."""
    for key, component in components(config):
        for setting, reason in type(component).unsupported_settings.items():
            try:
                value, default = _setting(config, setting), _setting(defaults, setting)
            except AttributeError:
                raise TypeError(
                    f"{type(component).__qualname__}.unsupported_settings names {setting!r}, "
                    "which is no config key"
                ) from None
            if value != default:
                raise ConfigError(
                    key,
                    f"type {name_of(type(component))!r} does not support {setting}={value} "
                    f"({reason})",
                )


def _setting(config: Any, key: str) -> Any:
    for part in key.split("."):
        config = getattr(config, part)
    return config
