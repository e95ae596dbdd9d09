"""The lm_eval evaluator inside training (`training.evaluators.NAME.evaluator.type=lm_eval`):
the test tasks of tests/evaluation run on the model being trained at the evaluator's steps,
logged as NAME_TASK_METRIC with the numbers `fastllm evaluate` gives on the run's checkpoint
of the same step; two data-parallel ranks give the numbers of one, also with ZeRO-3, as two
pipeline ranks do (the tied head's copy of the embedding refreshed after each step), and so do
tensor, sequence-tensor, pipeline, sequence-data and expert ranks (each request's answer,
through lm-eval with its samples logged); an evaluation leaves the model training and the random generators as they
were; bad tasks are refused before step 1."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lm_eval import simple_evaluate

from fastllm.evaluation.tasks import numeric_metrics
from tests.data.conftest import run_cli
from tests.evaluation.conftest import TASKS, TASKS_DIRECTORY
from tests.training.conftest import Launched, Layout, Script, train_arguments
from tests.training.test_evaluators import records, trainer_of

EVALUATOR = "training.evaluators.tiny"
SETTINGS = (  # the evaluator's settings, as fastllm evaluate takes them too
    f"tasks={TASKS}", f"include_path={TASKS_DIRECTORY}", "max_length=48", "batch_size=3",
    "bootstrap_iters=0",
)  # fmt: skip
LM_EVAL = (  # after steps 1 and 4 (offset 1, interval 3); the checkpoint of step 4 at the end
    "training.train_iters=4", f"{EVALUATOR}.interval=3", f"{EVALUATOR}.offset=1",
    f"{EVALUATOR}.evaluator.type=lm_eval",
    *(f"{EVALUATOR}.evaluator.{setting}" for setting in SETTINGS),
)  # fmt: skip
METRICS = {
    f"tiny_{task}_{metric}"
    for task, metrics in (
        ("fastllm_multiple_choice", ("acc", "acc_norm")),
        ("fastllm_perplexity", ("word_perplexity", "byte_perplexity", "bits_per_byte")),
        ("fastllm_generation", ("exact_match",)),
    )
    for metric in metrics
}
"""What the evaluator logs: every numeric metric of each task (no standard errors without
bootstrap resamples, which the perplexities need)."""


ZERO_3 = ("model.multi_stage.zero_stage=3",)
TENSOR_PARALLEL = ("model.distributed.tensor_parallel=2",)
SEQUENCE_TENSOR_PARALLEL = (*TENSOR_PARALLEL, "model.distributed.sequence_tensor_parallel=true")
PIPELINE_PARALLEL = ("model.distributed.pipeline_parallel=2",)  # a stage (a block) a rank
SEQUENCE_DATA_PARALLEL = ("model.distributed.sequence_data_parallel=2",)
MIXTURE = (
    "model.base_model.transformer.num_experts=4",
    "model.base_model.transformer.num_experts_per_token=2",
    "model.base_model.transformer.add_linear_biases=only_attn_qkv",
)
ANSWERED = {
    "zero_3": ZERO_3,
    # Steps of breadth-first micro-batches: no forward hooks gather the stages.
    "zero_3_breadth_first": (
        *ZERO_3, "schedule.breadth_first_micro_batches=2", "batch.batch_size=8",
    ),
    "tensor_parallel": TENSOR_PARALLEL,
    "tensor_parallel_zero_3": (*TENSOR_PARALLEL, *ZERO_3),  # on four ranks: two data ranks
    "sequence_tensor_parallel": SEQUENCE_TENSOR_PARALLEL,
    "pipeline_parallel": PIPELINE_PARALLEL,
    "pipeline_parallel_zero_3": (*PIPELINE_PARALLEL, *ZERO_3),  # four ranks: two data ranks
    "pipeline_sequence_tensor_parallel": (*PIPELINE_PARALLEL, *SEQUENCE_TENSOR_PARALLEL),
    "sequence_data_parallel": SEQUENCE_DATA_PARALLEL,
    # On four ranks: two sequence-data groups, which answer different documents.
    "sequence_data_parallel_head_tail": (
        *SEQUENCE_DATA_PARALLEL, "model.distributed.sequence_data_chunking=head_tail",
    ),
    "expert_parallel": (*MIXTURE, "model.distributed.expert_parallel=2"),
    # On four ranks: two expert groups, which answer different documents, with ZeRO-3.
    "expert_parallel_zero_3": (*MIXTURE, "model.distributed.expert_parallel=2", *ZERO_3),
}  # fmt: skip
MODELS = {"expert_parallel": MIXTURE, "expert_parallel_zero_3": MIXTURE}
"""The model of a layout whose one-process run is not the default model's, by name."""
"""Layouts whose answers are compared with one process's, by name: on two ranks, or four
(`FOUR_RANKS`) where two sizes are above one."""
FOUR_RANKS = {
    "tensor_parallel_zero_3",
    "pipeline_parallel_zero_3",
    "pipeline_sequence_tensor_parallel",
    "sequence_data_parallel_head_tail",
    "expert_parallel_zero_3",
}
ANSWERS_SCRIPT = """
from pathlib import Path
from tests.training.test_lm_eval_evaluator import ANSWERED, answers

answers(Path(DATASET), Path(EXPERIMENT), *ANSWERED[NAME])
"""


def layouts(
    dataset: Path, one_process: Callable[..., Path], root: Path
) -> dict[str, Layout | Script]:
    source = ANSWERS_SCRIPT.replace("DATASET", repr(str(dataset)))
    scripts = {
        name: Script(
            4 if name in FOUR_RANKS else 2,
            source.replace("EXPERIMENT", repr(str(root / name))).replace("NAME", repr(name)),
        )
        for name in ANSWERED
    }
    trained = {
        "two_data_ranks": Layout(2, LM_EVAL),
        "two_data_ranks_zero_3": Layout(2, (*LM_EVAL, *ZERO_3)),
        "two_pipeline_ranks": Layout(2, (*LM_EVAL, *PIPELINE_PARALLEL)),
    }
    return {**trained, **scripts}


def answers(dataset: Path, experiment: Path, *overrides: str) -> dict[str, Any] | None:
    """The evaluator's metrics and each task's answers (`resps`) by document, through lm-eval
    with its samples logged, on the run's initial weights: on the first rank (also written to
    experiment/answers.json), None on the others."""
    trainer = trainer_of(train_arguments(dataset, experiment, *LM_EVAL, *overrides))
    lm, manager = trainer.evaluations["tiny"]._model_and_tasks()
    results = simple_evaluate(
        model=lm, tasks=TASKS, bootstrap_iters=0, log_samples=True, task_manager=manager
    )
    if results is None:
        return None
    found = {
        "metrics": numeric_metrics(results),
        "answers": {
            task: {sample["doc_id"]: sample["resps"] for sample in samples}
            for task, samples in results["samples"].items()
        },
    }
    found = json.loads(json.dumps(found))  # as the file has them: tuples as lists, keys strings
    if trainer.engine.mesh.rank == 0:  # under pipeline parallelism, not the last stage's rank
        (experiment / "answers.json").write_text(json.dumps(found))
    return found


def evaluated(experiment: Path) -> dict[int, dict[str, Any]]:
    """The evaluator's metrics by step."""
    return {
        record["step"]: {k: v for k, v in record.items() if k.startswith("tiny_")}
        for record in records(experiment)
        if any(k.startswith("tiny_") for k in record)
    }


def test_the_evaluator_logs_at_its_steps_what_fastllm_evaluate_gives_on_the_checkpoint(
    dataset: Path, one_process: Callable[..., Path], tmp_path: Path
) -> None:
    experiment = one_process(*LM_EVAL)
    logged = evaluated(experiment)
    assert sorted(logged) == [1, 4]
    assert set(logged[4]) == METRICS
    assert logged[1] != logged[4]  # the weights of each step
    output = tmp_path / "results.json"
    result = run_cli(
        "evaluate", f"pretrained.path={experiment / 'checkpoint' / '4'}", f"tokenizer={dataset}",
        *(f"evaluators.tiny.{setting}" for setting in SETTINGS), f"output={output}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    expected = numeric_metrics(json.loads(output.read_text())["tiny"])
    assert logged[4] == {f"tiny_{name}": value for name, value in expected.items()}


@pytest.mark.parametrize(
    "layout", ["two_data_ranks", "two_data_ranks_zero_3", "two_pipeline_ranks"]
)
def test_two_ranks_log_the_metrics_of_one(
    launched: dict[str, Launched], one_process: Callable[..., Path], layout: str
) -> None:
    two, one = evaluated(launched[layout].succeeded()), evaluated(one_process(*LM_EVAL))
    assert two.keys() == one.keys()
    for step, metrics in one.items():
        assert two[step].keys() == metrics.keys()
        for name, value in metrics.items():  # the weights agree to the reductions' rounding
            assert math.isclose(two[step][name], value, rel_tol=1e-5), (step, name)


@pytest.fixture(scope="module")
def one_process_answers(
    dataset: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[tuple[str, ...]], dict[str, Any]]:
    """The one-process answers of the model of overrides `model`, made at the first call."""
    found: dict[tuple[str, ...], dict[str, Any]] = {}

    def of(model: tuple[str, ...]) -> dict[str, Any]:
        if model not in found:
            answered = answers(dataset, tmp_path_factory.mktemp("answers"), *model)
            assert answered is not None
            found[model] = answered
        return found[model]

    return of


@pytest.mark.parametrize("name", list(ANSWERED))
def test_two_ranks_answer_each_request_as_one_process(
    launched: dict[str, Launched],
    one_process_answers: Callable[[tuple[str, ...]], dict[str, Any]],
    name: str,
) -> None:
    """ZeRO-3 on two data ranks, each answering its share of the documents (its own number
    of forward passes, each gathering the stages of the weights it runs), tensor
    parallelism (log-probabilities over the vocabulary slices of the head, generation's
    logits gathered), with sequence-tensor parallelism (rows and generation steps padded to
    an even length), pipeline parallelism (each pass through both ranks' stages, the
    scores and logits sent back from the last stage's rank: the answers checked are the
    first stage's rank's) and sequence-data parallelism (each rank reads its chunks of the
    rows, their hidden states gathered; generation without the key/value cache), and expert
    parallelism (the ranks of an expert group answer the same documents, so that their
    all-to-alls pair): the same log-likelihoods to 1e-5, the same generated texts."""
    got = json.loads((launched[name].succeeded() / "answers.json").read_text())
    expected = one_process_answers(MODELS.get(name, ()))
    assert got["answers"].keys() == set(TASKS)
    assert got["metrics"].keys() == expected["metrics"].keys()
    for metric, value in expected["metrics"].items():
        assert got["metrics"][metric] == pytest.approx(value, rel=1e-5), metric
    for task, by_document in expected["answers"].items():
        assert got["answers"][task].keys() == by_document.keys(), task
        for document, answer in by_document.items():
            assert close(got["answers"][task][document], answer), (task, document)


def close(got: Any, expected: Any) -> bool:
    """Numbers to 1e-5 (relative, or absolute near 0), anything else equal, item by item."""
    if isinstance(expected, list):
        return len(got) == len(expected) and all(map(close, got, expected))
    if isinstance(expected, float):
        return math.isclose(got, expected, rel_tol=1e-5, abs_tol=1e-5)
    return got == expected


def test_an_evaluation_leaves_the_model_training_and_the_random_generators_as_they_were(
    dataset: Path, tmp_path: Path
) -> None:
    trainer = trainer_of(
        train_arguments(dataset, tmp_path, *LM_EVAL, f"{EVALUATOR}.evaluator.limit=2")
    )
    torch.rand(1)  # not the state of the run's seed (1234), which lm-eval seeds too
    before = torch.get_rng_state()
    metrics = trainer.evaluate("tiny")
    assert metrics is not None and set(metrics) == METRICS
    assert trainer.engine.model.training
    assert torch.equal(torch.get_rng_state(), before)  # lm-eval seeds torch's generator


def test_an_unknown_task_is_refused_before_the_first_step(dataset: Path, tmp_path: Path) -> None:
    unknown = f"{EVALUATOR}.evaluator.tasks=[fastllm_multiple_choise]"
    result = run_cli(*train_arguments(dataset, tmp_path / "run", *LM_EVAL, unknown))
    assert result.returncode == 2
    assert (
        f"{EVALUATOR}.evaluator.tasks: unknown lm-eval task 'fastllm_multiple_choise'"
        in result.stderr
    )
    assert records(tmp_path / "run") == []  # no step trained
