"""`fastllm train`'s exit codes: a stop by signal after its checkpoint (130, 143, also on every
rank of torchrun and in the middle of a validation), and one line for what the input or the
machine got wrong."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fastllm.checkpoint.safetensors_io import ShardedWriter
from fastllm.training.trainer import Stopped
from tests.conftest import ROOT
from tests.data.conftest import run_cli
from tests.training.conftest import train_arguments
from tests.training.test_training_options import trainer

LONG = "training.train_iters=100000"


def start(command: list[str], experiment: Path) -> subprocess.Popen[str]:
    """`command` started, once it logged its first step."""
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    metrics = experiment / "metrics.jsonl"
    while not metrics.is_file() or not metrics.read_text().strip():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.2)
    return process


def terminated(process: subprocess.Popen[str]) -> tuple[str, str, float]:
    """`process` sent SIGTERM: its stdout, stderr and the seconds it took to exit (killed
    after 30)."""
    process.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    try:
        out, err = process.communicate(timeout=30)
    finally:
        process.kill()
    return out, err, time.monotonic() - sent


def committed_steps(experiment: Path) -> list[int]:
    directory = experiment / "checkpoint"
    return [int(c.name) for c in directory.iterdir() if (c / "manifest.json").is_file()]


def test_sigint_exits_130_after_committing_a_checkpoint(dataset: Path, tmp_path: Path) -> None:
    experiment = tmp_path / "run"
    command = [sys.executable, "-m", "fastllm.cli", *train_arguments(dataset, experiment, LONG)]
    process = start(command, experiment)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "stopped by SIGINT" in out and "Traceback" not in err
    (step,) = committed_steps(experiment)
    logged = [json.loads(line)["step"] for line in (experiment / "metrics.jsonl").open()]
    assert step == max(logged)


def test_sigterm_during_a_long_validation_stops_within_seconds(
    dataset: Path, tmp_path: Path
) -> None:
    # Each second step validates on 1000 batches (two minutes on a CI core): the stop is
    # taken between two of its micro-batches, and step 2 is checkpointed.
    experiment = tmp_path / "run"
    arguments = train_arguments(
        dataset, experiment, LONG, "training.validation.interval=2",
        "training.validation.iterations=1000", f"data.validation_path=[{dataset}]",
    )  # fmt: skip
    process = start([sys.executable, "-m", "fastllm.cli", *arguments], experiment)
    time.sleep(2)  # step 2 and into its validation
    _, err, seconds = terminated(process)
    assert seconds < 30
    assert process.returncode == 143, err
    assert committed_steps(experiment) == [2]


def test_sigterm_while_the_sampling_index_is_built_exits_143_within_seconds(
    dataset: Path, tmp_path: Path
) -> None:
    # 120M samples take 5 s and more to index; the signal comes just after the model is
    # built, while the index is being built, and stops it within about 50 ms (then the
    # process exits, which takes most of a second).
    experiment = tmp_path / "run"
    arguments = train_arguments(dataset, experiment, "training.train_iters=30000000")
    process = subprocess.Popen(
        [sys.executable, "-m", "fastllm.cli", *arguments],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    described = process.stdout.readline()  # the model, printed before the index is built
    assert "parameters" in described, process.communicate()
    time.sleep(0.3)
    out, err, seconds = terminated(process)
    assert process.returncode == 143, err
    assert seconds < 4.0  # under 2.5 on an idle 2-core machine; the whole index takes 5+
    assert "stopped by SIGTERM at step 0; nothing new to save" in out, out
    assert not list(experiment.glob("cache/sampling/sampling_*")), "no index was cached"


def test_sigterm_to_every_rank_of_torchrun_exits_143_without_a_traceback(
    dataset: Path, tmp_path: Path
) -> None:
    # As a scheduler stops a job (SLURM signals each of its processes): the ranks, which got
    # it at different moments, stop after the same step, checkpoint it and exit 143. The
    # ranks run tests.run_in_sequence, which keeps each one's exit code and stderr.
    experiment, launch = tmp_path / "run", tmp_path / "launch"
    launch.mkdir()
    spec = launch / "runs.json"
    runs = {"train": train_arguments(dataset, experiment, LONG)}
    spec.write_text(json.dumps({"directory": str(launch), "runs": runs}))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--no-python", sys.executable, "-m", "tests.run_in_sequence", str(spec),
    ]  # fmt: skip
    torchrun = start(command, experiment)
    ranks = Path(f"/proc/{torchrun.pid}/task/{torchrun.pid}/children").read_text().split()
    assert len(ranks) == 2
    for rank in ranks:
        os.kill(int(rank), signal.SIGTERM)
    _, err = torchrun.communicate(timeout=120)
    assert torchrun.returncode != 0, err  # torchrun reports ranks that failed
    for rank in range(2):
        stderr = (launch / f"train.rank{rank}.stderr").read_text()
        assert (launch / f"train.rank{rank}.code").read_text() == "143", stderr
        assert "Traceback" not in stderr, stderr
    assert len(committed_steps(experiment)) == 1


def test_an_experiment_dir_under_a_file_is_refused_naming_it(dataset: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    result = run_cli(*train_arguments(dataset, tmp_path / "file" / "run", "training.train_iters=1"))
    assert result.returncode == 2
    assert f"run.experiment_dir: {tmp_path / 'file'} is a file" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_full_disk_under_metrics_exits_1_naming_the_file(dataset: Path, tmp_path: Path) -> None:
    experiment = tmp_path / "run"
    experiment.mkdir()
    (experiment / "metrics.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    result = run_cli(*train_arguments(dataset, experiment, "training.train_iters=2"))
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert (
        last
        == f"fastllm: error: cannot write {experiment / 'metrics.jsonl'}: No space left on device"
    )
    assert "Traceback" not in result.stderr


def test_a_sampling_index_beyond_the_memory_exits_1_in_one_line(
    dataset: Path, tmp_path: Path
) -> None:
    """Ten billion sequences a step (in 10,000 micro-batches) pass the size bounds, but their
    sampling index does not fit this machine: one line and 1, not an abort in the Rust
    allocator (134)."""
    result = run_cli(
        *train_arguments(
            dataset,
            tmp_path / "run",
            "training.train_iters=1",
            "training.validation.iterations=1",
            "batch.batch_size=10000000000",
            "batch.micro_batch_size=1000000",
        )
    )
    assert result.returncode == 1, result.stderr
    assert "data.path: the sampling index of 10,000,000,000 samples needs about" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_signal_during_an_export_abandons_it_and_checkpoints_the_step(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The signal lands while the first tensor is written (a 7B model's export takes minutes):
    # the export stops before its next tensor, leaves nothing, and the step is checkpointed.
    experiment = tmp_path / "run"
    run = trainer(
        dataset, experiment, LONG, "training.export.interval=1", "training.export.format=starcoder2"
    )
    add = ShardedWriter.add
    written = []

    def add_then_signal(writer: ShardedWriter, name: str, tensor: torch.Tensor) -> None:
        add(writer, name, tensor)
        written.append(name)
        if len(written) == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(ShardedWriter, "add", add_then_signal)
    stopped = run.fit()
    assert stopped == Stopped(signal.SIGTERM, 1)
    assert len(written) == 1, "no tensor written after the signal"
    assert list((experiment / "export").iterdir()) == []
    assert committed_steps(experiment) == [1]
