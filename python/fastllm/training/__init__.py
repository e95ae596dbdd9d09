"""Training: the `Trainer` (model on flat buffers, optimizer, data position, checkpoints) and
its loop, for `fastllm train` and custom loops alike."""

from fastllm.training.trainer import Trainer

__all__ = ["Trainer"]
