"""Processes launched by torchrun (Gloo on CPUs, NCCL on GPUs), as users launch them.

`torchrun` runs one `fastllm` command line; `torchrun_runs` runs several, one after the other,
on the ranks of one launch (see tests/run_in_sequence.py): each rank starts Python and imports
torch once for all of them, which is most of what a small layout test costs on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from tests.conftest import ROOT
from tests.data.conftest import CliResult

_TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]


def torchrun(processes: int, *arguments: str) -> subprocess.CompletedProcess[str]:
    """`fastllm ARGUMENTS` on `processes` ranks."""
    command = [*_TORCHRUN, str(processes), "-m", "fastllm.cli", *arguments]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)


def torchrun_script(processes: int, script: str) -> subprocess.CompletedProcess[str]:
    """Python source `script` on `processes` ranks."""
    command = [*_TORCHRUN, str(processes), "--no-python", sys.executable, "-c", script]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)


def torchrun_runs(
    processes: int, runs: Mapping[str, list[str] | str], directory: Path, timeout: float = 600
) -> dict[str, CliResult]:
    """`fastllm ARGUMENTS` for each named argument list (or the Python source of each named
    string, which joins the run's process group through `setup_distributed`), in order, on
    `processes` ranks of one launch; each result has the exit code, stdout and stderr of its
    run over all ranks. A launch stops at the first run that fails on a rank (as a launch of
    that run alone would), and the runs after it are launched again: a failure costs one more
    start-up, not the later runs' results. A run that a launch left unfinished without a
    failing rank gets exit code -1."""
    directory.mkdir(parents=True, exist_ok=True)
    results: dict[str, CliResult] = {}
    pending = dict(runs)
    while pending:
        for name in pending:  # a rank may have finished a run the launch did not
            for r in range(processes):
                (directory / f"{name}.rank{r}.code").unlink(missing_ok=True)
        launch = _launch(processes, pending, directory, timeout)
        for name in pending:
            codes = [_read(directory / f"{name}.rank{r}.code") for r in range(processes)]
            failed = [int(c) for c in codes if c is not None and int(c) != 0]
            code = failed[0] if failed else -1 if None in codes else 0
            stdout, stderr = (
                "".join(_read(directory / f"{name}.rank{r}.{kind}") or "" for r in range(processes))
                for kind in ("stdout", "stderr")
            )
            if code == -1:
                stderr += "not run to its end in the launch, which says:\n"
            if code != 0:
                stderr += launch.stderr
            results[name] = CliResult(code, stdout, stderr)
            if code != 0:
                break
        pending = {name: arguments for name, arguments in pending.items() if name not in results}
    return {name: results[name] for name in runs}


def _launch(
    processes: int, runs: Mapping[str, list[str] | str], directory: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    spec = directory / "runs.json"
    spec.write_text(json.dumps({"directory": str(directory), "runs": dict(runs)}))
    command = [*_TORCHRUN, str(processes), "--no-python", sys.executable]
    command += ["-m", "tests.run_in_sequence", str(spec)]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def _read(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None
