"""Every relative link of the repository's own Markdown pages (README.md, CONTRIBUTING.md,
CHANGELOG.md, bench/*.md, bench/results/README.md) names a file or folder that exists in the
repository: the benchmark pages cite their figures by linking the committed result files, so a
moved or renamed result breaks this test instead of a reader's click. (The docs/ pages are
checked by `mkdocs build --strict`.)"""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import ROOT

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.DOTALL)
INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"
)
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def pages() -> list[Path]:
    """The Markdown pages this test checks (those that exist)."""
    names = ["README.md", "CONTRIBUTING.md", "CHANGELOG.md", "bench/results/README.md"]
    found = [ROOT / name for name in names if (ROOT / name).is_file()]
    return found + sorted((ROOT / "bench").glob("*.md"))


def relative_links(text: str) -> list[str]:
    """The targets of the inline links, images and reference definitions of a Markdown text
    that point into the repository: no URL scheme, no bare #anchor; code is not searched."""
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    targets = INLINE_LINK.findall(text) + REFERENCE_DEFINITION.findall(text)
    return [t for t in targets if not SCHEME.match(t) and not t.startswith("#")]


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """The relative links of `page` whose target (its #anchor dropped) is not a file or a
    folder under `root`."""
    broken = []
    for target in relative_links(page.read_text(encoding="utf-8")):
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(root.resolve()) or not path.exists():
            broken.append(target)
    return broken


def test_every_relative_link_of_the_markdown_pages_resolves():
    assert (ROOT / "bench" / "README.md") in pages()
    broken = {str(p.relative_to(ROOT)): broken_links(p) for p in pages()}
    assert {page: links for page, links in broken.items() if links} == {}


def test_the_check_finds_a_broken_link_and_ignores_urls_anchors_and_code(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "run.json").write_text("{}")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](results/run.json) ![chart](results/) [anchor](results/run.json#steps)\n"
        "[gone](results/missing.json) [up](../outside.md) [web](https://example.com/x.md)\n"
        "[top](#section) `[code](nowhere.md)`\n\n```\n[fenced](nowhere.md)\n```\n"
        "[ref]: results/old.json\n"
    )
    assert broken_links(page, root=tmp_path) == [
        "results/missing.json",
        "../outside.md",
        "results/old.json",
    ]
