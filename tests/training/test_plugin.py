"""The example plugin (examples/plugin, installed by `make setup`): a parallel block, a
squared-ReLU MLP, a label-smoothed loss and an arithmetic data source of another package train
through `fastllm train`, resume from their checkpoint exactly, and a run or a conversion without the plugin is
refused naming it (exit code 2)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from fastllm.config import ConfigError, TrainerConfig, build, load_raw
from fastllm.model.normalization import NoNormalization
from fastllm.training.trainer import Trainer
from tests.conftest import ROOT
from tests.data.conftest import run_cli
from tests.torchrun import torchrun
from tests.training.conftest import Launched, Layout, train_arguments
from tests.training.test_distillation import logged
from tests.training.test_train_cli import losses

PLUGIN_CONFIG = "examples/plugin/plugin.yaml"
SMOOTHING = 0.1
RECORDED = {
    "block": {"parallel": "fastllm_example_plugin.config:ParallelBlockConfig"},
    "mlp": {"squared_relu": "fastllm_example_plugin.config:SquaredReLUMLPConfig"},
    "head_loss": {"label_smoothing": "fastllm_example_plugin.config:LabelSmoothingLossConfig"},
    "data_source": {"arithmetic": "fastllm_example_plugin.config:ArithmeticSourceConfig"},
}
WITHOUT_PLUGIN = (
    "import sys; sys.modules['fastllm_example_plugin'] = None; "  # its imports fail
    "from fastllm.cli import main; sys.exit(main(sys.argv[1:]))"
)


def plugin_arguments(dataset: Path, experiment: Path, *overrides: str) -> list[str]:
    """The tests' tiny run, with examples/plugin/plugin.yaml's model and loss, on the
    prepared dataset."""
    return with_plugin_config(train_arguments(dataset, experiment, "data.source=null", *overrides))


def source_arguments(dataset: Path, experiment: Path, *overrides: str) -> list[str]:
    """The tests' tiny run, with examples/plugin/plugin.yaml's model, loss and data source
    (tokenized with the dataset's tokenizer)."""
    tokenizer = f"data.source.tokenizer={dataset / 'tokenizer.json'}"
    arguments = train_arguments(dataset, experiment, "data.path=[]", tokenizer, *overrides)
    return with_plugin_config(arguments)


def with_plugin_config(arguments: list[str]) -> list[str]:
    arguments[arguments.index("-c") + 1] = PLUGIN_CONFIG
    return arguments


def plugin_trainer(
    dataset: Path,
    experiment: Path,
    *overrides: str,
    arguments: Callable[..., list[str]] = plugin_arguments,
) -> Trainer:
    arguments = arguments(dataset, experiment, *overrides)
    settings = [a for a in arguments[3:] if "=" in a]
    return Trainer(build(TrainerConfig, load_raw([PLUGIN_CONFIG], settings)))


@pytest.fixture(scope="module", autouse=True)
def installed() -> None:
    try:
        import fastllm_example_plugin  # noqa: F401
    except ImportError:
        pytest.fail("the example plugin is not installed: pip install ./examples/plugin")


def test_the_plugins_block_mlp_and_loss_compute_what_torch_does(
    dataset: Path, tmp_path: Path
) -> None:
    run = plugin_trainer(dataset, tmp_path / "run", "training.train_iters=1")
    block = run.engine.model.layers[0]
    mlp = block.mlp
    assert type(block).__name__ == "ParallelBlock" and type(mlp).__name__ == "SquaredReLUMLP"
    x = torch.randn(2, 5, mlp.layer_1.in_features, generator=torch.Generator().manual_seed(0))
    none = NoNormalization()
    with torch.no_grad():
        out, auxiliary = mlp(x, none)
        expected = F.relu(x @ mlp.layer_1.weight.T).square() @ mlp.layer_2.weight.T
        torch.testing.assert_close(out, expected)
        assert auxiliary is None
        norm = block.norm  # one layer norm, read by both the mixer and the MLP
        h = F.layer_norm(x, x.shape[-1:], norm.weight, norm.bias, norm.epsilon)
        expected = x + block.mixer(h, none, None, None, None, None) + mlp(h, none)[0]
        torch.testing.assert_close(block(x, None, None, None, None)[0], expected)
    batches = next(iter(run.data_loader()))
    with torch.no_grad():  # the weights the step starts from
        logits = torch.cat([run.engine.model(b.input_ids).float().flatten(0, 1) for b in batches])
    labels = torch.cat([b.labels.flatten() for b in batches])
    metrics = run.engine.train_step(batches)
    expected = F.cross_entropy(logits, labels, label_smoothing=SMOOTHING).item()
    assert metrics["loss"] == pytest.approx(expected, rel=1e-5)


def test_the_plugin_trains_and_resumes_through_the_command_line(
    dataset: Path, tmp_path: Path
) -> None:
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    for experiment, steps in ((straight, 4), (interrupted, 2), (interrupted, 4)):
        result = run_cli(*source_arguments(dataset, experiment, f"training.train_iters={steps}"))
        assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stdout
    assert losses(interrupted) == losses(straight)  # bit for bit: the same samples
    assert sorted(losses(straight)) == [1, 2, 3, 4]
    manifest = json.loads((interrupted / "checkpoint" / "2" / "manifest.json").read_text())
    assert manifest["components"] == RECORDED
    # 8 samples of 49 tokens end inside an exercise: its first tokens were packed already.
    assert manifest["data_source"]["used"] > 0


def test_the_plugins_source_blended_with_a_dataset_resumes_exactly(
    dataset: Path, tmp_path: Path
) -> None:
    """A quarter of the samples from the source, the rest from the prepared dataset: which is
    drawn from the seed, and both resume where they were."""
    blend = (f"data.path=[{dataset}]", "data.source.share=0.25")
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    for experiment, steps in ((straight, 4), (interrupted, 2), (interrupted, 4)):
        arguments = source_arguments(dataset, experiment, *blend, f"training.train_iters={steps}")
        result = run_cli(*arguments)
        assert result.returncode == 0, result.stderr
    assert losses(interrupted) == losses(straight)
    assert sorted(losses(straight)) == [1, 2, 3, 4]
    only_source = source_arguments(dataset, tmp_path / "source", "training.train_iters=4")
    assert run_cli(*only_source).returncode == 0
    assert losses(tmp_path / "source") != losses(straight)


def test_the_plugins_source_trains_on_the_answers_only(dataset: Path, tmp_path: Path) -> None:
    """The question of each exercise is a loss-masking span: the trained labels are the
    answers' digits, their newline and the end-of-document token."""
    run = plugin_trainer(
        dataset, tmp_path / "run", "training.train_iters=1", arguments=source_arguments
    )
    tokenizer = Tokenizer.from_file(str(dataset / "tokenizer.json"))
    for batch in next(iter(run.data_loader())):
        for row, labels in zip(batch.input_ids, batch.labels, strict=True):
            text = tokenizer.decode(row.tolist(), skip_special_tokens=False)
            assert re.fullmatch(r"(\d* ?\+? ?\d* ?=? ?\d*\n?(<\|endoftext\|>)?)+", text), text
            trained = tokenizer.decode(labels[labels != -100].tolist(), skip_special_tokens=False)
            assert trained and set(trained) <= set("0123456789 \n<|endoftext|>"), trained
            assert "+" not in trained and "=" not in trained


def test_the_plugins_source_with_truncated_sampling_puts_one_exercise_in_a_sample(
    dataset: Path, tmp_path: Path
) -> None:
    run = plugin_trainer(
        dataset,
        tmp_path / "run",
        "training.train_iters=1",
        "data.sampling=truncated",
        arguments=source_arguments,
    )
    tokenizer = Tokenizer.from_file(str(dataset / "tokenizer.json"))
    for batch in next(iter(run.data_loader())):
        for row, labels in zip(batch.input_ids, batch.labels, strict=True):
            real = int((labels != -100).nonzero().max()) + 2  # its last label is its EOS
            text = tokenizer.decode(row[:real].tolist(), skip_special_tokens=False)
            assert re.fullmatch(r"\d+ \+ \d+ = \d+\n<\|endoftext\|>", text), text
            assert (labels[real - 1 :] == -100).all()  # padding


@pytest.mark.parametrize(
    "overrides",
    [
        ("data.fim={rate: 0.5, tokenizer: DATASET/tokenizer.json}",),
        ("data.fim={rate: 0.5}", "data.path=[DATASET]", "data.source.share=0.75"),  # its tokenizer
    ],
)
def test_fim_on_the_plugins_source_refuses_its_masked_questions(
    dataset: Path, tmp_path: Path, overrides: tuple[str, ...]
) -> None:
    overrides = tuple(o.replace("DATASET", str(dataset)) for o in overrides)
    run = plugin_trainer(
        dataset, tmp_path / "run", "training.train_iters=1", *overrides, arguments=source_arguments
    )
    refused = r"^data.fim: data.source: document 0 has loss-masking spans, which FIM would move"
    with pytest.raises(ConfigError, match=refused):
        next(iter(run.data_loader()))


def test_the_plugins_source_on_two_data_ranks_matches_one_process(
    dataset: Path, tmp_path: Path
) -> None:
    """Each data-parallel rank packs the same documents and keeps its share of each step."""
    for name, ranks in (("one", 1), ("two", 2)):
        arguments = source_arguments(dataset, tmp_path / name, "training.train_iters=3")
        result = torchrun(ranks, *arguments) if ranks > 1 else run_cli(*arguments)
        assert result.returncode == 0, result.stderr
    expected, got = logged(tmp_path / "one", "loss"), logged(tmp_path / "two", "loss")
    assert sorted(got) == sorted(expected) == [1, 2, 3]
    for step, value in expected.items():
        assert got[step] == pytest.approx(value, rel=1e-5), step


def without_plugin(*arguments: str) -> subprocess.CompletedProcess[str]:
    """`fastllm ARGUMENTS` in a process where the plugin cannot be imported."""
    command = [sys.executable, "-c", WITHOUT_PLUGIN, *arguments]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT)


@pytest.mark.parametrize(
    ("overrides", "key", "component"),
    [
        ((), "model.base_model.transformer.block.type: type 'parallel'", "ParallelBlockConfig"),
        (
            ("model.base_model.transformer.block={type: decoder}",),
            "model.base_model.transformer.mlp.type: type 'squared_relu'",
            "SquaredReLUMLPConfig",
        ),
        (  # fastllm's own block, MLP and loss: the source is the first of the plugin's components
            (
                "model.base_model.transformer.block={type: decoder}",
                "model.base_model.transformer.mlp={type: mlp}",
                "model.base_model.head.losses={lm: {type: label}}",
            ),
            "data.source.type: type 'arithmetic'",
            "ArithmeticSourceConfig",
        ),
    ],
)
def test_a_run_without_the_plugin_is_refused_naming_its_key_type_and_error(
    dataset: Path, tmp_path: Path, overrides: tuple[str, ...], key: str, component: str
) -> None:
    result = without_plugin(*source_arguments(dataset, tmp_path / "run", *overrides))
    assert result.returncode == 2, result.stderr
    assert key in result.stderr
    assert f"fastllm_example_plugin.config:{component}" in result.stderr
    assert "cannot be imported: ModuleNotFoundError" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("override", "refused"),
    [
        ("data.path=[DATASET]", "data.source.share: is 1: the prepared datasets of data.path"),
        ("data.source.share=0.5", "data.source.share: is 0.5, and data.path gives no other"),
        ("data.fim={rate: 0.5}", "data.fim.tokenizer: is required for FIM on a data.source"),
        ("training.phases=[{begin_step: 2, data: {weights: [1.0]}}]", "training.phases[0].data:"),
        ("training.export.interval=2", "training.export.interval: exports copy"),
        (
            "training.evaluators={tasks: {interval: 2, evaluator: {type: lm_eval, tasks: [x]}}}",
            "training.evaluators.tasks.evaluator: lm_eval reads the tokenizer files",
        ),
    ],
)
def test_what_a_data_source_does_not_compose_with_is_refused_by_key(
    dataset: Path, tmp_path: Path, override: str, refused: str
) -> None:
    override = override.replace("DATASET", str(dataset))
    result = run_cli(*source_arguments(dataset, tmp_path / "run", override))
    assert result.returncode == 2, result.stderr
    assert refused in result.stderr
    assert not (tmp_path / "run").exists()


def test_converting_its_checkpoint_without_the_plugin_is_refused_naming_them(
    dataset: Path, tmp_path: Path
) -> None:
    experiment = tmp_path / "run"
    result = run_cli(*plugin_arguments(dataset, experiment, "training.train_iters=1"))
    assert result.returncode == 0, result.stderr
    checkpoint = experiment / "checkpoint" / "1"
    exported = tmp_path / "exported"
    convert = ("convert", f"input.path={checkpoint}", "input.format=distributed")
    result = without_plugin(*convert, f"output.path={exported}")
    assert result.returncode == 2
    for named in (
        "block type 'parallel'",
        "mlp type 'squared_relu'",
        "head_loss type 'label_smoothing'",
    ):
        assert named in result.stderr
    assert "Install the packages that provide them" in result.stderr
    assert not exported.exists()
    result = run_cli(*convert, f"output.path={exported}")  # with it: converted, and recorded
    assert result.returncode == 0, result.stderr
    result = without_plugin(*convert[:1], f"input.path={exported}", f"output.path={tmp_path / 'x'}")
    assert result.returncode == 2 and "mlp type 'squared_relu'" in result.stderr
    result = run_cli(
        "convert", f"input.path={exported}", "output.format=llama", f"output.path={tmp_path / 'hf'}"
    )  # a Hugging Face architecture has no layer of the plugin's
    assert result.returncode == 2
    assert "transformer.mlp.type is 'squared_relu' (not fastllm's)" in result.stderr


def test_the_plugins_config_is_shown_and_validated_without_torch() -> None:
    result = run_cli("config", "show", "-c", PLUGIN_CONFIG)
    assert result.returncode == 0, result.stderr
    assert (
        "      mlp:\n        type: squared_relu\n        ffn_hidden_size: null\n"
        "      block:\n        type: parallel\n" in result.stdout
    )
    assert "label_smoothing:\n          type: label_smoothing\n" in result.stdout
    load = (
        "import sys; from fastllm.config import TrainerConfig, load_config; "
        f"load_config(TrainerConfig, [{PLUGIN_CONFIG!r}], []); print('torch' in sys.modules)"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", load], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert loaded.stdout == "False\n"  # the plugin's configs import no torch, as fastllm's


PLUGIN_LAYERS = (
    "model.base_model.transformer.block={type: parallel}",
    "model.base_model.transformer.mlp={type: squared_relu}",
    "training.train_iters=3",
)
PLUGIN_LAYOUTS = {
    "plugin_tensor": (
        "model.distributed.tensor_parallel=2",
        "model.distributed.sequence_tensor_parallel=true",
    ),
    "plugin_zero_3": ("model.multi_stage.zero_stage=3",),
}


def layouts(dataset: Path, one_process: Callable[..., Path], root: Path) -> dict[str, Layout]:
    return {name: Layout(2, (*PLUGIN_LAYERS, *layout)) for name, layout in PLUGIN_LAYOUTS.items()}


@pytest.mark.parametrize("name", PLUGIN_LAYOUTS)
def test_the_plugins_block_and_mlp_on_two_ranks_match_one_process(
    name: str, launched: dict[str, Launched], one_process: Callable[..., Path]
) -> None:
    """Their parameters' metadata is all the engine needs to split them over tensor ranks
    (their declared splits) and to shard them with ZeRO-3."""
    single, double = one_process(*PLUGIN_LAYERS), launched[name].succeeded()
    expected, got = logged(single, "loss"), logged(double, "loss")
    assert sorted(got) == sorted(expected) == [1, 2, 3]
    for step, value in expected.items():
        assert got[step] == pytest.approx(value, rel=1e-5), step
