"""Evaluators (`training.evaluators` on `data.datasets`, `training.validation` as the one named
validation) and what a run costs (the GPU's energy counter): logged under their names, at their
steps, with the values the engine's `evaluate` gives on those datasets and the counter's
arithmetic; bad evaluators refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fastllm.config import ConfigError, TrainerConfig, build, load_config, load_raw
from fastllm.engine.engine import Engine
from fastllm.training import Trainer, energy
from fastllm.training.setup import check_inputs
from tests.data.conftest import prepare
from tests.data.conftest import run_cli as in_process
from tests.training.conftest import STDLIB, train_arguments

EVALUATORS = (  # wiki every 2 steps on its own name's dataset, code after steps 1 and 4 on html
    "training.train_iters=4", "training.logs.interval=3",
    "training.evaluators.wiki.interval=2", "training.evaluators.wiki.evaluator.iterations=1",
    "training.evaluators.code.interval=3", "training.evaluators.code.offset=1",
    "training.evaluators.code.evaluator.dataset_name=html",
    "training.evaluators.code.evaluator.iterations=2",
    "training.validation.interval=4", "training.validation.iterations=1",
)  # fmt: skip


@pytest.fixture(scope="module")
def html(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The html package's sources, in the session dataset's tokens."""
    output = tmp_path_factory.mktemp("html") / "dataset"
    tokenizer = dataset.parent / "tokenizer"
    return prepare(STDLIB / "html", tokenizer, output, "input.extensions=[.py]")


def arguments(dataset: Path, html: Path, experiment: Path, *overrides: str) -> list[str]:
    datasets = (
        f"data.datasets.wiki.path=[{dataset}]",
        f"data.datasets.html.path=[{html}]",
        f"data.validation_path=[{dataset}]",
    )
    return train_arguments(dataset, experiment, *datasets, *EVALUATORS, *overrides)


def records(experiment: Path) -> list[dict[str, Any]]:
    lines = (experiment / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def trainer_of(argv: list[str]) -> Trainer:
    files = [argv[argv.index("-c") + 1]]
    return Trainer(build(TrainerConfig, load_raw(files, [a for a in argv[3:] if "=" in a])))


def test_named_loss_evaluators_log_under_their_names_the_engines_loss_on_their_datasets(
    dataset: Path, html: Path, tmp_path: Path
) -> None:
    experiment = tmp_path / "run"
    argv = arguments(dataset, html, experiment, "training.logs.tensorboard=true")
    result = in_process(*argv)
    assert result.returncode == 0, result.stderr
    logged = records(experiment)
    by_step = {r["step"]: r for r in logged}
    evaluated = {
        key: sorted(r["step"] for r in logged if key in r)
        for key in ("wiki_loss", "code_loss", "validation_loss")
    }
    assert evaluated == {"wiki_loss": [2, 4], "code_loss": [1, 4], "validation_loss": [4]}
    assert set(by_step[1]) == {"step", "code_loss"}  # not a logged step: the evaluation alone
    assert "loss" in by_step[3] and "wiki_loss" not in by_step[3]
    # No energy counter on a CPU: said once at the end, no figure logged.
    assert not any("energy_kwh" in r or "joules_per_step" in r for r in logged)
    assert "energy absent (no energy counter on cpu)" in result.stdout

    # The engine's `evaluate` on each dataset's first batches, with the weights of step 4.
    trainer = trainer_of(argv)
    assert trainer.resume() is not None and trainer.engine.state.step == 4
    batch_size = trainer.config.batch.batch_size

    def engine_loss(path: Path, iterations: int) -> float:
        stream = trainer.sample_stream([str(path)], iterations * batch_size, "test")
        loss = trainer.engine.evaluate([b for s in trainer.loader(stream) for b in s])
        assert loss is not None
        return loss

    wiki, code = engine_loss(dataset, 1), engine_loss(html, 2)
    assert by_step[4]["wiki_loss"] == pytest.approx(wiki, rel=1e-6)
    assert by_step[4]["code_loss"] == pytest.approx(code, rel=1e-6)
    assert abs(wiki - code) > 1e-3  # the datasets differ: the names picked them
    # training.validation is the evaluator named validation: the same loss on the same data.
    assert by_step[4]["validation_loss"] == pytest.approx(wiki, rel=1e-6)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(experiment / "tensorboard"))
    events.Reload()
    scalars = {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars["train/wiki_loss"] == [2, 4] and scalars["train/code_loss"] == [1, 4]


def test_energy_figures_from_the_counter_sum_the_steps_of_each_logged_window(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fake counter that gains 250 J per training step: 250 J a step, the tokens of a step
    per 250 J, and the total after each logged step."""
    steps = [0]
    train_step = Engine.train_step

    def counting(self: Engine, micro_batches: Any) -> dict[str, Any]:
        steps[0] += 1
        return train_step(self, micro_batches)

    monkeypatch.setattr(Engine, "train_step", counting)
    monkeypatch.setattr(
        energy, "nvml_energy_reader", lambda device: (lambda: 1000.0 + 250.0 * steps[0], "")
    )
    experiment = tmp_path / "run"
    argv = train_arguments(
        dataset, experiment, "training.train_iters=4", "training.logs.interval=2"
    )
    result = in_process(*argv)
    assert result.returncode == 0, result.stderr
    logged = {r["step"]: r for r in records(experiment)}
    tokens_per_step = 4 * 48  # batch_size × sequence_length
    for step in (2, 4):
        assert logged[step]["joules_per_step"] == pytest.approx(250.0)
        assert logged[step]["tokens_per_kwh"] == pytest.approx(tokens_per_step / (250 / 3.6e6))
        assert logged[step]["energy_kwh"] == pytest.approx(250.0 * step / 3.6e6)
    assert f"{1000 / 3.6e6:.4g} kWh over every rank" in result.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_gpu_energy_counter_grows_over_training_steps(dataset: Path, tmp_path: Path) -> None:
    read, absent = energy.nvml_energy_reader(torch.device("cuda", torch.cuda.current_device()))
    assert read is not None, absent
    experiment = tmp_path / "run"
    argv = train_arguments(
        dataset, experiment, "training.train_iters=6", "training.logs.interval=2",
        "batch.sequence_length=2048", "batch.batch_size=16",
    )  # fmt: skip
    before = read()
    result = in_process(*argv)
    after = read()
    assert result.returncode == 0, result.stderr
    logged = [r for r in records(experiment) if "energy_kwh" in r]
    assert [r["step"] for r in logged] == [2, 4, 6]
    assert all(r["joules_per_step"] > 0 and r["tokens_per_kwh"] > 0 for r in logged)
    totals = [r["energy_kwh"] for r in logged]
    assert totals == sorted(totals) and totals[0] < totals[-1]
    assert 0 < totals[-1] * 3.6e6 <= after - before


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (
            ["training.evaluators.wiki.interval=2"],
            "training.evaluators.wiki.evaluator.dataset_name: is not set and data.datasets "
            "has no dataset named 'wiki'",
        ),
        (
            ["data.datasets.wiki.path=[x]", "training.evaluators.w.evaluator.dataset_name=code"],
            "training.evaluators.w.evaluator.dataset_name: 'code' is not in data.datasets "
            "(it has: wiki)",
        ),
        (["data.datasets.wiki.path=[]"], "data.datasets.wiki.path: no dataset given"),
        (["data.datasets.wiki.pth=[x]"], "data.datasets.wiki.pth: unknown key; did you mean path?"),
        (
            ["training.evaluators.wiki.evaluator.type=lm_evl"],
            "training.evaluators.wiki.evaluator.type: unknown type 'lm_evl'",
        ),
        (
            ["data.datasets.wiki.path=[x]", "training.evaluators.wiki.evaluator.iterations=0"],
            "training.evaluators.wiki.evaluator.iterations: must be positive, got 0",
        ),
        (
            ["data.datasets.a.path=[x]", "training.evaluators.a.interval=0"],
            "training.evaluators.a.interval: must be positive, got 0",
        ),
        (
            [
                "data.datasets.wiki.path=[x]", "training.validation.interval=2",
                "training.evaluators.validation.evaluator.dataset_name=wiki",
            ],
            "training.evaluators.validation: is the name training.validation logs under",
        ),
        (["data.datasets={a b: {path: [x]}}"], "data.datasets: 'a b' is not a name"),
        (["training.evaluators={2: {}}"], "training.evaluators.2: a name must be a string"),
    ],
    ids=[
        "no-dataset-of-its-name", "unknown-dataset", "no-path", "unknown-key", "unknown-type",
        "no-iterations", "zero-interval", "validation-taken", "bad-name", "number",
    ],
)  # fmt: skip
def test_bad_evaluators_are_refused_naming_the_key(overrides: list[str], error: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(TrainerConfig, ["examples/tiny.yaml"], overrides)
    assert str(refused.value).startswith(error), refused.value


def test_a_named_dataset_that_is_not_there_is_refused_before_training(tmp_path: Path) -> None:
    overrides = [
        f"run.experiment_dir={tmp_path}", "data.path=[examples]", "training.train_iters=1",
        f"data.datasets.wiki.path=[{tmp_path / 'absent'}]",
    ]  # fmt: skip
    config = load_config(TrainerConfig, ["examples/tiny.yaml"], overrides)
    with pytest.raises(ConfigError, match=r"^data\.datasets\.wiki\.path\[0\]: .*no such dataset"):
        check_inputs(config)
