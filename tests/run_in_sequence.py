"""`python -m tests.run_in_sequence RUNS.json` on each rank of a torchrun launch: the runs of
RUNS.json one after the other in this process, each a `fastllm` command line (a list of
arguments) or a Python script (a string; `setup_distributed` there joins the run's group, and
an exception fails the run with its traceback in stderr). Each run gets a process group of
its own, which the run leaves as a launch of it alone would: the group is created here, with
keys of its own in the launch's store (a group created again under the same keys could read
the previous group's addresses there). Per run and rank it writes NAME.rankR.stdout, .stderr
and .code next to RUNS.json; the first run that fails ends the process with its code, and
torchrun then stops the other ranks."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from fastllm.cli import main


def run_in_sequence(spec: Path) -> int:
    content = json.loads(spec.read_text())
    directory = Path(content["directory"])
    # Before any group exists, as fastllm's own set-up does (torch._dynamo keeps references
    # to a group that exists when it is imported).
    importlib.import_module("torch._dynamo")
    # A compiled run recompiling past dynamo's limit fails instead of running eagerly from
    # then on, silently; each run starts with empty caches, as in a process of its own.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    store, rank, world_size = next(dist.rendezvous("env://"))
    backend = os.environ.get("FASTLLM_DISTRIBUTED_BACKEND", "gloo")
    for index, (name, arguments) in enumerate(content["runs"].items()):
        group_store = dist.PrefixStore(f"run_{index}", store)
        dist.init_process_group(backend, store=group_store, rank=rank, world_size=world_size)
        torch._dynamo.reset()
        # A warning shows in each run, as in a process of its own (not once per location).
        with _output_to(directory / f"{name}.rank{rank}"), warnings.catch_warnings():
            try:
                code = main(arguments) if isinstance(arguments, list) else _script(name, arguments)
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 2
            except BaseException:  # a bug: its traceback goes to the run's stderr
                traceback.print_exc()
                code = 1
        if code == 0 and dist.is_initialized():  # a run that left its group (not train)
            dist.barrier()
            dist.destroy_process_group()
        (directory / f"{name}.rank{rank}.code").write_text(str(code))
        if code != 0:
            return code
    return 0


def _script(name: str, source: str) -> int:
    exec(compile(source, f"<{name}>", "exec"), {"__name__": "__main__"})
    return 0


@contextlib.contextmanager
def _output_to(stem: Path) -> Iterator[None]:
    """File descriptors 1 and 2 to STEM.stdout and STEM.stderr: all the run writes goes there,
    also through streams bound before (the progress line's sys.stderr) and from C++."""
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    try:
        for fd, kind in ((1, "stdout"), (2, "stderr")):
            with Path(f"{stem}.{kind}").open("w") as file:
                os.dup2(file.fileno(), fd)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)


if __name__ == "__main__":
    sys.exit(run_in_sequence(Path(sys.argv[1])))
