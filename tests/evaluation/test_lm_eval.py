"""lm-eval-harness on fastllm: the model interface (`FastLLMLM`) and `fastllm evaluate` against
lm-eval's own `hf` backend on the same Hugging Face checkpoint, in fp32: the same response to
every request (log-likelihoods within 1e-4, the same greedy flags, the same generated text),
hence the same metrics; and two ranks give the results of one, the documents split over them
or the model split as in training (tensor, sequence-tensor, pipeline, sequence-data
parallelism, ZeRO-3)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.data.conftest import CliResult, run_cli
from tests.evaluation.conftest import CONTEXT, TASKS, TASKS_DIRECTORY
from tests.torchrun import torchrun_runs


def evaluate_arguments(model: Path, output: Path, *overrides: str) -> list[str]:
    """`fastllm evaluate` of the test tasks, given as the issue's users give it: a training
    config, the checkpoint in `pretrained.path`, an evaluator named on the command line."""
    return [
        "evaluate", "-c", "examples/llama3-1b.yaml", f"pretrained.path={model}",
        f"evaluators.tiny.tasks={TASKS}", f"evaluators.tiny.include_path={TASKS_DIRECTORY}",
        "evaluators.tiny.batch_size=3", "evaluators.tiny.bootstrap_iters=0", f"output={output}",
        *overrides,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def one_process(model_directory: Path, tmp_path_factory: pytest.TempPathFactory) -> CliResult:
    return evaluated_alone(model_directory, tmp_path_factory.mktemp("one_process"))


@pytest.fixture(scope="module")
def moe_one_process(
    moe_model_directory: Path, tmp_path_factory: pytest.TempPathFactory
) -> CliResult:
    return evaluated_alone(moe_model_directory, tmp_path_factory.mktemp("moe_one_process"))


def evaluated_alone(model: Path, root: Path) -> CliResult:
    """`fastllm evaluate` of the test tasks on `model` in this process (root/results.json)."""
    with pytest.MonkeyPatch.context() as patch:  # the kernels' torch references, as in conftest
        patch.delenv("TRITON_INTERPRET", raising=False)
        return run_cli(*evaluate_arguments(model, root / "results.json"))


def results_of(run: CliResult) -> dict[str, Any]:
    """The results that `fastllm evaluate` wrote (its last line names the file)."""
    assert run.returncode == 0, run.stderr
    return json.loads(
        Path(run.stdout.strip().splitlines()[-1].removeprefix("results: ")).read_text()
    )


def metrics(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    return {
        task: {k: v for k, v in values.items() if isinstance(v, float | int) and "," in k}
        for task, values in results["results"].items()
    }


def assert_same_metrics(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Accuracies equal; perplexities, which sum log-likelihoods, to fp32 rounding."""
    ours_metrics, their_metrics = metrics(ours), metrics(theirs)
    assert ours_metrics.keys() == their_metrics.keys() == set(TASKS)
    for task, values in their_metrics.items():
        assert ours_metrics[task].keys() == values.keys()
        for name, value in values.items():
            assert math.isclose(ours_metrics[task][name], value, rel_tol=1e-6), (task, name)
        assert ours["results"][task]["sample_len"] == theirs["results"][task]["sample_len"]


def test_every_request_gets_the_hf_backends_response(
    model_directory: Path, hf_backend_results: dict[str, Any]
) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    import fastllm
    from fastllm.evaluation.lm_eval_model import FastLLMLM

    model = fastllm.load_model(model_directory).train()  # as a model being trained is
    lm = FastLLMLM(
        model,
        AutoTokenizer.from_pretrained(str(model_directory)),
        max_length=CONTEXT,
        batch_size=3,  # other batches than the backend's
    )
    ours = simple_evaluate(
        model=lm,
        tasks=TASKS,
        task_manager=TaskManager(include_path=str(TASKS_DIRECTORY), include_defaults=False),
        bootstrap_iters=0,
    )
    assert ours is not None
    assert model.training  # evaluated in eval mode, then given back as it came
    theirs = hf_backend_results
    compared = {"loglikelihood": 0, "loglikelihood_rolling": 0, "generate_until": 0}
    for task in TASKS:
        for mine, reference in zip(ours["samples"][task], theirs["samples"][task], strict=True):
            assert mine["doc_id"] == reference["doc_id"]
            for response, expected in zip(mine["resps"], reference["resps"], strict=True):
                (response,), (expected,) = response, expected
                if isinstance(expected, tuple):  # (log-likelihood, is_greedy)
                    assert abs(response[0] - expected[0]) <= 1e-4, (task, response, expected)
                    assert response[1] == expected[1], (task, response, expected)
                    compared["loglikelihood"] += 1
                elif isinstance(expected, float):
                    assert abs(response - expected) <= 1e-4, (task, response, expected)
                    compared["loglikelihood_rolling"] += 1
                else:
                    assert response == expected, task
                    compared["generate_until"] += 1
    assert compared == {"loglikelihood": 64, "loglikelihood_rolling": 6, "generate_until": 10}
    assert_same_metrics(ours, theirs)


def test_evaluate_command_gives_the_hf_backends_results(
    one_process: CliResult, hf_backend_results: dict[str, Any]
) -> None:
    assert one_process.returncode == 0, one_process.stderr
    output = Path(one_process.stdout.strip().splitlines()[-1].removeprefix("results: "))
    results = json.loads(output.read_text())
    assert results.keys() == {"tiny"}
    assert_same_metrics(results["tiny"], hf_backend_results)
    assert "|fastllm_multiple_choice|" in one_process.stdout.replace(" ", "")  # lm-eval's table


LAYOUTS = {
    "data_parallel": (),
    "tensor_parallel": ("model.distributed.tensor_parallel=2",),
    "sequence_tensor_parallel": (
        "model.distributed.tensor_parallel=2",
        "model.distributed.sequence_tensor_parallel=true",
    ),
    "pipeline_parallel": ("model.distributed.pipeline_parallel=2",),
    "sequence_data_parallel": ("model.distributed.sequence_data_parallel=2",),
    "zero3": ("model.multi_stage.zero_stage=3",),
}
"""`fastllm evaluate` on two ranks: each layout's keys, as a training config gives them."""
EXPERT_PARALLEL = "expert_parallel"
"""The mixture of experts on two expert ranks, each with 2 of its 4 experts."""
REFUSED = "expert_parallel_without_experts"
"""A run of the launch that must exit 2, last (the launch stops at a failed run)."""


@pytest.fixture(scope="module")
def two_ranks(
    model_directory: Path, moe_model_directory: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The results file of each layout of LAYOUTS, of EXPERT_PARALLEL and of REFUSED (absent,
    its stderr beside), all run in one torchrun launch."""
    root = tmp_path_factory.mktemp("two_ranks")
    ep = "model.distributed.expert_parallel=2"
    models = {name: (model_directory, keys) for name, keys in LAYOUTS.items()}
    models[EXPERT_PARALLEL] = (moe_model_directory, (ep,))
    models[REFUSED] = (model_directory, (ep,))
    runs = {
        name: evaluate_arguments(model, root / f"{name}.json", *keys)
        for name, (model, keys) in models.items()
    }
    with pytest.MonkeyPatch.context() as patch:  # the kernels' torch references, as in conftest
        patch.delenv("TRITON_INTERPRET", raising=False)
        results = torchrun_runs(2, runs, root)
    for name, result in results.items():
        assert result.returncode == (2 if name == REFUSED else 0), (name, result.stderr)
        if name == REFUSED:
            (root / f"{name}.stderr").write_text(result.stderr)
    return {name: root / f"{name}.json" for name in runs}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_ranks_give_the_results_of_one(
    one_process: CliResult, two_ranks: dict[str, Path], layout: str
) -> None:
    single = results_of(one_process)
    assert_same_metrics(json.loads(two_ranks[layout].read_text())["tiny"], single["tiny"])


def test_two_expert_ranks_give_the_results_of_one(
    moe_one_process: CliResult, two_ranks: dict[str, Path]
) -> None:
    single = results_of(moe_one_process)
    assert_same_metrics(json.loads(two_ranks[EXPERT_PARALLEL].read_text())["tiny"], single["tiny"])


def test_bad_input_is_refused_naming_the_key(model_directory: Path, tmp_path: Path) -> None:
    output = tmp_path / "results.json"
    missing = run_cli(*evaluate_arguments(tmp_path / "nowhere", output))
    assert missing.returncode == 2
    assert "pretrained.path" in missing.stderr and "no such model directory" in missing.stderr
    no_tasks = run_cli("evaluate", f"pretrained.path={model_directory}", "evaluators.x.limit=3")
    assert no_tasks.returncode == 2 and "evaluators.x.tasks: is required" in no_tasks.stderr
    ranks = run_cli(*evaluate_arguments(model_directory, output, LAYOUTS["tensor_parallel"][0]))
    assert ranks.returncode == 2
    assert "model.distributed.tensor_parallel: tensor_parallel (2)" in ranks.stderr
    assert "must divide the number of ranks (1)" in ranks.stderr
    assert not output.exists()


def test_a_layout_the_model_cannot_split_into_is_refused_naming_the_key(
    two_ranks: dict[str, Path],
) -> None:
    # The last run of the launch: two expert ranks for a model without experts.
    refused = two_ranks[REFUSED]
    assert not refused.exists()
    stderr = refused.with_suffix(".stderr").read_text()
    assert "model.distributed.expert_parallel: (2) must divide" in stderr, stderr


def test_requests_of_one_context_share_a_row_and_score_as_alone(model_directory: Path) -> None:
    # A question read once for its four answers: the model reads the context and each
    # answer but its last token, each answer attending to the context and itself only.
    import torch
    from transformers import AutoTokenizer

    import fastllm
    from fastllm.evaluation.lm_eval_model import FastLLMLM

    model = fastllm.load_model(model_directory)
    lm = FastLLMLM(
        model, AutoTokenizer.from_pretrained(str(model_directory)), max_length=CONTEXT,
        batch_size=2,
    )  # fmt: skip
    context = [7, 40, 41, 42, 43]
    continuations = [[50, 51, 52], [60], [70, 71], [50, 51, 52], [80, 81, 82, 83], [70, 72]]
    long_context = list(range(100, 100 + CONTEXT))  # cut from the left
    requests = [(None, context, c) for c in continuations] + [(None, long_context, [9, 10])]
    read: list[int] = []
    context_of = model.context  # made once a forward pass

    def spy(input_ids: torch.Tensor, **kwargs: Any) -> Any:
        read.append(input_ids.shape[0] * input_ids.shape[1])
        return context_of(input_ids, **kwargs)

    model.context = spy  # type: ignore[method-assign]
    ours = lm._loglikelihood_tokens(requests)
    # One row of 5 + 2 + 0 + 1 + 3 tokens (the repeated answer, and the one that differs from
    # another in its last token only, read once), one of 64: one batch.
    assert read == [2 * CONTEXT]
    for (_, ctx, continuation), (log_p, greedy) in zip(requests, ours, strict=True):
        tokens = (ctx + continuation)[-(CONTEXT + 1) :]
        with torch.no_grad():
            logits = model.hidden_states(torch.tensor([tokens[:-1]]))[0] @ model.head_weight.T
        scored = logits[0, -len(continuation) :].log_softmax(-1)
        target = torch.tensor(continuation)
        expected = scored.gather(1, target[:, None]).sum().item()
        assert abs(log_p - expected) <= 1e-5, (continuation, log_p, expected)
        assert greedy == bool((scored.argmax(-1) == target).all())


def test_loglikelihood_tokenizes_as_lm_evals_template_does(model_directory: Path) -> None:
    # Encoded in batches, each distinct string once: the same tokens as TemplateLM's two
    # encodes a request (trailing spaces moved, no context, a BOS-prefixed context).
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import TemplateLM
    from transformers import AutoTokenizer

    import fastllm
    from fastllm.evaluation.lm_eval_model import FastLLMLM

    tokenizer = AutoTokenizer.from_pretrained(str(model_directory))
    lm = FastLLMLM(fastllm.load_model(model_directory), tokenizer, max_length=CONTEXT)
    bos = tokenizer.decode(lm.prefix_token_id)
    pairs = [
        ("Question: what is it? Answer:", " a cat"),
        ("Question: what is it? Answer: ", "a dog"),
        ("Question: what is it? Answer:", " a cat"),
        ("", "alone here"),
        ("   ", "after spaces"),
        (bos + "starts with its own", " end"),
        ("tab\t", "\tand newline\n"),
    ]
    requests = [Instance("loglikelihood", {}, pair, index) for index, pair in enumerate(pairs)]
    seen: dict[str, list] = {}
    for name, call in (
        ("ours", lambda: lm.loglikelihood(requests, disable_tqdm=True)),
        ("theirs", lambda: TemplateLM.loglikelihood(lm, requests, disable_tqdm=True)),
    ):
        lm._loglikelihood_tokens = lambda scored, name=name, **_: seen.setdefault(name, scored)  # type: ignore[method-assign]
        call()
    assert seen["ours"] == seen["theirs"]
    assert len({tuple(context) for _, context, _ in seen["ours"]}) > 3
