"""Shared parts of the property tests: how many examples a test draws (the hypothesis profile,
registered in tests/conftest.py, scales it), a guard against hangs, and the small prepared
dataset and distributed export whose files they damage."""

from __future__ import annotations

import contextlib
import faulthandler
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.data.conftest import prepare, run_cli, write_jsonl

SOURCES = Path(__file__).resolve().parents[2] / "python" / "fastllm" / "config"


def examples(bounded: int) -> int:
    """`bounded` examples under `make test`'s profile, proportionally more under `make fuzz`'s."""
    return bounded * settings().max_examples // 100


@contextlib.contextmanager
def no_hang(seconds: int = 60) -> Iterator[None]:
    """Ends the process with every thread's stack if the block runs past `seconds` (a hang in
    native code cannot be interrupted from Python)."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared directory of 18 documents, about 22,000 uint16 tokens (the config package's
    sources, 2,000 characters each) by a 300-token byte-level BPE."""
    root = tmp_path_factory.mktemp("small")
    texts = [path.read_text()[:2000] for path in sorted(SOURCES.glob("*.py"))]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
    )
    tokenizer.train_from_iterator(texts, trainer)
    (root / "tokenizer").mkdir()
    tokenizer.save(str(root / "tokenizer" / "tokenizer.json"))
    inputs = write_jsonl(root / "documents.jsonl", texts)
    return prepare(inputs, root / "tokenizer", root / "dataset")


@pytest.fixture(scope="session")
def small_run(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The experiment of a one-layer model trained one step on `small_dataset`: its distributed
    export and its checkpoint at step 1."""
    experiment = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("TRITON_INTERPRET", raising=False)  # the kernels' torch references
        result = run_cli(
            "train", "-c", "examples/tiny.yaml", f"data.path=[{small_dataset}]",
            f"run.experiment_dir={experiment}", "data.fim=null",
            "model.base_model.vocab_size=320", "model.base_model.transformer.num_layers=1",
            "model.base_model.transformer.hidden_size=32",
            "model.base_model.transformer.ffn_hidden_size=64",
            "model.base_model.transformer.num_attention_heads=2",
            "model.base_model.transformer.window_size=16",
            "batch.sequence_length=16", "batch.batch_size=2", "training.train_iters=1",
            "training.checkpoint.at_end=true", "training.export.interval=1",
            "training.export.format=distributed",
        )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return experiment


@pytest.fixture(scope="session")
def small_export(small_run: Path) -> Path:
    """The distributed export (manifest.json, rank_00000.safetensors) of `small_run`."""
    return small_run / "export" / "1"


@pytest.fixture(scope="session")
def small_checkpoint(small_run: Path) -> Path:
    """The checkpoint of `small_run` (weights, Adam's moments, random state, counters)."""
    return small_run / "checkpoint" / "1"
