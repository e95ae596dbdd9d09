"""Distillation from a reference model (`reference_models` + a `distillation` head loss):
zero when the teacher is the student, the value a plain-torch KL gives otherwise, a teacher
larger than the student, one with fewer blocks than the student's stages refused, and two
ranks (ZeRO-3, tensor, sequence-data, expert and pipeline parallel, multi-token prediction)
and four (pipeline with ZeRO-3 data or sequence-tensor parallel) against one process."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fastllm
from fastllm.config import ConfigError, TrainerConfig, load_config
from tests.training.conftest import Launched, Layout
from tests.training.test_expert_parallel import MOE_MODEL
from tests.training.test_training_options import trainer

TEACHER_RUN = (
    "training.train_iters=4",
    "training.export.interval=4",
    "training.export.format=fastllm",
)


def distilling(teacher: Path, temperature: float = 2.0, weight: float = 0.5) -> tuple[str, ...]:
    return (
        "model.base_model.head.losses={label: {type: label, weight: 0.5}, "
        f"kd: {{type: distillation, weight: {weight}, temperature: {temperature}}}}}",
        f"reference_models.teacher.pretrained.path={teacher}",
    )


@pytest.fixture(scope="module")
def teacher(one_process: Callable[..., Path]) -> Path:
    """The tiny model trained 4 steps, exported in fastllm's format."""
    return one_process(*TEACHER_RUN) / "export" / "4"


def test_a_student_that_is_its_teacher_has_nothing_to_distil(
    dataset: Path, teacher: Path, tmp_path: Path
) -> None:
    run = trainer(
        dataset, tmp_path / "run", "training.train_iters=1",
        f"pretrained.path={teacher}", *distilling(teacher),
    )  # fmt: skip
    metrics = run.engine.train_step(next(iter(run.data_loader())))
    assert abs(metrics["kd_loss"]) < 1e-6
    assert metrics["loss"] == pytest.approx(0.5 * metrics["label_loss"], rel=1e-6)


def test_the_distillation_loss_is_the_kl_of_the_two_models_logits(
    dataset: Path, teacher: Path, tmp_path: Path
) -> None:
    run = trainer(dataset, tmp_path / "run", "training.train_iters=1", *distilling(teacher, 2.0))
    batches = next(iter(run.data_loader()))
    student = {n: p.detach().clone() for n, p in run.engine.whole_parameters()}
    metrics = run.engine.train_step(batches)

    big = fastllm.load_model(teacher)
    small = fastllm.load_model(teacher)  # the same architecture, the student's weights
    small.load_state_dict(student)
    kls, labels_all = [], []
    with torch.no_grad():
        for batch in batches:
            t = F.log_softmax(big(batch.input_ids).float() / 2.0, dim=-1)
            s = F.log_softmax(small(batch.input_ids).float() / 2.0, dim=-1)
            kls.append((t.exp() * (t - s)).sum(-1).flatten())
            labels_all.append(batch.labels.flatten())
    kl, labels = torch.cat(kls), torch.cat(labels_all)
    expected = kl[labels != -100].mean().item()
    assert metrics["kd_loss"] == pytest.approx(expected, rel=1e-4)
    assert metrics["kd_loss"] > 1e-3


def test_a_teacher_wider_than_its_student(dataset: Path, tmp_path: Path) -> None:
    wide = trainer(
        dataset, tmp_path / "wide", *TEACHER_RUN[:1], "training.train_iters=1",
        "model.base_model.transformer.hidden_size=96", "model.base_model.transformer.num_attention_heads=6",
    )  # fmt: skip
    wide.engine.train_step(next(iter(wide.data_loader())))
    from fastllm.training import state

    state.export(wide, tmp_path / "teacher", "fastllm")
    run = trainer(
        dataset, tmp_path / "run", "training.train_iters=2", *distilling(tmp_path / "teacher")
    )
    steps = iter(run.data_loader())
    first, second = (run.engine.train_step(next(steps)) for _ in range(2))
    assert first["kd_loss"] > 0 and second["kd_loss"] < first["kd_loss"]


def test_a_teacher_with_fewer_blocks_than_the_students_stages_is_refused(
    dataset: Path, teacher: Path, tmp_path: Path
) -> None:
    # Run stage by stage (breadth-first micro-batches), the student's four blocks make four
    # stages, over which the teacher's two blocks cannot be spread.
    with pytest.raises(
        ConfigError, match="2 blocks are fewer than the trained model's 4"
    ) as caught:
        trainer(
            dataset, tmp_path / "run", "model.base_model.transformer.num_layers=4",
            "schedule.breadth_first_micro_batches=2", *distilling(teacher),
        )  # fmt: skip
    assert caught.value.path == "reference_models.teacher"


def test_reference_models_and_losses_are_checked_by_name() -> None:
    base = ["examples/tiny.yaml"]
    with pytest.raises(ConfigError, match="not in reference_models") as caught:
        load_config(
            TrainerConfig, base, ["model.base_model.head.losses={kd: {type: distillation}}"]
        )
    assert caught.value.path == "model.base_model.head.losses.kd.reference_model"
    with pytest.raises(ConfigError, match="no loss") as caught:
        load_config(TrainerConfig, base, ["reference_models.teacher.pretrained.path=x"])
    assert caught.value.path == "reference_models.teacher"


LAYOUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # name: (the student's and the teacher's architecture, the layout)
    "zero3": ((), ("model.multi_stage.zero_stage=3",)),
    "tensor": (
        (),
        ("model.distributed.tensor_parallel=2", "model.distributed.sequence_tensor_parallel=true"),
    ),
    # Each rank's teacher runs on its chunk, gathering the other chunk's keys and values.
    "sequence_data": ((), ("model.distributed.sequence_data_parallel=2",)),
    # A mixture-of-experts teacher and student, each rank holding two of their four experts.
    "expert": (MOE_MODEL, ("model.distributed.expert_parallel=2",)),
    # A student and a teacher with a prediction module: the student's trains on the labels, the
    # teacher's never runs (only the student's context holds labels).
    "prediction_zero3": (
        ("model.base_model.multi_token_prediction={depth: 1}",),
        ("model.multi_stage.zero_stage=3",),
    ),
    # Each rank runs its stage of the student and of the teacher (its own three blocks spread
    # over the student's two stages, wider), the teacher's hidden states sent with the
    # student's activations.
    "pipeline": (
        (),
        ("model.distributed.pipeline_parallel=2", "schedule.breadth_first_micro_batches=2"),
    ),
    # The same on two data ranks each, the teacher's stages gathered (ZeRO-3); checkpointed.
    "pipeline_zero3": (
        (),
        (
            "model.distributed.pipeline_parallel=2",
            "model.multi_stage.zero_stage=3",
            "training.checkpoint.interval=2",
        ),
    ),
    # On two tensor ranks each, with sequence-tensor parallelism: what the stages hand on is
    # split along the sequence, the teacher's too.
    "pipeline_tensor": (
        (),
        (
            "model.distributed.pipeline_parallel=2",
            "model.distributed.tensor_parallel=2",
            "model.distributed.sequence_tensor_parallel=true",
        ),
    ),
    # pipeline_zero3's checkpoint of step 2 resumed on two pipeline ranks (the teacher loaded
    # again).
    "pipeline_resumed": ((), ("model.distributed.pipeline_parallel=2",)),
}
RANKS = {"pipeline_zero3": 4, "pipeline_tensor": 4}
RESUMES = {"pipeline_resumed": "pipeline_zero3"}
"""The layouts that resume another's checkpoint of step 2 (one of more ranks: run first)."""
BIGGER = (
    "model.base_model.transformer.num_layers=3",
    "model.base_model.transformer.hidden_size=96",
    "model.base_model.transformer.num_attention_heads=6",
)
TEACHERS = {name: BIGGER for name in LAYOUTS if name.startswith("pipeline")}
"""The teacher's architecture where it is not the student's."""
STEPS = ("training.train_iters=3",)
VALIDATED = {"pipeline"}
"""The layouts validated after the last step (the stages' forward passes alone)."""


def validating(dataset: Path, layout: str) -> tuple[str, ...]:
    if layout not in VALIDATED:
        return ()
    return (
        f"data.validation_path=[{dataset}]",
        "training.validation.interval=3",
        "training.validation.iterations=1",
    )


def teacher_of(one_process: Callable[..., Path], architecture: tuple[str, ...]) -> Path:
    return one_process(*architecture, *TEACHER_RUN) / "export" / "4"


def distilling_in(one_process: Callable[..., Path], layout: str) -> tuple[str, ...]:
    """The student's architecture and its distillation in `layout`."""
    architecture = LAYOUTS[layout][0]
    teacher = teacher_of(one_process, (*architecture, *TEACHERS.get(layout, ())))
    return (*architecture, *distilling(teacher))


def layouts(dataset: Path, one_process: Callable[..., Path], root: Path) -> dict[str, Layout]:
    return {
        f"distill_{name}": Layout(
            RANKS.get(name, 2),
            (*STEPS, *distilling_in(one_process, name), *validating(dataset, name), *layout),
            root / f"distill_{RESUMES[name]}" / "checkpoint" / "2" if name in RESUMES else None,
        )
        for name, (_, layout) in LAYOUTS.items()
    }


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_parallel_layouts_distilling_match_one_process(
    launched: dict[str, Launched], one_process: Callable[..., Path], dataset: Path, layout: str
) -> None:
    single = one_process(*STEPS, *distilling_in(one_process, layout), *validating(dataset, layout))
    run = launched[f"distill_{layout}"]
    first = 3 if layout in RESUMES else 1
    assert (first > 1) == ("resumed from" in run.result.stdout)
    # Each loss logged under its name; the gradient's norm too (AdamW's steps hardly change
    # when it is scaled).
    for key in ("loss", "label_loss", "kd_loss", "grad_norm"):
        expected, got = logged(single, key), logged(run.succeeded(), key)
        assert sorted(expected) == [1, 2, 3] and sorted(got) == list(range(first, 4))
        for step, value in got.items():
            assert value == pytest.approx(expected[step], rel=1e-5), (key, step)
    if layout in VALIDATED:
        expected, got = (
            logged(single, "validation_loss"),
            logged(run.succeeded(), "validation_loss"),
        )
        assert sorted(got) == sorted(expected) == [3]
        assert got[3] == pytest.approx(expected[3], rel=1e-5)


def logged(experiment: Path, key: str) -> dict[int, float]:
    records = [json.loads(line) for line in (experiment / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in records if key in r}
