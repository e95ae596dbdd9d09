"""Property: whatever value any config key is given, `fastllm config validate` exits 0 or 2 in
one line, never with a traceback. The keys come from walking the config classes, so a new key is
covered without editing this test."""

from __future__ import annotations

import types
import typing
from typing import Any

import msgspec
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from fastllm.config import TrainerConfig, registry
from tests.data.conftest import run_cli
from tests.fuzz.conftest import examples, no_hang


def _variants(tp: Any) -> list[Any]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(tp) if a is not type(None)]
    return [tp]


def _struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def config_keys(cls: type[msgspec.Struct], prefix: str = "", needs: tuple[str, ...] = ()) -> list:
    """(key, its field type, the overrides that make the key exist) of every leaf under `cls`:
    a tagged variant's keys need its `type` (an extension point's variants: its components), a
    list of sections' keys their first item."""
    keys = []
    for field in msgspec.structs.fields(cls):
        key = f"{prefix}{field.encode_name}"
        structs = [  # an extension point's: fastllm's components
            component
            for v in _variants(field.type)
            if _struct(v)
            for component in (registry.builtins(v.point).values() if registry.is_point(v) else [v])
        ]
        if not structs:
            keys.append((key, field.type, needs))
        for struct in structs:
            config = struct.__struct_config__
            choose = (f"{key}.{config.tag_field}={config.tag}",) if config.tag else ()
            if config.tag:
                keys.append((f"{key}.{config.tag_field}", str, needs))
            keys += config_keys(struct, f"{key}.", needs + choose)
        for item in [a for v in _variants(field.type) for a in typing.get_args(v)]:
            if typing.get_origin(field.type) is list and _struct(item):
                keys += config_keys(item, f"{key}[0].", needs)
    return keys


KEYS = config_keys(TrainerConfig)

# Values of every YAML type, the awkward ones included: huge and negative integers, NaN and
# infinities, long and non-ASCII strings, nested lists and mappings. (No subnormal draws: a
# CPU engine built earlier in the process flushes denormals, which hypothesis refuses; the
# list below still passes the smallest one, 5e-324, as a value.)
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, -1, 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**30])
    | st.floats(allow_subnormal=False)
    | st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, 5e-324, -0.0])
    | st.text(max_size=20)
    | st.text(min_size=200, max_size=2000)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


def typed_values(tp: Any) -> st.SearchStrategy[Any]:
    """Values of the key's own type (to get past the type check to the cross-field checks)."""
    options = []
    for variant in _variants(tp):
        if typing.get_origin(variant) is typing.Literal:
            options.append(st.sampled_from(typing.get_args(variant)))
        elif typing.get_origin(variant) is list:
            options.append(st.lists(typed_values(typing.get_args(variant)[0]), max_size=3))
        elif variant is bool:
            options.append(st.booleans())
        elif variant is int:
            options.append(st.integers(min_value=-4, max_value=2**40) | st.integers())
        elif variant is float:
            options.append(
                st.floats(min_value=-10, max_value=1e6, allow_subnormal=False)
                | st.floats(allow_subnormal=False)
            )
        elif variant is str:
            options.append(st.text(max_size=30))
    return st.one_of(options) if options else values


def override_text(value: Any) -> str:
    """The value as the YAML an override's right-hand side holds."""
    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=10**9)
    return text.removesuffix("\n").removesuffix("\n...")


@st.composite
def overrides(draw: st.DrawFn) -> list[str]:
    arguments: list[str] = []
    for key, tp, needs in draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=4)):
        value = draw(typed_values(tp) | values)
        raw = draw(st.booleans() | st.just(False))  # raw text: YAML that need not parse
        text = draw(st.text(max_size=40)) if raw else override_text(value)
        arguments += [*needs, f"{key}={text}"]
    return arguments


@settings(max_examples=examples(1000))
@given(arguments=overrides(), world_size=st.none() | st.integers(min_value=1, max_value=64))
def test_config_validate_exits_0_or_2_in_one_line_for_any_value_of_any_key(
    arguments: list[str], world_size: int | None
) -> None:
    ranks = [] if world_size is None else ["--world-size", str(world_size)]
    with no_hang():
        result = run_cli("config", "validate", *ranks, *arguments)
    assert result.returncode in (0, 2), result.stderr
    if result.returncode == 2:
        assert "Traceback" not in result.stderr
        assert result.stderr.startswith("fastllm: error: "), result.stderr
        assert result.stderr.count("\n") == 1, result.stderr


def test_every_config_key_is_drawn() -> None:
    drawn = {key for key, _, _ in KEYS}
    for key in (
        "model.base_model.transformer.rotary.scale_factor",
        "model.base_model.transformer.normalization.type",
        "data.path",
        "optimizer.learning_rate.base",
    ):
        assert key in drawn
    assert len(drawn) > 90
