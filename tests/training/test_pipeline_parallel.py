"""Pipeline parallelism under torchrun (Gloo, fp32) against the single-process run of the same
global batch and accumulation: losses (validation included) and final weights within 1e-5
relative over 10 steps, with looped and plain placements, breadth- and depth-first orders,
sequences in pieces (micro-sequences), a tied head on another rank than its embedding, data
parallelism at every ZeRO stage, tensor parallelism, and checkpoints that move between
pipeline sizes."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from tests.test_cli import fastllm as run_cli
from tests.torchrun import torchrun, torchrun_script
from tests.training.conftest import train_arguments
from tests.training.test_tensor_parallel import assert_same_run

COMMON = (
    "model.base_model.transformer.num_layers=4",
    "training.train_iters=10",
    "training.export.interval=10",
    "training.export.format=distributed",
    "training.checkpoint.interval=5",
    "training.validation.interval=5",
    "training.validation.iterations=1",
    "batch.batch_size=8",
)
PIPELINE_2 = ("model.distributed.pipeline_parallel=2", "schedule.breadth_first_micro_batches=4")


def arguments(dataset: Path, run: Path, *overrides: str) -> list[str]:
    return train_arguments(dataset, run, f"data.validation_path=[{dataset}]", *COMMON, *overrides)


@pytest.fixture(scope="module")
def reference(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The single-process run (4 micro-batches of 2 accumulated, tied head)."""
    run = tmp_path_factory.mktemp("reference") / "run"
    with pytest.MonkeyPatch.context() as patch:  # set up before the autouse fixture runs
        patch.delenv("TRITON_INTERPRET", raising=False)
        result = run_cli(*arguments(dataset, run))
    assert result.returncode == 0, result.stderr
    return run


def assert_same_validation(reference: Path, run: Path) -> None:
    import json

    def validation(path: Path) -> dict[int, float]:
        records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["validation_loss"] for r in records if "validation_loss" in r}

    expected, got = validation(reference), validation(run)
    assert sorted(got) == [5, 10]
    for step, value in got.items():
        assert value == pytest.approx(expected[step], rel=1e-5), step


@pytest.mark.parametrize(
    "overrides",
    [
        # Four stages looped over two ranks; the head (stage 3, rank 1) is tied to the
        # embedding (stage 0, rank 0).
        (),
        # Two layers per stage, one stage per rank, in 1F1B order.
        ("model.multi_stage.layers_per_stage=2", "schedule.order=depth_first"),
        # The looped placement with each sequence in four pieces, each a unit of the schedule
        # (validation too); the breadth-first test of tests/training/test_micro_sequences.py
        # adds document masking and the depth-first order.
        ("schedule.micro_batch_splits=4",),
    ],
    ids=[
        "looped-breadth-first-tied-head",
        "two-layers-per-stage-depth-first",
        "looped-breadth-first-four-pieces",
    ],
)
def test_two_pipeline_ranks_match_one_process(
    dataset: Path, tmp_path: Path, reference: Path, overrides: tuple
) -> None:
    run = tmp_path / "pp2"
    result = torchrun(2, *arguments(dataset, run, *PIPELINE_2, *overrides))
    assert result.returncode == 0, result.stderr
    assert "pipeline parallel 2" in result.stdout
    assert_same_run(reference, run)
    assert_same_validation(reference, run)
    if overrides:
        return
    # Its step-5 checkpoint resumes on one process, and the one process's on two pipeline
    # ranks, with the uninterrupted run's losses.
    for source, target, ranks in ((run, "on_one", 1), (reference, "on_two", 2)):
        resumed = tmp_path / target
        (resumed / "checkpoint").mkdir(parents=True)
        shutil.copytree(source / "checkpoint" / "5", resumed / "checkpoint" / "5")
        extra = PIPELINE_2 if ranks == 2 else ()
        args = arguments(dataset, resumed, *extra)
        result = torchrun(2, *args) if ranks == 2 else run_cli(*args)
        assert result.returncode == 0, result.stderr
        assert "resumed from" in result.stdout
        assert_same_run(reference, resumed, first_step=6)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_pipeline_and_data_parallel_match_one_process(
    dataset: Path, tmp_path: Path, reference: Path, zero_stage: int
) -> None:
    run = tmp_path / "pp2xdp2"
    zero = f"model.multi_stage.zero_stage={zero_stage}"
    batches = "schedule.breadth_first_micro_batches=2"  # 2 × 2 per data rank
    result = torchrun(4, *arguments(dataset, run, *PIPELINE_2, batches, zero))
    assert result.returncode == 0, result.stderr
    assert f"data parallel 2, ZeRO-{zero_stage}" in result.stdout
    assert_same_run(reference, run)


def test_pipeline_and_tensor_parallel_match_one_process(
    dataset: Path, tmp_path: Path, reference: Path
) -> None:
    run = tmp_path / "pp2xtp2"
    tensor = (
        "model.distributed.tensor_parallel=2",
        "model.distributed.sequence_tensor_parallel=true",
        "model.multi_stage.debug_tensor_parallel=true",
    )
    result = torchrun(4, *arguments(dataset, run, *PIPELINE_2, *tensor))
    assert result.returncode == 0, result.stderr
    assert "tensor parallel 2" in result.stdout
    assert_same_run(reference, run)


def test_each_rank_runs_its_program_as_the_schedule_has_it(dataset: Path, tmp_path: Path) -> None:
    """The runner executes exactly the ops of the program the simulator times (ZeRO-3 over
    two data ranks: gathers and releases included)."""
    script = textwrap.dedent(
        f"""
        import json, sys
        from pathlib import Path
        from fastllm.config import TrainerConfig, load_config
        from fastllm.engine.pipeline.simulator import programs_for
        from fastllm.training.trainer import Trainer
        overrides = {arguments(dataset, tmp_path / "run", *PIPELINE_2)[3:]!r} + [
            "model.multi_stage.zero_stage=3", "schedule.breadth_first_micro_batches=2",
        ]
        config = load_config(TrainerConfig, ["examples/tiny.yaml"], overrides)
        trainer = Trainer(config)
        trainer.pipeline.trace = []
        loader = trainer.data_loader()
        trainer.train_step(next(iter(loader)))
        rank = trainer.mesh.pipeline.rank
        expected = programs_for(config, world_size=4)[rank].ops
        assert [str(op) for op in trainer.pipeline.trace] == [str(op) for op in expected]
        assert any(op.kind == "gather" for op in expected)
        Path({str(tmp_path)!r}, f"rank_{{trainer.distributed.rank}}.ok").touch()
        """
    )
    result = torchrun_script(4, script)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.glob("*.ok")) == [f"rank_{r}.ok" for r in range(4)]


def test_pipeline_tensor_and_data_parallel_at_zero3_match_one_process(
    dataset: Path, tmp_path: Path, reference: Path
) -> None:
    run = tmp_path / "pp2xtp2xdp2"
    layout = (
        "model.distributed.tensor_parallel=2",
        "model.distributed.sequence_tensor_parallel=true",
        "model.multi_stage.zero_stage=3",
        "schedule.breadth_first_micro_batches=2",
    )
    result = torchrun(8, *arguments(dataset, run, *PIPELINE_2, *layout))
    assert result.returncode == 0, result.stderr
    assert "pipeline parallel 2 (4 stages, breadth-first), data parallel 2, ZeRO-3" in result.stdout
    assert_same_run(reference, run)
