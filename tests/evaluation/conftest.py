"""What the evaluation tests share: a tiny random Llama saved by `transformers`, with a
byte-level BPE tokenizer trained on the test tasks' documents, in one Hugging Face directory
that lm-eval's `hf` backend loads as it is; and that backend's results on the test tasks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.data.conftest import run_cli
from tests.model.hf_models import save_hf_model

TASKS_DIRECTORY = Path(__file__).parent / "tasks"
TASKS = ["fastllm_multiple_choice", "fastllm_perplexity", "fastllm_generation"]
"""A multiple-choice task (loglikelihood), a perplexity task (loglikelihood_rolling) and a
generation task (generate_until), each of tasks/NAME.yaml."""
CONTEXT = 64
"""The model's max_position_embeddings: long questions are cut from the left, texts are scored
over several windows, prompts leave room for the generated tokens."""


@pytest.fixture(autouse=True)
def without_triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels' torch references (tests/kernels tests the kernels themselves)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture(scope="session")
def model_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saved_model(tmp_path_factory.mktemp("lm_eval"), "llama")


@pytest.fixture(scope="session")
def moe_model_directory(model_directory: Path) -> Path:
    """A mixture of experts (Mixtral: 4 experts, 2 a token) with the same tokenizer."""
    return saved_model(model_directory.parent, "mixtral")


def saved_model(root: Path, architecture: str) -> Path:
    """root/ARCHITECTURE: a random `architecture` of the tests' shapes with the tokenizer
    trained on the test tasks' documents (root/tokenizer, trained at the first call)."""
    tokenizer = root / "tokenizer"
    if not tokenizer.is_dir():
        corpus = root / "corpus.jsonl"
        with corpus.open("w") as lines:
            for file in sorted(TASKS_DIRECTORY.glob("*.jsonl")):
                for line in file.read_text().splitlines():
                    text = " ".join(str(value) for value in json.loads(line).values())
                    lines.write(json.dumps({"text": text}) + "\n")
        result = run_cli(
            "tokenizer", "train", f"input.path={corpus}", f"output={tokenizer}", "vocab_size=300"
        )
        assert result.returncode == 0, result.stderr
    eos = json.loads((tokenizer / "tokenizer.json").read_text())["added_tokens"][0]
    assert eos["content"] == "<|endoftext|>"
    model = root / architecture
    save_hf_model(
        architecture, model, vocab_size=300, max_position_embeddings=CONTEXT,
        bos_token_id=None, eos_token_id=eos["id"], pad_token_id=None,
    )  # fmt: skip
    for file in tokenizer.iterdir():
        shutil.copy(file, model)
    return model


@pytest.fixture(scope="session")
def hf_backend_results(model_directory: Path) -> dict[str, Any]:
    """lm-eval's `hf` backend on the model in fp32, with every request's response."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model = HFLM(pretrained=str(model_directory), dtype="float32", batch_size=4, device="cpu")
    results = simple_evaluate(
        model=model,
        tasks=TASKS,
        task_manager=TaskManager(include_path=str(TASKS_DIRECTORY), include_defaults=False),
        bootstrap_iters=0,
    )
    assert results is not None
    return dict(results)
