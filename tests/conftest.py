"""Shared test helpers. The training tests' shared runs (one-process references made once per
session, several layouts per torchrun launch) are in tests/training/conftest.py; a command line
runs in this process with tests.data.conftest.run_cli, in a subprocess with tests.test_cli.fastllm,
under torchrun with tests.torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def examples() -> Path:
    return ROOT / "examples"
