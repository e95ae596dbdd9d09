"""Shared test helpers. The training tests' shared runs (one-process references made once per
session, several layouts per torchrun launch) are in tests/training/conftest.py; a command line
runs in this process with tests.data.conftest.run_cli, in a subprocess with tests.test_cli.fastllm,
under torchrun with tests.torchrun."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import settings

if TYPE_CHECKING:
    from tests.data.conftest import CliResult

ROOT = Path(__file__).resolve().parents[1]

# The property tests (tests/fuzz) draw `max_examples`/100 times the examples each asks for:
# within about 30 s each on a CI machine under `make test`, 20 times more under `make fuzz`
# (--hypothesis-profile=fuzz). No example database is written.
# `make test` draws the same examples every run (derandomized: CI does not flake on a new find);
# `make fuzz` draws new ones.
settings.register_profile(
    "bounded", max_examples=100, deadline=None, database=None, derandomize=True
)
settings.register_profile("fuzz", max_examples=2000, deadline=None, database=None)
settings.load_profile("bounded")


@pytest.fixture
def examples() -> Path:
    return ROOT / "examples"


# Two-rank scripts (tests/engine, tests/parallel): a module that defines `TWO_RANKS` (Python source
# that joins the group through `setup_distributed` and raises where a check fails) gets its
# result, over both ranks, from the fixture `two_ranks`. The scripts of all such modules of the
# session run one after the other on the ranks of one launch (`tests.torchrun.torchrun_runs`:
# Python and torch start once for all, which is most of what such a script costs), each in a
# process group of its own.
@pytest.fixture(scope="session")
def two_rank_scripts(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, CliResult]:
    """The `TWO_RANKS` result of every module with tests in this session, by module name."""
    from tests.torchrun import torchrun_runs  # it imports this module

    modules = {getattr(item, "module", None) for item in request.session.items}
    scripts = {m.__name__: m.TWO_RANKS for m in modules if hasattr(m, "TWO_RANKS")}
    with pytest.MonkeyPatch.context() as patch:
        # The kernels' torch references: the scripts test communication (tests/kernels tests
        # the kernels), and the interpreter would make their steps many times slower.
        patch.delenv("TRITON_INTERPRET", raising=False)
        return torchrun_runs(2, dict(sorted(scripts.items())), tmp_path_factory.mktemp("scripts"))


@pytest.fixture
def two_ranks(request: pytest.FixtureRequest, two_rank_scripts: dict[str, CliResult]) -> CliResult:
    """This module's `TWO_RANKS`, run."""
    return two_rank_scripts[request.module.__name__]
