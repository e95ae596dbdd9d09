"""`fastllm train` through the command line on real data: resume, preemption, exports. The runs
go through `fastllm.cli.main` in this process (`in_process`) unless the test is about the
process itself (a signal, a warning on stderr) or about a separate script."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

import fastllm
from tests.conftest import ROOT
from tests.data.conftest import run_cli as in_process
from tests.test_cli import fastllm as run_cli
from tests.torchrun import torchrun
from tests.training.conftest import train_arguments


def losses(experiment: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (experiment / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def assert_same_losses(reference: Path, experiment: Path, steps: int, rel: float) -> None:
    """Both runs logged the losses of steps 1 … `steps`, equal within `rel`."""
    expected, got = losses(reference), losses(experiment)
    assert sorted(got) == sorted(expected) == list(range(1, steps + 1))
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=rel), step


def assert_two_ranks_match_one_process(
    dataset: Path, tmp_path: Path, overrides: tuple[str, ...], layout: tuple[str, ...]
) -> None:
    """Ten steps of `overrides` in one process and on two ranks with `layout` on top: the same
    losses within 1e-2 (bf16). The GPU layout tests' comparison."""
    runs = {"single": (), "split": layout}
    for name, extra in runs.items():
        arguments = train_arguments(dataset, tmp_path / name, *overrides, "training.train_iters=10")
        result = torchrun(2, *arguments, *extra) if extra else run_cli(*arguments)
        assert result.returncode == 0, result.stderr
    assert_same_losses(tmp_path / "single", tmp_path / "split", 10, rel=1e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resume_reproduces_the_uninterrupted_losses_bit_for_bit(
    dataset: Path, tmp_path: Path, dtype: str
) -> None:
    # bfloat16: the masters are held split (the weights and their low halves) and saved whole.
    options = (f"model.distributed.training_dtype={dtype}",)
    straight = tmp_path / "straight"
    result = in_process(*train_arguments(dataset, straight, "training.train_iters=8", *options))
    assert result.returncode == 0, result.stderr
    interrupted = tmp_path / "interrupted"
    result = in_process(*train_arguments(dataset, interrupted, "training.train_iters=4", *options))
    assert result.returncode == 0, result.stderr
    assert (interrupted / "checkpoint" / "4" / "manifest.json").is_file()
    result = in_process(*train_arguments(dataset, interrupted, "training.train_iters=8", *options))
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stdout
    expected = losses(straight)
    assert sorted(expected) == list(range(1, 9))
    assert losses(interrupted) == expected
    assert expected[8] < expected[1], "the loss falls"


def test_sigterm_writes_a_checkpoint_and_exits_143(dataset: Path, tmp_path: Path) -> None:
    experiment = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "fastllm.cli",
        *train_arguments(dataset, experiment, "training.train_iters=100000"),
    ]
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while not (experiment / "metrics.jsonl").is_file() or not losses(experiment):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 143, err  # 128 + SIGTERM: `train && convert` stops here
    assert "stopped by SIGTERM" in out
    (checkpoint,) = (experiment / "checkpoint").iterdir()
    assert (checkpoint / "manifest.json").is_file()
    assert int(checkpoint.name) == max(losses(experiment))


def test_a_corrupt_newest_checkpoint_is_skipped_with_a_warning(
    dataset: Path, tmp_path: Path
) -> None:
    experiment = tmp_path / "run"
    args = train_arguments(
        dataset, experiment, "training.train_iters=4", "training.checkpoint.interval=2"
    )
    assert in_process(*args).returncode == 0
    newest = experiment / "checkpoint" / "4"
    data = next(newest.glob("rank_*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF
    data.write_bytes(bytes(raw))
    (experiment / "checkpoint" / ".6.partial").mkdir()  # a writer killed mid-checkpoint
    result = run_cli(
        *train_arguments(
            dataset, experiment, "training.train_iters=5", "training.checkpoint.interval=2"
        )
    )
    assert result.returncode == 0, result.stderr
    assert "checkpoint/2 (step 2)" in result.stdout
    assert str(data.name) in result.stderr, "the warning names the bad file"


def test_export_converts_to_hugging_face_and_matches_load_model(
    dataset: Path, tmp_path: Path
) -> None:
    experiment = tmp_path / "run"
    result = in_process(
        *train_arguments(
            dataset,
            experiment,
            "training.train_iters=3",
            "training.export.interval=3",
            "training.export.format=distributed",
        )
    )
    assert result.returncode == 0, result.stderr
    export = experiment / "export" / "3"
    assert (export / "manifest.json").is_file()
    hf = tmp_path / "hf"
    result = in_process(
        "convert",
        "gpt",
        "input.format=distributed",
        f"input.path={export}",
        "output.type=starcoder2",
        f"output.path={hf}",
    )
    assert result.returncode == 0, result.stderr
    ours = fastllm.load_model(export)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    ids = torch.randint(0, 512, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)


def test_bad_config_is_rejected_before_any_work(dataset: Path, tmp_path: Path) -> None:
    experiment = tmp_path / "run"
    result = in_process(
        *train_arguments(tmp_path / "missing", experiment, "training.train_iters=2")
    )
    assert result.returncode == 2
    assert "data.path[0]" in result.stderr and "no such dataset" in result.stderr
    assert not experiment.exists()
    result = in_process(*train_arguments(dataset, experiment, "optimizer.learning_rate.base=-1"))
    assert result.returncode == 2
    assert "optimizer.learning_rate.base: must be non-negative" in result.stderr
    assert not experiment.exists()


def test_a_dataset_with_more_tokens_than_the_model_is_refused(
    dataset: Path, tmp_path: Path
) -> None:
    experiment = tmp_path / "run"
    arguments = train_arguments(dataset, experiment, "model.base_model.vocab_size=256")
    result = in_process(*arguments)
    assert result.returncode != 0
    assert "data.path[0]" in result.stderr and "vocab_size is 256" in result.stderr
    assert "512-token tokenizer" in result.stderr


def test_custom_loop_example_runs(dataset: Path, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "FASTLLM_EXAMPLE_DATA": str(dataset),
        "FASTLLM_EXAMPLE_DIR": str(tmp_path / "custom"),
    }
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "custom_loop.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "loss" in result.stdout
    assert (tmp_path / "custom" / "checkpoint" / "3" / "manifest.json").is_file()
    shutil.rmtree(tmp_path / "custom")


def test_the_final_checkpoint_can_be_left_out(dataset: Path, tmp_path: Path) -> None:
    experiment = tmp_path / "run"
    arguments = train_arguments(
        dataset, experiment, "training.train_iters=2", "training.checkpoint.at_end=false"
    )
    result = in_process(*arguments)
    assert result.returncode == 0, result.stderr
    assert sorted(losses(experiment)) == [1, 2]
    assert not list((experiment / "checkpoint").glob("[0-9]*"))


def test_profile_writes_a_trace_and_a_table_of_the_chosen_steps(
    dataset: Path, tmp_path: Path
) -> None:
    experiment = tmp_path / "run"
    arguments = train_arguments(
        dataset, experiment, "training.train_iters=4",
        "training.profile.step=2", "training.profile.steps=2",
    )  # fmt: skip
    result = in_process(*arguments)
    assert result.returncode == 0, result.stderr
    trace = json.loads((experiment / "profile" / "rank_0.json").read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert any("aten::mm" in name or "aten::addmm" in name for name in names)
    assert "Self CPU" in (experiment / "profile" / "rank_0.txt").read_text()
    assert sorted(losses(experiment)) == [1, 2, 3, 4]


def test_a_bfloat16_export_holds_the_fp32_masters(dataset: Path, tmp_path: Path) -> None:
    # Split masters are joined when written: the export is their fp32 values, bit for bit.
    from fastllm.training import state
    from tests.training.test_training_options import trainer

    run = trainer(dataset, tmp_path / "run", "model.distributed.training_dtype=bfloat16")
    run.engine.train_step(next(iter(run.data_loader())))
    assert all(
        shard.master_low is not None for shard in run.engine.stages.dense.buffers.shards.values()
    )
    state.export(run, tmp_path / "export", "distributed")
    run.wait_for_checkpoints()  # written in the background, as checkpoints are
    exported = dict(fastllm.load_model(tmp_path / "export").named_parameters())
    buffers = run.engine.stages.dense.buffers
    for index, name in enumerate(buffers.names):
        stage, offset, numel = buffers.layout.parameter(index)
        start, _ = buffers.layout.shard_range(stage, 0)  # one process: the whole stage
        masters = buffers.shards[stage].master_values(offset - start, offset - start + numel)
        assert exported[name].dtype == torch.float32
        assert torch.equal(exported[name].detach().reshape(-1), masters), name
