"""The floors of the house (DESIGN.md): an import goes down or sideways within a floor, never
up, and no package is in an import cycle. Read from the sources (every import statement,
including those inside functions and under TYPE_CHECKING), not from what a run imports.

Floors, lowest first: config → kernels, parallel, data → model (with hf, the `transformers`
wrapper of the model) → checkpoint → engine → training, evaluation → cli/api (the other
top-level modules of `fastllm`)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.conftest import ROOT

SOURCES = {
    "fastllm": ROOT / "python" / "fastllm",
    "fastllm_kernels": ROOT / "kernels" / "fastllm_kernels",
}
FLOORS = [
    {"config"},
    {"kernels", "parallel", "data", "_native"},
    {"model", "hf"},
    {"checkpoint"},
    {"engine"},
    {"training", "evaluation"},
    {"cli", "cli_reference", "api", "generation", "evaluate", "demo", "__init__"},
]
"""Each package's floor; a top-level module of `fastllm` is its own package."""


def package_of(module: str) -> str:
    """`fastllm.engine.stages` → engine; `fastllm_kernels.…` → kernels; `fastllm` → __init__."""
    parts = module.split(".")
    if parts[0] == "fastllm_kernels":
        return "kernels"
    return parts[1] if len(parts) > 1 else "__init__"


def floor_of(package: str) -> int:
    for level, packages in enumerate(FLOORS):
        if package in packages:
            return level
    raise AssertionError(f"package {package!r} is on no floor: add it to FLOORS and DESIGN.md")


def module_name(root: str, directory: Path, path: Path) -> str:
    parts = list(path.relative_to(directory).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([root, *parts])


def imports(sources: dict[str, Path] = SOURCES) -> dict[str, set[str]]:
    """Every module of the two packages and the modules of either that it imports (`from A
    import B` imports module A.B where there is one, else A)."""
    files = {
        module_name(root, directory, path): path
        for root, directory in sources.items()
        for path in sorted(directory.rglob("*.py"))
    }
    known = set(files) | {f"{root}._native" for root in sources}  # the compiled binding
    found: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, base]).rstrip(".")
                for alias in node.names:
                    name = f"{base}.{alias.name}"
                    targets.add(name if name in known else base)
        found[module] = {t for t in targets if t.split(".")[0] in sources and t != module}
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if floor_of(package_of(target)) > floor_of(package_of(module))
    )


def package_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one package (Tarjan), each sorted."""
    edges: dict[str, set[str]] = defaultdict(set)
    for module, targets in graph.items():
        for target in targets:
            if package_of(target) != package_of(module):
                edges[package_of(module)].add(package_of(target))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                cycles.append(sorted(members))

    for node in sorted({package_of(m) for m in graph}):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_goes_up_a_floor() -> None:
    assert upward_imports(imports()) == []


def test_no_package_is_in_an_import_cycle() -> None:
    assert package_cycles(imports()) == []


def test_a_planted_upward_import_and_cycle_are_found(tmp_path: Path) -> None:
    model = tmp_path / "fastllm" / "model"
    engine = tmp_path / "fastllm" / "engine"
    for directory in (model, engine, tmp_path / "fastllm_kernels"):
        directory.mkdir(parents=True)
    (model / "gpt.py").write_text("from fastllm.engine.stages import Stage\n")
    (engine / "stages.py").write_text("import fastllm.model.gpt\n")
    sources = {"fastllm": tmp_path / "fastllm", "fastllm_kernels": tmp_path / "fastllm_kernels"}
    graph = imports(sources)
    assert upward_imports(graph) == ["fastllm.model.gpt imports fastllm.engine.stages"]
    assert package_cycles(graph) == [["engine", "model"]]
