"""The package's shape: every name `fastllm_kernels.<module>` is that module, kernel files import
no other file's private names, and no file imports another that imports it back."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import fastllm_kernels

ROOT = Path(fastllm_kernels.__file__).parent


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name, with its file."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of each `import` and `from … import` of fastllm_kernels in the file,
    at any depth (a function's lazy import too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
    return [(module, names) for module, names in found if module.startswith("fastllm_kernels")]


def test_every_module_name_is_its_module_not_an_op_named_like_it() -> None:
    for info in pkgutil.walk_packages(fastllm_kernels.__path__, "fastllm_kernels."):
        importlib.import_module(info.name)
    for name in _modules():
        if "." in name:
            package, _, attribute = name.rpartition(".")
            found = getattr(importlib.import_module(package), attribute)
            assert found is importlib.import_module(name), f"{name} is {found!r}"


def test_no_file_imports_another_files_private_names() -> None:
    modules = _modules()
    for name, path in modules.items():
        for module, names in _imports(path):
            private = [n for n in names if n.startswith("_") and f"{module}.{n}" not in modules]
            assert not private, f"{name} imports {private} from {module}"


def test_the_modules_import_each_other_without_a_cycle() -> None:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        targets = set()
        for module, names in _imports(path):
            # `from package import module` runs the module, `from module import name` the
            # module; either runs the packages above it first.
            submodules = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules]
            for target in submodules or [module]:
                parts = target.split(".")
                targets.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        graph[name] = targets - {name}
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", f"import cycle: {' -> '.join([*path, name])}"
        state[name] = "open"
        for target in sorted(graph.get(name, ())):
            visit(target, [*path, name])
        state[name] = "done"

    for name in sorted(graph):
        visit(name, [])


def test_the_wheel_holds_every_module(tmp_path: Path) -> None:
    """What `make wheel` ships (to the GPU machine, to users) has every module of the source
    tree, subpackages included (a wheel without fp8/ failed to import there). Built from a
    clean copy: an earlier build's egg-info would list the files whatever the configuration."""
    source = tmp_path / "source"
    shutil.copytree(ROOT, source / ROOT.name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT.parent / "pyproject.toml", source)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), str(source)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("fastllm_kernels-*.whl")
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".py")}
    assert shipped == {str(path.relative_to(ROOT.parent)) for path in ROOT.rglob("*.py")}
