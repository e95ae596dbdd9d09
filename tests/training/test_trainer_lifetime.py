"""A Trainer its owner drops frees its model and buffers: the Python API may run several in one
process (a sweep, a notebook), and each holds the model's weights, gradients and optimizer
state."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

from tests.training.test_training_options import trainer


def test_a_dropped_trainer_frees_its_model(dataset: Path, tmp_path: Path) -> None:
    run = trainer(dataset, tmp_path / "run", "training.train_iters=1")
    for micro_batches in run.data_loader():
        run.train_step(micro_batches)
    held = [weakref.ref(run.flat), *(weakref.ref(p) for p in run.model.parameters())]
    held += [weakref.ref(run.flat.weights[0]), weakref.ref(run.flat.grads[0])]
    del run, micro_batches
    gc.collect()
    assert [ref for ref in held if ref() is not None] == []
