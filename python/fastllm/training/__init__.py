"""Training: the loop around an `Engine` (`engine.build`): data loaders from its data position,
logging, validation, checkpoint and export cadence, signals; for `fastllm train` and custom
loops alike.

- `trainer`: the `Trainer` and its loop, which a signal ends as `Stopped`; `setup`: the config checks that need the file system.
- `state`: when and where checkpoints and exports are written, and resumption.
- `metrics`, `metrics_file`: what a run reports, and `metrics.jsonl`; `profiling`:
  `training.profile`.
- `experiment_lock`: one run per experiment directory.
"""

from fastllm.training.trainer import Stopped, Trainer

__all__ = ["Stopped", "Trainer"]
