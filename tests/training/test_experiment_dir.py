"""One run per experiment directory, and what a resumed run finds there: a lock no second run
gets (and no killed run keeps), a warning for a changed config, metrics without duplicates."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fastllm.training.experiment_lock import ExperimentLock
from tests.conftest import ROOT
from tests.data.conftest import run_cli
from tests.torchrun import torchrun_script
from tests.training.conftest import train_arguments


def logged_steps(experiment: Path) -> list[int]:
    file = experiment / "metrics.jsonl"
    if not file.is_file():
        return []
    return [json.loads(line)["step"] for line in file.read_text().splitlines()]


def test_a_second_run_on_a_busy_experiment_exits_2_and_a_killed_run_leaves_no_lock(
    dataset: Path, tmp_path: Path
) -> None:
    experiment = tmp_path / "run"
    arguments = train_arguments(dataset, experiment, "training.train_iters=100000")
    first = subprocess.Popen(
        [sys.executable, "-m", "fastllm.cli", *arguments], cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not logged_steps(experiment):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        second = run_cli(*train_arguments(dataset, experiment, "training.train_iters=2"))
        assert second.returncode == 2
        assert (
            f"run.experiment_dir: {experiment} is in use by another run "
            f"(host {socket.gethostname()}, pid {first.pid})" in second.stderr
        )
        assert not (experiment / "checkpoint").exists(), "the second run wrote nothing"
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    # The operating system released the killed run's lock: a new run gets it at once.
    ExperimentLock.acquire(experiment).release()


def test_a_resume_warns_of_changed_keys_and_logs_each_step_once(
    dataset: Path, tmp_path: Path
) -> None:
    experiment = tmp_path / "run"
    first = train_arguments(
        dataset, experiment, "training.train_iters=3", "training.checkpoint.interval=2",
        "training.checkpoint.at_end=false",
    )  # fmt: skip
    assert run_cli(*first).returncode == 0
    assert logged_steps(experiment) == [1, 2, 3]
    with (experiment / "metrics.jsonl").open("a") as file:
        file.write('{"step": 4, "loss": 3.')  # cut short by a crash
    with pytest.warns(UserWarning, match="resuming with a config") as warned:
        resumed = run_cli(
            *first, "training.train_iters=4", "optimizer.learning_rate.base=0.01", "data.prefetch=1"
        )
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    (warning,) = [str(w.message) for w in warned if "resuming with a config" in str(w.message)]
    assert "differs from the checkpoint's in optimizer.learning_rate.base (" in warning
    assert logged_steps(experiment) == [1, 2, 3, 4]


def test_identical_runs_checkpoint_the_same_cpu_random_state(dataset: Path, tmp_path: Path) -> None:
    states = []
    for name in ("a", "b"):
        torch.seed()  # a new process: torch seeds its generator from OS entropy
        experiment = tmp_path / name
        assert (
            run_cli(*train_arguments(dataset, experiment, "training.train_iters=1")).returncode == 0
        )
        with safe_open(experiment / "checkpoint" / "1" / "rank_00000.safetensors", "pt") as file:
            states.append(file.get_tensor("rng.cpu"))
    assert torch.equal(states[0], states[1])


# Every rank asks; rank 0 alone takes the lock and tells the others.
RANKS_ASK = """
from pathlib import Path
import torch.distributed as dist
from fastllm.config import ConfigError
from fastllm.training.experiment_lock import ExperimentLock
dist.init_process_group("gloo")
try:
    ExperimentLock.acquire(Path(EXPERIMENT_DIR))
except ConfigError as error:
    print(f"rank {dist.get_rank()} refused: {error}", flush=True)
dist.destroy_process_group()
"""


def test_under_torchrun_every_rank_learns_that_the_experiment_is_busy(tmp_path: Path) -> None:
    experiment = tmp_path / "run"
    held = ExperimentLock.acquire(experiment)
    try:
        result = torchrun_script(2, RANKS_ASK.replace("EXPERIMENT_DIR", repr(str(experiment))))
    finally:
        held.release()
    assert result.returncode == 0, result.stderr
    holder = f"(host {socket.gethostname()}, pid {os.getpid()})"
    for rank in (0, 1):
        assert (
            f"rank {rank} refused: run.experiment_dir: {experiment} is in use by another run "
            f"{holder}" in result.stdout
        )
