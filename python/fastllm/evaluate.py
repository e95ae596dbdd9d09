"""`fastllm evaluate`: lm-eval-harness tasks on a fastllm checkpoint, export or Hugging Face
directory, alone or under torchrun, the model split as `model.distributed` and
`model.multi_stage` ask (tensor, pipeline, sequence-data and expert parallelism, ZeRO-3) and
the documents over the data-parallel ranks; the results written as JSON and printed as
lm-eval's tables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastllm.config import ConfigError
from fastllm.config.evaluate import EvaluateConfig
from fastllm.evaluation.model_files import context_length, generation_eos, load_tokenizer

if TYPE_CHECKING:
    from fastllm.engine.reference import ReferenceModel
    from fastllm.parallel.mesh import ParallelMesh
    from fastllm.parallel.process_group import Distributed

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
    tokenizer = load_tokenizer(
        tokenizer_directory,
        "tokenizer" if config.tokenizer else "pretrained.path",
        "set tokenizer to the directory of the model's tokenizer",
    )
    # Imported once the paths are known to be good (torch, transformers and lm-eval take
    # seconds); the tasks are checked before the model is loaded.
    from fastllm.evaluation.lm_eval_model import FastLLMLM
    from fastllm.evaluation.tasks import run_tasks, task_manager
    from fastllm.parallel.process_group import setup_distributed

    managers = {
        name: task_manager(evaluator, f"evaluators.{name}")
        for name, evaluator in config.evaluators.items()
    }
    distributed = setup_distributed()
    model, mesh = _model_on_mesh(config, model_directory, distributed)
    results = {}
    for name, evaluator in config.evaluators.items():
        lm = FastLLMLM(
            model.model,
            tokenizer,
            max_length=evaluator.max_length or context_length(model_directory, tokenizer),
            batch_size=evaluator.batch_size,
            max_gen_toks=evaluator.max_gen_toks,
            eos_token_ids=generation_eos(model_directory),
            data=mesh.data if mesh.document_groups is None else mesh.document_groups,
            stages=model.stages,
        )
        results[name] = run_tasks(lm, evaluator, managers[name])
    if distributed.rank != 0:
        return None
    output.write_text(json.dumps(results, indent=2, default=str) + "\n")
    _print_tables(results)
    print(f"results: {output}")
    return results


def _model_on_mesh(
    config: EvaluateConfig, directory: Path, distributed: Distributed
) -> tuple[ReferenceModel, ParallelMesh]:
    """The model of `directory` on this rank, split over the launch's ranks as `config.model`
    asks, in weights-only buffers (as a reference model is), in `config.dtype` (default: the
    dtype of its first tensor); and the mesh (every rank calls this)."""
    import torch

    from fastllm.checkpoint.formats import open_model
    from fastllm.config.layout import check_model_split, mesh_shape
    from fastllm.engine.reference import frozen_model
    from fastllm.parallel.mesh import build_mesh

    layout = config.model
    shape = mesh_shape(layout.distributed, distributed.world_size)
    source = open_model(directory)
    check_model_split(source.config, layout.multi_stage, layout.distributed)
    if config.dtype is not None:
        dtype = getattr(torch, config.dtype)
    else:
        dtype = next(iter(source.tensors()))[1].dtype
    num_layers = source.config.transformer.num_layers
    mesh = build_mesh(shape, distributed.rank)
    adapter = config.pretrained.adapter
    model = frozen_model(
        source,
        None if adapter is None else Path(adapter),
        mesh,
        compute_dtype=dtype,
        device=distributed.device,
        zero_stage=layout.multi_stage.zero_stage,
        layers_per_stage=layout.multi_stage.layers_per_stage,
        # Under the pipeline, each rank holds and runs its own stages (the passes walk them).
        num_stages=layout.multi_stage.num_stages(num_layers) if shape.pipeline > 1 else None,
    )
    return model, mesh


def _print_tables(results: dict[str, dict[str, Any]]) -> None:
    from lm_eval.utils import make_table

    for name, result in results.items():
        print(f"{name}:")
        print(make_table(result))
        if "groups" in result:
            print(make_table(result, "groups"))
