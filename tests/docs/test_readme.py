"""README.md is the front door (issue 33): at most 150 lines, and its table of measured results
holds at most 8 rows, each linking the committed result file its figures come from."""

from __future__ import annotations

import re

from tests.conftest import ROOT

README = ROOT / "README.md"
RESULT_LINK = re.compile(r"\]\((bench/results/[^)\s#]+)")


def measured_rows(text: str) -> list[str]:
    """The body rows of the table under the README's `## Measured` heading."""
    section = re.search(r"^## Measured\n(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
    assert section is not None, "README.md has no Measured section"
    rows = [line for line in section.group(1).splitlines() if line.startswith("|")]
    return rows[2:]  # after the header and its rule


def test_the_readme_is_at_most_150_lines() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move the detail into docs/"


def test_every_measured_result_of_the_readme_links_its_committed_file() -> None:
    rows = measured_rows(README.read_text(encoding="utf-8"))
    assert 0 < len(rows) <= 8, f"{len(rows)} measured rows: at most 8 in the README"
    for row in rows:
        links = RESULT_LINK.findall(row)
        assert links, f"this result links no file under bench/results/: {row}"
        for link in links:
            assert (ROOT / link).is_file(), f"{link} is not a file of the repository: {row}"


def test_a_row_without_its_result_file_is_found() -> None:
    text = (
        "## Measured\n\n| run | result | file |\n|---|---|---|\n"
        "| a | 1 tokens/s | [r.json](bench/results/x/r.json) |\n| b | 2 tokens/s | none |\n\n## Next\n"
    )
    rows = measured_rows(text)
    assert [bool(RESULT_LINK.findall(row)) for row in rows] == [True, False]
