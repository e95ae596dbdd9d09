"""What the training tests share: a small real dataset (Python standard library sources, a
trained tokenizer), made once, the tiny model's command line, and its one-process runs.

A parallel layout is tested against the one-process run of the same global batch:
- `one_process(*overrides)` (session fixture) gives that run's experiment directory, trained
  once per session for each distinct `overrides` (in this process: no interpreter start-up),
  whichever module asks first; treat it as read-only (copy a checkpoint out to resume it).
  Leave the layout keys (ZeRO stage, parallel sizes) out of `overrides`: one process runs the
  same whatever they are, so layouts that differ only there share their reference.
- A module that defines `layouts(dataset, one_process, root) -> {name: Layout(ranks,
  overrides, resumes) | Script(ranks, source)}` (their directories are root/NAME) gets them run
  through the fixture `launched` (its `Launched` runs by name; each test checks its own). The
  layouts of all such modules of the session are trained together, in one torchrun launch
  per number of ranks (`tests.torchrun.torchrun_runs`: the ranks start Python and import
  torch once for all runs, which is most of a small run's cost)."""

from __future__ import annotations

import shutil
import sysconfig
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from tests.data.conftest import CliResult, run_cli
from tests.torchrun import torchrun_runs

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@contextmanager
def compiled_graphs() -> Iterator[Callable[[], int]]:
    """For a test of compiled blocks: dynamo's caches emptied (the frames that earlier tests'
    models compiled would count towards its recompile limit) and a recompile past the limit an
    error, not a silent fall back to eager for the rest of the session; gives a function
    returning how many graphs were compiled since (a test asserts some were)."""
    torch._dynamo.reset()
    start = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield lambda: counters["stats"]["unique_graphs"] - start


@pytest.fixture(autouse=True)
def without_triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Training runs use the kernels' torch references on the CPU: the kernels themselves are
    tested in tests/kernels, and the interpreter would make each step a hundred times slower."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_dataset(tmp_path_factory.mktemp("data"))


def build_dataset(root: Path) -> Path:
    """root/dataset: the json and email packages' sources, tokenized by a 512-token BPE
    trained on them (root/tokenizer); the same bytes each time with the same Python."""
    sources = [str(STDLIB / "json"), str(STDLIB / "email")]
    result = run_cli(
        "tokenizer", "train", f"input.path={sources}", "input.extensions=[.py]",
        f"output={root / 'tokenizer'}", "vocab_size=512",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    result = run_cli(
        "prepare", f"input.path={sources}", "input.extensions=[.py]",
        f"tokenizer.path={root / 'tokenizer'}", f"output.path={root / 'dataset'}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return root / "dataset"


def train_arguments(dataset: Path, experiment: Path, *overrides: str) -> list[str]:
    """A tiny StarCoder2-style run on the dataset, small enough for a CPU test."""
    return [
        "train", "-c", "examples/tiny.yaml",
        f"data.path=[{dataset}]", f"run.experiment_dir={experiment}",
        "model.base_model.vocab_size=512", "model.base_model.transformer.num_layers=2",
        "model.base_model.transformer.hidden_size=64", "model.base_model.transformer.ffn_hidden_size=128",
        "model.base_model.transformer.num_attention_heads=4", "model.base_model.transformer.window_size=32",
        "batch.sequence_length=48", "batch.batch_size=4", "batch.micro_batch_size=2",
        "training.logs.interval=1", "training.export.interval=null",
        "optimizer.learning_rate.warmup_iterations=2", "optimizer.learning_rate.decay_iterations=8",
        *overrides,
    ]  # fmt: skip


@pytest.fixture(scope="session")
def one_process(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`one_process(*overrides)`: the experiment directory of the one-process run of
    `train_arguments(dataset, ·, *overrides)`, trained at the first call with these overrides."""
    root = tmp_path_factory.mktemp("one_process")
    runs: dict[tuple[str, ...], Path] = {}

    def run(*overrides: str) -> Path:
        if overrides not in runs:
            experiment = root / str(len(runs))
            with pytest.MonkeyPatch.context() as patch:  # also when asked by a module fixture
                patch.delenv("TRITON_INTERPRET", raising=False)
                result = run_cli(*train_arguments(dataset, experiment, *overrides))
            assert result.returncode == 0, result.stderr
            runs[overrides] = experiment
        return runs[overrides]

    return run


@dataclass(frozen=True)
class Layout:
    """A run of `train_arguments(dataset, ·, *overrides)` on `ranks` ranks; `resumes` is a
    checkpoint directory copied into the run's before it starts, if it exists (one a run with
    more ranks wrote, or a one-process run)."""

    ranks: int
    overrides: tuple[str, ...]
    resumes: Path | None = None


@dataclass(frozen=True)
class Script:
    """Python source run on `ranks` ranks of a launch (`setup_distributed` there joins the
    run's process group); its directory (root/NAME, as a layout's) exists when it starts."""

    ranks: int
    source: str


@dataclass
class Launched:
    experiment: Path
    result: CliResult

    def succeeded(self) -> Path:
        assert self.result.returncode == 0, self.result.stderr
        return self.experiment


@pytest.fixture(scope="session")
def launches(
    request: pytest.FixtureRequest,
    dataset: Path,
    one_process: Callable[..., Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, dict[str, Launched]]:
    """The `layouts` of every module with tests in this session, by module name, trained in
    one torchrun launch per number of ranks."""
    root = tmp_path_factory.mktemp("layouts")
    modules = {getattr(item, "module", None) for item in request.session.items}
    named = {m.__name__: m for m in modules if m is not None and hasattr(m, "layouts")}
    layouts = {
        module: named[module].layouts(dataset, one_process, root / module)
        for module in sorted(named)
    }
    launched = launch(
        dataset,
        root,
        {f"{m}/{name}": layout for m, ls in layouts.items() for name, layout in ls.items()},
    )
    return {m: {name: launched[f"{m}/{name}"] for name in ls} for m, ls in layouts.items()}


@pytest.fixture(scope="module")
def launched(
    request: pytest.FixtureRequest, launches: dict[str, dict[str, Launched]]
) -> dict[str, Launched]:
    """This module's `layouts`, trained."""
    return launches[request.module.__name__]


def launch(
    dataset: Path, root: Path, layouts: Mapping[str, Layout | Script]
) -> dict[str, Launched]:
    """Every layout trained into root/NAME (NAME a relative path) and every script run, in one
    torchrun launch per number of ranks, most ranks first (a run may resume a checkpoint of a
    run with more)."""
    results = {}
    for ranks in sorted({layout.ranks for layout in layouts.values()}, reverse=True):
        runs: dict[str, list[str] | str] = {}
        for name, layout in layouts.items():
            if layout.ranks != ranks:
                continue
            if isinstance(layout, Script):
                (root / name).mkdir(parents=True)
                runs[name] = layout.source
                continue
            if layout.resumes is not None and layout.resumes.is_dir():  # else its test fails
                shutil.copytree(layout.resumes, root / name / "checkpoint" / layout.resumes.name)
            runs[name] = train_arguments(dataset, root / name, *layout.overrides)
        with pytest.MonkeyPatch.context() as patch:  # a session fixture: before the autouse one
            patch.delenv("TRITON_INTERPRET", raising=False)
            launched = torchrun_runs(
                ranks,
                {name.replace("/", "."): arguments for name, arguments in runs.items()},
                root / f"launch-{ranks}",
                timeout=300 + 20 * len(runs),  # runs take seconds, start-up tens
            )
        results |= {name: Launched(root / name, launched[name.replace("/", ".")]) for name in runs}
    return results
