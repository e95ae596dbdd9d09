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
        run.engine.train_step(micro_batches)
    buffers = run.engine.stages.dense.buffers
    held = [
        weakref.ref(run.engine.stages),
        *(weakref.ref(p) for p in run.engine.model.parameters()),
    ]
    held += [weakref.ref(buffers.stages[0].weights), weakref.ref(buffers.grads[0])]
    del run, micro_batches, buffers
    gc.collect()
    assert [ref for ref in held if ref() is not None] == []
