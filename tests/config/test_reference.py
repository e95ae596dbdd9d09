from __future__ import annotations

from fastllm.config.layout import COMPATIBILITY
from fastllm.config.reference import (
    DIRECTORY,
    PAGES,
    compatibility_page,
    compatibility_table,
    config_page,
    reference,
)
from fastllm.config.trainer import TrainerConfig
from tests.conftest import ROOT


def test_config_reference_page_matches_the_config_classes() -> None:
    page = (ROOT / DIRECTORY / "config.md").read_text(encoding="utf-8")
    assert page == config_page(), "run `make reference`"


def test_compatibility_page_matches_the_compatibility_table() -> None:
    page = (ROOT / DIRECTORY / "compatibility.md").read_text(encoding="utf-8")
    assert page == compatibility_page(), "run `make reference`"


def test_reference_documents_every_field_and_variant() -> None:
    text = reference(TrainerConfig)
    for fragment in (
        "`head_groups`",
        "with `type: llama3`",
        "`scale_factor`",
        "`train_iters`",
        "`weights`",
    ):
        assert fragment in text
    assert "|  |" not in text.replace(" | ", "|"), "a field without documentation"


def test_compatibility_table_has_a_row_per_refused_pair_naming_both_keys() -> None:
    rows = compatibility_table().splitlines()[2:]
    assert len(rows) == len(COMPATIBILITY)
    for line, row in zip(rows, COMPATIBILITY, strict=True):
        assert f"`{row.setting.key}`" in line and f"`{row.other.key}`" in line
        assert line.endswith(f"| {row.reason} |")
    assert len(compatibility_table(COMPATIBILITY[:2]).splitlines()) == 4


def test_make_reference_writes_each_page_once(tmp_path, capsys) -> None:
    from fastllm.config.reference import main

    main(tmp_path, PAGES)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(PAGES)
    assert (tmp_path / "config.md").read_text(encoding="utf-8") == config_page()
    main(tmp_path, PAGES)
    assert capsys.readouterr().out.count("up to date") == len(PAGES)
