"""`make demo`: the walk-through on the built-in example, through the public command line.

Each step runs a real `fastllm` command and shows it first. Today the pipeline covers the
config stage; prepare, train, convert and generate join it as they land.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(*arguments: str) -> None:
    command = [sys.executable, "-m", "fastllm.cli", *arguments]
    print(f"\n$ fastllm {shlex.join(arguments)}", flush=True)
    subprocess.run(command, check=True)


def main() -> None:
    if not EXAMPLES.is_dir():
        sys.exit(f"{EXAMPLES}: examples not found (run the demo from a source checkout)")
    print("fastllm demo: the config stage of the pipeline (prepare, train, convert and generate")
    print("are not implemented yet).")
    for example in sorted(EXAMPLES.glob("*.yaml")):
        _run("config", "validate", "-c", os.path.relpath(example))
    tiny = EXAMPLES / "tiny.yaml"
    _run("config", "show", "-c", os.path.relpath(tiny), "training.train_iters=5")


if __name__ == "__main__":
    main()
