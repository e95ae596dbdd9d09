"""The user guide's walk-throughs run as written. Every ```bash block of docs/quickstart.md is read
from the Markdown itself and run, in order, in one shell in a fresh directory on the CPU, so
editing the page changes what is tested. docs/fine-tuning.md's blocks are run by
tests/training/test_sft_flow.py (on a tiny model); here every line of them is checked to be
either run there or listed below with the reason it is not."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT
from tests.docs.pages import DOCS, bash_blocks
from tests.training.test_sft_flow import page_commands

BLOCK_MARK = "@@@ docs block"

# The only differences between the quick start's shell and yours: `fastllm` and `python` are
# the interpreter running the tests (its fastllm is the checkout's), and the directory is a
# fresh one holding a copy of examples/.
QUICKSTART_SHIMS = {
    "fastllm": f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m fastllm.cli "$@"\n',
    "python": f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n',
}

# Commands of the quick start whose output the page shows word for word (the others depend on
# the Python installation and the CPU).
EXACT_OUTPUTS = ("fastllm tokenizer train", "fastllm convert")

# Lines of docs/fine-tuning.md's blocks that no test runs, and why.
FINE_TUNING_NOT_RUN = {
    'hf download meta-llama/Llama-3.2-1B-Instruct --local-dir hf/Llama-3.2-1B-Instruct --exclude "original/*"': (
        "downloads a gated 1B model; test_sft_flow writes a tiny Llama with the same tokenizer "
        "in its place"
    ),
}


def test_the_quickstart_page_runs_as_written(tmp_path: Path) -> None:
    page = DOCS / "quickstart.md"
    blocks = bash_blocks(page)
    assert len(blocks) >= 6, "the quick start lost its steps"
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    shims = tmp_path / ".shims"
    shims.mkdir()
    for name, text in QUICKSTART_SHIMS.items():
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    script = "set -euo pipefail\n" + "".join(
        f"echo '{BLOCK_MARK} {i}'\n{block}" for i, block in enumerate(blocks)
    )
    env = {**os.environ, "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}"}
    # A user's CPU runs the kernels' torch references; the interpreter would take many minutes.
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    outputs = result.stdout.split(BLOCK_MARK)[1:]
    failed = blocks[len(outputs) - 1] if outputs else blocks[0]
    assert result.returncode == 0, f"this block failed:\n{failed}\n{result.stderr[-3000:]}"
    assert len(outputs) == len(blocks)

    # What the page says the run leaves behind is there.
    run = tmp_path / "exp" / "demo" / "run"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = next(b for b in blocks if b.startswith("fastllm train"))
    assert f"training.train_iters={steps[-1]}" in train
    assert (run / "checkpoint" / str(steps[-1]) / "manifest.json").is_file()
    assert (tmp_path / "exp" / "demo" / "hf" / "config.json").is_file()
    # The outputs the page shows for EXACT_OUTPUTS are theirs.
    shown = re.findall(
        r"^```bash\n([^`]*)^```\n\n```text\n([^`]*)^```", page.read_text(), re.MULTILINE
    )
    exact = [(command, text) for command, text in shown if command.startswith(EXACT_OUTPUTS)]
    assert len(exact) == len(EXACT_OUTPUTS)
    for command, text in exact:
        assert outputs[blocks.index(command)].split("\n", 1)[1] == text, command
    # `generate` prints the prompt and its completion.
    generate = next(i for i, b in enumerate(blocks) if b.startswith("fastllm generate"))
    prompt = shlex.split(blocks[generate])[shlex.split(blocks[generate]).index("--prompt") + 1]
    printed = outputs[generate].split("\n", 1)[1]
    assert printed.startswith(prompt) and len(printed.rstrip("\n")) > len(prompt)


def test_every_line_of_the_fine_tuning_page_is_run_or_said_not_to_be() -> None:
    run = {shlex.join(["fastllm", *command]) for command in page_commands()}
    lines = [
        line
        for block in bash_blocks(DOCS / "fine-tuning.md")
        for line in block.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    for line in lines:
        assert line in FINE_TUNING_NOT_RUN or shlex.join(shlex.split(line)) in run, (
            f"docs/fine-tuning.md runs `{line}`, which no test runs; run it in "
            "tests/training/test_sft_flow.py or list it in FINE_TUNING_NOT_RUN with the reason"
        )
    stale = FINE_TUNING_NOT_RUN.keys() - set(lines)
    assert not stale, f"FINE_TUNING_NOT_RUN lists lines the page no longer has: {stale}"
