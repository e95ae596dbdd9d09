"""lm-eval tasks run on a model through lm-eval's own `simple_evaluate`: its task loading,
few-shot sampling, splitting of the documents over the ranks, metrics and gathering."""

from __future__ import annotations

import math
from typing import Any

from lm_eval import simple_evaluate
from lm_eval.api.model import LM
from lm_eval.tasks import TaskManager

from fastllm.config import ConfigError
from fastllm.config.evaluation import LmEvalEvaluatorConfig


def task_manager(config: LmEvalEvaluatorConfig, key: str = "") -> TaskManager:
    """lm-eval's index of the tasks of `config`, each checked to exist (`ConfigError` naming
    `key`.tasks otherwise). Tasks all found in `include_path` are indexed from there alone:
    indexing lm-eval's own thousands of task files takes seconds."""
    if config.include_path is not None:
        local = TaskManager(include_path=config.include_path, include_defaults=False)
        if all(task in local.all_tasks for task in config.tasks):
            return local
    manager = TaskManager(include_path=config.include_path)
    for task in config.tasks:
        if task not in manager.all_tasks:
            where = f" nor in {config.include_path}" if config.include_path else ""
            raise ConfigError(
                f"{key}.tasks" if key else "tasks",
                f"unknown lm-eval task {task!r}: not among lm-eval's tasks{where}",
            )
    return manager


def run_tasks(lm: LM, config: LmEvalEvaluatorConfig, manager: TaskManager) -> dict[str, Any] | None:
    """lm-eval's results (`results`, `versions`, `n-shot`, `configs`, …; no samples) of the
    tasks of `config` (found in `manager`) on `lm`, on rank 0; None on the other ranks."""
    results = simple_evaluate(
        model=lm,
        tasks=list(config.tasks),
        num_fewshot=config.num_fewshot,
        limit=config.limit,
        bootstrap_iters=config.bootstrap_iters,
        log_samples=False,
        task_manager=manager,
    )
    return None if results is None else dict(results)


def numeric_metrics(results: dict[str, Any]) -> dict[str, float]:
    """The finite numeric metrics of lm-eval's `results`, as TASK_METRIC (`copa_acc`,
    `copa_acc_stderr`; a filter other than lm-eval's `none` appended: `gsm8k_exact_match_
    strict-match`)."""
    metrics = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, comma, applied = key.partition(",")
            if not comma or isinstance(value, bool) or not isinstance(value, int | float):
                continue  # alias, sample counts; a standard error lm-eval could not give ("N/A")
            if math.isfinite(value):
                name = metric if applied == "none" else f"{metric}_{applied}"
                metrics[f"{task}_{name}"] = float(value)
    return metrics
