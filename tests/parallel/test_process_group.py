"""The process group is really gone after destroy_process_group, so no communication thread
outlives it into interpreter shutdown (where releasing a tensor can abort the process)."""

from __future__ import annotations

from tests.torchrun import torchrun_script

SCRIPT = """
import os, torch, torch.distributed as dist
from fastllm.parallel.process_group import setup_distributed
setup_distributed()
compiled = torch.compile(lambda x: x * 2)  # what the model's attention does
dist.destroy_process_group()
threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
assert not [t for t in threads if "gloo" in t], threads
"""


def test_destroying_the_group_stops_its_threads() -> None:
    result = torchrun_script(2, SCRIPT)
    assert result.returncode == 0, result.stderr
