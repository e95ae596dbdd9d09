"""`fastllm evaluate`: lm-eval-harness tasks on a fastllm checkpoint, export or Hugging Face
directory, alone or on the data-parallel ranks of a torchrun launch; the results written as
JSON and printed as lm-eval's tables."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from fastllm.config import ConfigError
from fastllm.config.evaluate import EvaluateConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

RESULTS_FILE = "evaluation.json"
"""Where the results go in the model's directory when the config names no `output`."""


def evaluate(config: EvaluateConfig) -> dict[str, dict[str, Any]] | None:
    """lm-eval's results of each evaluator of `config`, by name, on rank 0 (None on the
    others), also written to `output` as JSON and printed as tables."""
    model_directory = Path(config.pretrained.path)
    if not model_directory.is_dir():
        raise ConfigError("pretrained.path", f"{model_directory}: no such model directory")
    output = Path(config.output) if config.output else model_directory / RESULTS_FILE
    if not output.parent.is_dir():
        raise ConfigError("output", f"{output.parent}: no such directory")
    for name, evaluator in config.evaluators.items():
        if evaluator.include_path is not None and not Path(evaluator.include_path).is_dir():
            raise ConfigError(
                f"evaluators.{name}.include_path", f"{evaluator.include_path}: no such directory"
            )
    tokenizer_directory = Path(config.tokenizer) if config.tokenizer else model_directory
    tokenizer = _tokenizer(
        tokenizer_directory, "tokenizer" if config.tokenizer else "pretrained.path"
    )
    # Imported once the paths are known to be good (torch, transformers and lm-eval take
    # seconds); the tasks are checked before the model is loaded.
    import torch

    from fastllm.api import load_model
    from fastllm.evaluation.lm_eval_model import FastLLMLM
    from fastllm.evaluation.tasks import run_tasks, task_manager
    from fastllm.parallel.process_group import setup_distributed

    managers = {
        name: task_manager(evaluator, f"evaluators.{name}")
        for name, evaluator in config.evaluators.items()
    }
    distributed = setup_distributed()
    dtype = None if config.dtype is None else getattr(torch, config.dtype)
    model = load_model(
        model_directory, distributed.device, dtype, adapter=config.pretrained.adapter
    )
    results = {}
    for name, evaluator in config.evaluators.items():
        lm = FastLLMLM(
            model,
            tokenizer,
            max_length=evaluator.max_length or context_length(model_directory, tokenizer),
            batch_size=evaluator.batch_size,
            max_gen_toks=evaluator.max_gen_toks,
            eos_token_ids=generation_eos(model_directory),
        )
        results[name] = run_tasks(lm, evaluator, managers[name])
    if distributed.rank != 0:
        return None
    output.write_text(json.dumps(results, indent=2, default=str) + "\n")
    _print_tables(results)
    print(f"results: {output}")
    return results


def _tokenizer(directory: Path, key: str) -> PreTrainedTokenizerBase:
    """The tokenizer of `directory` as lm-eval's hf backend loads it (AutoTokenizer)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not directory.is_dir():
        raise ConfigError(key, f"{directory}: no such directory")
    if not any((directory / name).is_file() for name in names):
        raise ConfigError(
            key,
            f"{directory} has no tokenizer files ({', '.join(names)}): set tokenizer to the "
            "directory of the model's tokenizer",
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as error:
        raise ConfigError(key, f"{directory}: not a tokenizer ({error})") from None


def _hf_config(directory: Path) -> dict[str, Any]:
    """The Hugging Face config of the model: config.json, or the one a fastllm export keeps
    in metadata.json; empty when there is none."""
    for name, field in (("config.json", None), ("metadata.json", "hf_config")):
        path = directory / name
        if path.is_file():
            value = json.loads(path.read_text(encoding="utf-8"))
            value = value.get(field) if field else value
            if isinstance(value, dict):
                return value
    return {}


def context_length(directory: Path, tokenizer: PreTrainedTokenizerBase) -> int:
    """The context length lm-eval's hf backend would use: the config's, else the
    tokenizer's, else 2048."""
    from lm_eval.models.utils import resolve_max_length

    return resolve_max_length(SimpleNamespace(**_hf_config(directory)), tokenizer)


def generation_eos(directory: Path) -> list[int] | None:
    """The end-of-sequence tokens of generation_config.json (what `generate` stops at in the
    hf backend), if the directory has one."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return None
    eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    return None if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _print_tables(results: dict[str, dict[str, Any]]) -> None:
    from lm_eval.utils import make_table

    for name, result in results.items():
        print(f"{name}:")
        print(make_table(result))
        if "groups" in result:
            print(make_table(result, "groups"))
