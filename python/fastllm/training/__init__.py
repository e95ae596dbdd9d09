"""Training: the `Trainer` (model on flat buffers, optimizer, data position, checkpoints) and
its loop, for `fastllm train` and custom loops alike.

- `trainer`: the `Trainer` and its loop; `setup`: the config checks that need the file system.
- `state`: checkpoints, exports and resumption of the trainer's state.
- `metrics`, `metrics_file`: what a run reports, and `metrics.jsonl`; `profiling`:
  `training.profile`.
- `experiment_lock`: one run per experiment directory.
"""

from fastllm.training.trainer import Trainer

__all__ = ["Trainer"]
