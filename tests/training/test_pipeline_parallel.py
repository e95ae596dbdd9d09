"""Pipeline parallelism under torchrun (Gloo, fp32) against the single-process run of the same
global batch and accumulation: losses (validation included) and final weights within 1e-5
relative over 10 steps, with looped and plain placements, breadth- and depth-first orders,
sequences in pieces (micro-sequences), a tied head on another rank than its embedding, data
parallelism at every ZeRO stage, tensor parallelism, and checkpoints that move between
pipeline sizes."""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.data.conftest import run_cli
from tests.training.conftest import Launched, Layout, Script, train_arguments
from tests.training.test_tensor_parallel import GEMMA3, assert_same_run, metric

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
TENSOR_2 = (  # the 3-D layout leaves out the debug check
    "model.distributed.tensor_parallel=2",
    "model.distributed.sequence_tensor_parallel=true",
    "model.multi_stage.debug_tensor_parallel=true",
)
PP2 = {
    # Four stages looped over two ranks; the head (stage 3, rank 1) is tied to the embedding
    # (stage 0, rank 0).
    "looped-breadth-first-tied-head": (),
    # Two layers per stage, one stage per rank, in 1F1B order.
    "two-layers-per-stage-depth-first": (
        "model.multi_stage.layers_per_stage=2",
        "schedule.order=depth_first",
    ),
    # The looped placement with each sequence in four pieces, each a unit of the schedule
    # (validation too); the breadth-first test of tests/training/test_micro_sequences.py adds
    # document masking and the depth-first order.
    "looped-breadth-first-four-pieces": ("schedule.micro_batch_splits=4",),
}


def arguments(dataset: Path, run: Path, *overrides: str) -> list[str]:
    return train_arguments(dataset, run, f"data.validation_path=[{dataset}]", *COMMON, *overrides)


@pytest.fixture(scope="module")
def reference(dataset: Path, one_process: Callable[..., Path]) -> Path:
    """The single-process run (4 micro-batches of 2 accumulated, tied head)."""
    return one_process(f"data.validation_path=[{dataset}]", *COMMON)


def layouts(
    dataset: Path, one_process: Callable[..., Path], root: Path
) -> dict[str, Layout | Script]:
    """The layouts of this module (trained for the fixture `launched`, see conftest.py)."""
    reference = one_process(f"data.validation_path=[{dataset}]", *COMMON)
    pipeline = (f"data.validation_path=[{dataset}]", *COMMON, *PIPELINE_2)
    two_per_data_rank = "schedule.breadth_first_micro_batches=2"  # 2 × 2 per data rank
    return {
        **{
            f"pp2xdp2-zero{stage}": Layout(
                4, (*pipeline, two_per_data_rank, f"model.multi_stage.zero_stage={stage}")
            )
            for stage in (1, 2, 3)
        },
        "pp2xtp2": Layout(4, (*pipeline, *TENSOR_2)),
        "pp2xtp2-gemma3": Layout(4, (*pipeline, *TENSOR_2, *GEMMA3)),
        "pp2xtp2xdp2-zero3": Layout(
            8, (*pipeline, *TENSOR_2[:2], "model.multi_stage.zero_stage=3", two_per_data_rank)
        ),
        **{f"pp2-{name}": Layout(2, (*pipeline, *overrides)) for name, overrides in PP2.items()},
        # The one process's step-5 checkpoint resumed on two pipeline ranks.
        "one-process-resumed-on-pp2": Layout(2, pipeline, reference / "checkpoint" / "5"),
        "runner-trace": runner_trace(dataset, root / "runner-trace"),
    }


def assert_same_validation(reference: Path, run: Path) -> None:
    import json

    def validation(path: Path) -> dict[int, float]:
        records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["validation_loss"] for r in records if "validation_loss" in r}

    expected, got = validation(reference), validation(run)
    assert sorted(got) == [5, 10]
    for step, value in got.items():
        assert value == pytest.approx(expected[step], rel=1e-5), step


def test_gemma3_style_model_on_pipeline_and_tensor_ranks_matches_one_process(
    dataset: Path, tmp_path: Path, one_process: Callable[..., Path], launched: dict[str, Launched]
) -> None:
    """Its sliding and global blocks (their windows and rotaries) split over two stages; its
    zero-centered norms (1 + weight, replicated) and scaled embeddings over two tensor ranks
    with sequence parallelism. Its export, converted to gemma3_text, runs in transformers as
    in fastllm."""
    import torch
    import transformers

    import fastllm
    from tests.model.test_parity import relative_error

    reference = one_process(f"data.validation_path=[{dataset}]", *COMMON, *GEMMA3)
    run = launched["pp2xtp2-gemma3"].succeeded()
    assert_same_run(reference, run)
    assert_same_validation(reference, run)
    expected, got = metric(reference, "grad_norm"), metric(run, "grad_norm")
    assert got == pytest.approx(expected, rel=1e-5)
    export, hf = run / "export" / "10", tmp_path / "hf"
    result = run_cli(
        "convert", "input.format=distributed", f"input.path={export}",
        "output.format=gemma3_text", f"output.path={hf}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    input_ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ours = fastllm.load_model(export)(input_ids)
        assert relative_error(ours, theirs(input_ids).logits) <= 1e-5


@pytest.mark.parametrize("name", PP2)
def test_two_pipeline_ranks_match_one_process(
    dataset: Path, tmp_path: Path, reference: Path, launched: dict[str, Launched], name: str
) -> None:
    run = launched[f"pp2-{name}"].succeeded()
    assert "pipeline parallel 2" in launched[f"pp2-{name}"].result.stdout
    assert_same_run(reference, run)
    assert_same_validation(reference, run)
    if name != "looped-breadth-first-tied-head":
        return
    # Its step-5 checkpoint resumes on one process, and the one process's on two pipeline
    # ranks, with the uninterrupted run's losses.
    on_one = tmp_path / "on_one"
    shutil.copytree(run / "checkpoint" / "5", on_one / "checkpoint" / "5")
    result = run_cli(*arguments(dataset, on_one))
    assert result.returncode == 0, result.stderr
    on_two = launched["one-process-resumed-on-pp2"]
    for resumed in (result, on_two.result):
        assert "resumed from" in resumed.stdout
    assert_same_run(reference, on_one, first_step=6)
    assert_same_run(reference, on_two.succeeded(), first_step=6)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_pipeline_and_data_parallel_match_one_process(
    reference: Path, launched: dict[str, Launched], zero_stage: int
) -> None:
    run = launched[f"pp2xdp2-zero{zero_stage}"]
    assert f"data parallel 2, ZeRO-{zero_stage}" in run.result.stdout
    assert_same_run(reference, run.succeeded())


def test_pipeline_and_tensor_parallel_match_one_process(
    reference: Path, launched: dict[str, Launched]
) -> None:
    assert "tensor parallel 2" in launched["pp2xtp2"].result.stdout
    assert_same_run(reference, launched["pp2xtp2"].succeeded())


def runner_trace(dataset: Path, directory: Path) -> Script:
    """Each rank's trace of one step's ops, against the program the simulator times for it
    (ZeRO-3 over two data ranks: gathers and releases included); a rank that matches leaves
    rank_R.ok in `directory`."""
    source = textwrap.dedent(
        f"""
        from pathlib import Path
        from fastllm.config import TrainerConfig, load_config
        from fastllm.engine.schedule.simulator import programs_for
        from fastllm.training.trainer import Trainer
        overrides = {arguments(dataset, directory / "run", *PIPELINE_2)[3:]!r} + [
            "model.multi_stage.zero_stage=3", "schedule.breadth_first_micro_batches=2",
        ]
        config = load_config(TrainerConfig, ["examples/tiny.yaml"], overrides)
        trainer = Trainer(config)
        trainer.engine.runner.trace = []
        loader = trainer.data_loader()
        trainer.engine.train_step(next(iter(loader)))
        rank = trainer.engine.mesh.pipeline.rank
        expected = programs_for(config, world_size=4)[rank].ops
        assert [str(op) for op in trainer.engine.runner.trace] == [str(op) for op in expected]
        assert any(op.kind == "gather" for op in expected)
        Path({str(directory)!r}, f"rank_{{trainer.distributed.rank}}.ok").touch()
        """
    )
    return Script(4, source)


def test_each_rank_runs_its_program_as_the_schedule_has_it(
    launched: dict[str, Launched],
) -> None:
    """The runner executes exactly the ops of the program the simulator times."""
    run = launched["runner-trace"]
    assert run.result.returncode == 0, run.result.stderr
    ok = sorted(p.name for p in run.experiment.glob("*.ok"))
    assert ok == [f"rank_{r}.ok" for r in range(4)]


def test_pipeline_tensor_and_data_parallel_at_zero3_match_one_process(
    reference: Path, launched: dict[str, Launched]
) -> None:
    run = launched["pp2xtp2xdp2-zero3"]
    assert (
        "pipeline parallel 2 (4 stages, breadth-first), data parallel 2, ZeRO-3"
        in run.result.stdout
    )
    assert_same_run(reference, run.succeeded())
