"""A small real dataset (Python standard library sources, a trained tokenizer), made once."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from tests.test_cli import fastllm

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(autouse=True)
def without_triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Training runs use the kernels' torch references on the CPU: the kernels themselves are
    tested in tests/kernels, and the interpreter would make each step a hundred times slower."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    sources = [str(STDLIB / "json"), str(STDLIB / "email")]
    result = fastllm(
        "tokenizer", "train", f"input.path={sources}", "input.extensions=[.py]",
        f"output={root / 'tokenizer'}", "vocab_size=512",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    result = fastllm(
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
