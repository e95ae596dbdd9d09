"""The topic pages (FP8, long context, mixture of experts, guarantees, support matrix,
architecture) name files, config keys and tests that must exist: a rename or a removal in the
code fails here until the page follows."""

from __future__ import annotations

import re
import typing

import msgspec
import pytest

from fastllm.config import TrainerConfig
from tests.conftest import ROOT

DOCS = ROOT / "docs"
PAGES = [
    "fp8.md",
    "long-context.md",
    "moe.md",
    "deepseek-v3.md",
    "lora.md",
    "distillation.md",
    "evaluation.md",
    "guarantees.md",
    "support.md",
    "architecture.md",
    "extending.md",
]
CODE = re.compile(r"`([^`\n]+)`")
TOP_LEVEL = ("bench/", "python/", "kernels/", "rust/", "tests/", "examples/")
PACKAGES = ("config", "data", "parallel", "model", "checkpoint", "engine", "training", "schedule")
SECTIONS = ("run.", "model.", "training.", "batch.", "schedule.", "data.", "optimizer.")


def spans(page: str) -> list[str]:
    """The text of every inline code span of the page (code blocks excluded)."""
    text = re.sub(r"```.*?```", "", (DOCS / page).read_text(), flags=re.S)
    return CODE.findall(text)


def named_paths(page: str) -> list[str]:
    """Repository paths the page names: from the root (`bench/…`, `python/…`), under the
    package (`engine/build.py`), or result folders named by their short form (`h200-abfc79b/`)."""
    found = []
    for span in spans(page):
        token = span.split()[0].rstrip(",")
        if "*" in token or "NAME" in token or "HASH" in token:
            continue
        if token.startswith(TOP_LEVEL):
            found.append(token)
        elif token.split("/")[0] in PACKAGES and token.endswith(".py"):
            prefix = (
                "python/fastllm/engine/" if token.startswith("schedule/") else "python/fastllm/"
            )
            found.append(prefix + token)
        elif re.fullmatch(r"(h200|schedule-sim)-[0-9a-f]{7}/.*", token):
            found.append("bench/results/" + token)
    return found


@pytest.mark.parametrize("page", PAGES)
def test_every_path_a_topic_page_names_exists(page: str) -> None:
    paths = named_paths(page)
    assert paths, f"{page} names no path: the pattern no longer reads it"
    missing = [path for path in paths if not (ROOT / path).exists()]
    assert not missing, f"{page} names paths that do not exist: {missing}"


def _has_key(section: type, parts: list[str]) -> bool:
    """Whether the dotted key `parts` exists under the config class `section` (any variant of
    a tagged union, as `rotary` is; any name in a section by name, as `data.datasets`)."""
    if not parts:
        return True
    hints = typing.get_type_hints(section)
    if parts[0] not in hints:
        return False
    candidates = [
        arg
        for arg in (typing.get_args(hints[parts[0]]) or (hints[parts[0]],))
        if isinstance(arg, type) and issubclass(arg, msgspec.Struct)
    ]
    if len(parts) == 1:
        return True
    if typing.get_origin(hints[parts[0]]) is dict:  # parts[1] is a name
        parts = parts[1:]
    variants = [c for base in candidates for c in (base, *_subclasses(base))]
    return any(_has_key(variant, parts[1:]) for variant in variants)


def _subclasses(cls: type) -> list[type]:
    return [s for direct in cls.__subclasses__() for s in (direct, *_subclasses(direct))]


def test_the_key_reader_refuses_a_key_that_does_not_exist() -> None:
    assert _has_key(TrainerConfig, ["model", "base_model", "transformer", "rotary", "scale_factor"])
    assert not _has_key(TrainerConfig, ["model", "distributed", "fp8_recipe"])
    assert _has_key(TrainerConfig, ["training", "evaluators", "wiki", "evaluator", "iterations"])
    assert not _has_key(TrainerConfig, ["training", "evaluators", "wiki", "iterations"])


@pytest.mark.parametrize("page", PAGES)
def test_every_config_key_a_topic_page_names_exists(page: str) -> None:
    keys = {
        re.sub(r"\[\d+\]", "", span.split(":")[0].split("=")[0].strip()) for span in spans(page)
    }
    keys = {key for key in keys if key.startswith(SECTIONS) and " " not in key and "*" not in key}
    assert keys, f"{page} names no config key: the pattern no longer reads them"
    missing = sorted(key for key in keys if not _has_key(TrainerConfig, key.split(".")))
    assert not missing, f"{page} names config keys that do not exist: {missing}"


def test_every_key_of_the_mixture_of_experts_table_exists() -> None:
    """The table lists the keys by their names under model.base_model.transformer."""
    table = (DOCS / "moe.md").read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    keys = re.findall(r"^\| `([a-z_]+)` \|", table, flags=re.M)
    assert len(keys) >= 8
    prefix = ["model", "base_model", "transformer"]
    missing = [key for key in keys if not _has_key(TrainerConfig, [*prefix, key])]
    assert not missing, f"moe.md lists keys that do not exist: {missing}"


def guarantee_tests() -> list[tuple[str, str]]:
    """(test name, file) of each row of the guarantees page's appendix."""
    appendix = (DOCS / "guarantees.md").read_text().split("## For contributors", 1)[1]
    rows = re.findall(r"^\|(.+)\|\s*`([^`]+)`\s*\|$", appendix, flags=re.M)
    return [(name, path) for cell, path in rows for name in CODE.findall(cell)]


def test_every_test_the_guarantees_page_names_is_defined_in_its_file() -> None:
    rows = guarantee_tests()
    assert len(rows) >= 70, "the appendix lists every test behind the guarantees"
    missing = []
    for name, path in rows:
        source = (ROOT / path).read_text()
        if not re.search(rf"\b(def|fn) {re.escape(name)}\b", source):
            missing.append(f"{name} in {path}")
    assert not missing, f"tests named on the guarantees page that do not exist: {missing}"
