"""Reading the user guide's pages as tests see them."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import ROOT

DOCS = ROOT / "docs"


def bash_blocks(page: Path) -> list[str]:
    """The contents of the page's ```bash blocks, in order."""
    return re.findall(r"^```bash\n(.*?)^```", page.read_text(), re.DOTALL | re.MULTILINE)
