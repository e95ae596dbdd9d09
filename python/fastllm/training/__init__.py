"""Training: the loop around an `Engine` (`engine.build`): data loaders from its data position,
logging, validation, checkpoint and export cadence, signals; for `fastllm train` and custom
loops alike.

- `trainer`: the `Trainer` and its loop, which a signal ends as `Stopped`; `setup`: the config checks that need the file system.
- `state`: when and where checkpoints and exports are written, and resumption.
- `evaluators`: the runners of `training.evaluators` (and `training.validation`).
- `metrics`, `metrics_file`: what a run reports, and `metrics.jsonl`; `energy`: what it costs
  (the GPU driver's energy counter); `profiling`: `training.profile`.
- `experiment_lock`: one run per experiment directory.
"""

from fastllm.training.trainer import Stopped, Trainer

__all__ = ["Stopped", "Trainer"]
