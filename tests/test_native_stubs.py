"""`fastllm/_native.pyi` describes the compiled module as it is: the same names and members, and
the parameters PyO3 reports (`__text_signature__`) for every function, method and constructor."""

from __future__ import annotations

import ast
import inspect
import types
from pathlib import Path
from typing import Any

import pytest

from fastllm import _native

STUB = ast.parse(Path(_native.__file__).with_name("_native.pyi").read_text())
STUB_CLASSES = {node.name: node for node in STUB.body if isinstance(node, ast.ClassDef)}
STUB_FUNCTIONS = {node.name: node for node in STUB.body if isinstance(node, ast.FunctionDef)}
# PyO3 sets these on every class (and Python `__weakref__` on an exception class PyO3 creates); a
# stub does not restate them.
CLASS_BOILERPLATE = {"__doc__", "__module__", "__new__", "__weakref__"}


def public(names: Any) -> set[str]:
    return {name for name in names if not name.startswith("_")}


def methods(node: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {item.name: item for item in node.body if isinstance(item, ast.FunctionDef)}


def is_property(node: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)


def parameters(signature: inspect.Signature, *, bound: bool) -> list[tuple[str, str, Any]]:
    """(name, kind, default) of each parameter, the receiver of a method left out."""
    listed = list(signature.parameters.values())[1 if bound else 0 :]
    return [(p.name, p.kind.name, p.default) for p in listed]


def stub_parameters(node: ast.FunctionDef) -> list[tuple[str, str, Any]]:
    """The parameters a stub function declares (a method's without `self`): its parameter list
    compiled with the annotations left unevaluated (the stub's types need not exist at run
    time), the defaults evaluated."""
    namespace: dict[str, Any] = {}
    exec(f"from __future__ import annotations\ndef f({ast.unparse(node.args)}): pass", namespace)
    bound = bool(node.args.args) and node.args.args[0].arg == "self"
    return parameters(inspect.signature(namespace["f"]), bound=bound)


def test_the_stub_names_what_the_module_exports() -> None:
    assert public(STUB_CLASSES) | public(STUB_FUNCTIONS) == public(dir(_native))


@pytest.mark.parametrize("name", sorted(public(STUB_CLASSES) & public(dir(_native))))
def test_the_stub_lists_every_member_of_a_class(name: str) -> None:
    cls, stub = getattr(_native, name), methods(STUB_CLASSES[name])
    members = vars(cls).keys() - CLASS_BOILERPLATE
    getters = {
        member for member in members if type(vars(cls)[member]) is types.GetSetDescriptorType
    }
    assert stub.keys() - {"__init__"} == members
    assert {member for member, node in stub.items() if is_property(node)} == getters
    # PyO3 gives a class a text signature exactly when it has a constructor.
    assert ("__init__" in stub) == (cls.__text_signature__ is not None)


def declared_parameters() -> dict[str, tuple[list[Any], list[Any]]]:
    """{name: (the module's parameters, the stub's)} of everything PyO3 gives a signature: the
    functions, the classes that have a constructor (against the stub's `__init__`), the methods."""
    declared = {}
    for name, node in STUB_FUNCTIONS.items():
        if hasattr(_native, name):
            module = inspect.signature(getattr(_native, name))
            declared[name] = (parameters(module, bound=False), stub_parameters(node))
    for class_name, class_node in STUB_CLASSES.items():
        cls = getattr(_native, class_name, None)
        for name, node in methods(class_node).items() if cls is not None else ():
            if name == "__init__" and cls.__text_signature__ is not None:
                module = inspect.signature(cls)  # the constructor's, without a receiver
                declared[class_name] = (parameters(module, bound=False), stub_parameters(node))
            elif getattr(vars(cls).get(name), "__text_signature__", None) is not None:
                module = inspect.signature(vars(cls)[name])
                declared[f"{class_name}.{name}"] = (
                    parameters(module, bound=True),
                    stub_parameters(node),
                )
    return declared


def test_the_stub_declares_the_parameters_pyo3_reports() -> None:
    declared = declared_parameters()
    reported = {
        name
        for name in public(dir(_native))
        if getattr(getattr(_native, name), "__text_signature__", None) is not None
    }
    assert declared.keys() >= reported
    mismatches = {name: pair for name, pair in declared.items() if pair[0] != pair[1]}
    assert mismatches == {}


def test_every_public_name_of_the_stub_has_a_docstring() -> None:
    nodes: list[tuple[str, ast.ClassDef | ast.FunctionDef]] = list(STUB_FUNCTIONS.items())
    for class_name, class_node in STUB_CLASSES.items():
        if not class_name.startswith("_"):
            nodes.append((class_name, class_node))
            nodes += [(f"{class_name}.{name}", node) for name, node in methods(class_node).items()]
    undocumented = [
        name
        for name, node in nodes
        if not name.split(".")[-1].startswith("_") and not ast.get_docstring(node)
    ]
    assert undocumented == []
