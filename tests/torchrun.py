"""Processes launched by torchrun (Gloo on CPUs, NCCL on GPUs), as users launch them."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

_TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]


def torchrun(processes: int, *arguments: str) -> subprocess.CompletedProcess[str]:
    """`fastllm ARGUMENTS` on `processes` ranks."""
    command = [*_TORCHRUN, str(processes), "-m", "fastllm.cli", *arguments]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)


def torchrun_script(processes: int, script: str) -> subprocess.CompletedProcess[str]:
    """Python source `script` on `processes` ranks."""
    command = [*_TORCHRUN, str(processes), "--no-python", sys.executable, "-c", script]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
