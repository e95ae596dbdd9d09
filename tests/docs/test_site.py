"""The documentation site builds with `mkdocs build --strict`: a broken link, a missing heading,
a missing repository file, a snippet that is not there or a docstring that mkdocstrings cannot
render fails `make test`."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mkdocs.commands.build import build
from mkdocs.config import load_config
from mkdocs.exceptions import Abort

from tests.conftest import ROOT


def test_site_builds_strictly(tmp_path: Path) -> None:
    environment = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "reference" / "api" / "index.html").is_file()
    # The compatibility table is included into the parallelism guide, not written twice.
    guide = (tmp_path / "parallelism" / "index.html").read_text(encoding="utf-8")
    assert "model.distributed.fp8_linear" in guide and "--8&lt;--" not in guide
    # A linked result file travels with the site.
    assert list((tmp_path / "repository" / "bench" / "results").rglob("scale_bench.md"))


def test_a_broken_link_fails_the_strict_build(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The site's own configuration on a page with one bad link of each kind."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(
        "# Home\n\n## Present\n\n"
        "[a page](missing.md), [a heading](#absent), [a result](../bench/results/nothing.json), "
        "[fine](#present)\n",
        encoding="utf-8",
    )
    config = load_config(
        str(ROOT / "mkdocs.yml"), docs_dir=str(docs), site_dir=str(tmp_path / "site"), strict=True
    )
    with caplog.at_level(logging.WARNING), pytest.raises(Abort):
        build(config)
    warnings = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert "missing.md" in warnings
    assert "#absent" in warnings
    assert "nothing.json" in warnings
    assert "#present" not in warnings
