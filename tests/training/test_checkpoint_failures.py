"""Checkpoints the machine cannot write, checkpoints that are all corrupt, and partial ones a
killed run left: one line and the right exit code, committed checkpoints untouched, no partial
directory left behind."""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterator
from pathlib import Path

from fastllm import _native
from tests.data.conftest import run_cli
from tests.model.hf_models import save_hf_model
from tests.torchrun import torchrun_script
from tests.training.conftest import train_arguments


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """Writes past `limit` bytes fail with EFBIG ("File too large") in this process, as on a
    full disk (Python ignores SIGXFSZ, so the write returns the error)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_checkpoint_that_cannot_be_written_exits_1_in_one_line_keeping_the_committed_ones(
    dataset: Path, tmp_path: Path
) -> None:
    experiment = tmp_path / "run"
    first = train_arguments(
        dataset, experiment, "training.train_iters=2", "training.checkpoint.interval=2"
    )
    assert run_cli(*first).returncode == 0
    committed = experiment / "checkpoint" / "2"
    manifest = (committed / "manifest.json").read_bytes()
    with file_size_limit(64 * 1024):  # the metrics fit, a checkpoint (~2 MB) does not
        result = run_cli(*first, "training.train_iters=4")
    assert result.returncode == 1, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("fastllm: error:")]
    assert line.startswith(f"fastllm: error: cannot write {experiment / 'checkpoint' / '4'}: ")
    assert str(experiment / "checkpoint" / ".4.partial" / "rank_00000.safetensors") in line
    assert "File too large" in line
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in (experiment / "checkpoint").iterdir()) == ["2"]
    assert (committed / "manifest.json").read_bytes() == manifest
    _native.verify_checkpoint(str(committed))


def test_an_export_or_conversion_that_cannot_be_written_exits_1_in_one_line_leaving_nothing(
    dataset: Path, tmp_path: Path
) -> None:
    experiment = tmp_path / "run"
    arguments = train_arguments(
        dataset, experiment, "training.train_iters=1", "training.checkpoint.at_end=false",
        "training.export.interval=1", "training.export.format=starcoder2",
    )  # fmt: skip
    save_hf_model("llama", tmp_path / "hf")
    convert = ["convert", "input.format=llama", f"input.path={tmp_path / 'hf'}",
               "output.format=fastllm", f"output.path={tmp_path / 'out'}"]  # fmt: skip
    with file_size_limit(64 * 1024):  # the weights (~400 KB and more) do not fit
        exported, converted = run_cli(*arguments), run_cli(*convert)
    for result, output in ((exported, experiment / "export" / "1"), (converted, tmp_path / "out")):
        assert result.returncode == 1, result.stderr
        (line,) = [line for line in result.stderr.splitlines() if "error" in line]
        assert line.startswith(f"fastllm: error: cannot write {output}: {output.parent}/.")
        assert "File too large" in line
        assert "Traceback" not in result.stderr
    assert not (experiment / "export").exists() or not any((experiment / "export").iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]


# Rank 1 cannot write its file, then rank 0 cannot write the manifest of the commit (its own
# file is small, the manifest large): every rank learns of both and nothing is left half-done.
FAILING_RANKS = """
import resource
from pathlib import Path
import torch
import torch.distributed as dist
from fastllm.checkpoint.distributed import ShardedState, Snapshot
from fastllm.checkpoint.errors import CheckpointWriteError
from fastllm.checkpoint.saver import CheckpointSaver
dist.init_process_group("gloo")
rank, root = dist.get_rank(), Path(ROOT)
saver = CheckpointSaver(rank, 2, torch.device("cpu"))

def snapshot(numel, config):
    state = ShardedState(
        specs=[("w", 2 * numel, 0, True)], shapes={"w": (2 * numel,)}, splits={"w": None},
        alignment=1, tensor_size=1, tensor_rank=0, data_size=2, data_rank=rank,
        shards={0: {"master": torch.ones(numel)}},
    )
    return Snapshot("checkpoint", state, config)

saver.save(snapshot(64, {}), root / "1")
saver.wait()
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
for name, failing_rank, numel, config in (
    ("2", 1, 16384, {}), ("3", 0, 64, {"note": "x" * 65536})
):
    if rank == failing_rank:
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, hard))
    try:
        saver.save(snapshot(numel, config), root / name)
        saver.wait()
    except CheckpointWriteError as error:
        print(f"rank {rank}: {error}", flush=True)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
dist.destroy_process_group()
"""


def test_under_torchrun_a_failed_write_or_commit_stops_every_rank_and_removes_the_partial(
    tmp_path: Path,
) -> None:
    result = torchrun_script(2, FAILING_RANKS.replace("ROOT", repr(str(tmp_path))))
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert (
            f"rank {rank}: cannot write {tmp_path / '2'}: "
            f"{tmp_path / '.2.partial' / 'rank_00001.safetensors'}: File too large"
        ) in result.stdout
        assert (
            f"rank {rank}: cannot write {tmp_path / '3'}: "
            f"{tmp_path / '.3.partial' / 'manifest.json'}: File too large"
        ) in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]
    _native.verify_checkpoint(str(tmp_path / "1"))


def test_when_every_checkpoint_is_corrupt_the_run_exits_2_listing_each_one(
    dataset: Path, tmp_path: Path
) -> None:
    experiment = tmp_path / "run"
    arguments = train_arguments(
        dataset, experiment, "training.train_iters=2", "training.checkpoint.interval=1"
    )
    assert run_cli(*arguments).returncode == 0
    damaged = []
    for step in ("1", "2"):
        data = experiment / "checkpoint" / step / "rank_00000.safetensors"
        raw = bytearray(data.read_bytes())
        raw[-5] ^= 0xFF
        data.write_bytes(bytes(raw))
        damaged.append(data)
    result = run_cli(*arguments, "training.train_iters=3")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(
        f"fastllm: error: run.experiment_dir: {experiment / 'checkpoint'}: no valid checkpoint"
    )
    for step, data in zip(("1", "2"), damaged, strict=True):
        assert f"skipped checkpoint {step}: {data}: checksum" in line
    assert "Traceback" not in result.stderr


def test_partial_checkpoints_of_a_killed_run_are_removed_at_the_next_start(
    dataset: Path, tmp_path: Path
) -> None:
    experiment = tmp_path / "run"
    left = [experiment / "checkpoint" / ".7.partial", experiment / "export" / ".5.partial"]
    for partial in left:
        partial.mkdir(parents=True)
        (partial / "rank_00000.safetensors").write_bytes(b"\0" * 1000)
    kept = experiment / "checkpoint" / "notes"  # not ours to remove
    kept.mkdir()
    arguments = train_arguments(
        dataset, experiment, "training.train_iters=1", "training.checkpoint.at_end=false"
    )
    assert run_cli(*arguments).returncode == 0
    assert not any(partial.exists() for partial in left)
    assert kept.is_dir()
