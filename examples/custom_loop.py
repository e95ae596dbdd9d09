"""A custom training loop on fastllm's Python API: the config builds the engine (the model on
its flat buffers, the step's program, AdamW, the loss scale); the loop is yours. It trains two
steps, checkpoints, and a second run resumes from that checkpoint to the end.

    python examples/custom_loop.py   (FASTLLM_EXAMPLE_DATA: a prepared dataset directory)
"""

from __future__ import annotations

import os

from fastllm.config import TrainerConfig, load_config
from fastllm.data import TokenDataset
from fastllm.training import Trainer

data = os.environ.get("FASTLLM_EXAMPLE_DATA", "exp/demo/dataset")
experiment = os.environ.get("FASTLLM_EXAMPLE_DIR", "exp/custom_loop")
vocab_size = TokenDataset(data).metadata["vocab_size"]
config = load_config(
    TrainerConfig,
    ["examples/tiny.yaml"],
    [f"data.path=[{data}]", f"run.experiment_dir={experiment}",
     f"model.base_model.vocab_size={vocab_size}", "model.base_model.transformer.num_layers=2",
     "batch.sequence_length=64", "batch.batch_size=4", "training.train_iters=3"],
)  # fmt: skip


def train(until: int) -> None:
    trainer = Trainer(config)
    trainer.resume()  # the experiment's newest checkpoint, if there is one
    engine = trainer.engine
    for micro_batches in trainer.data_loader():  # this rank's micro-batches of each step
        metrics = engine.train_step(micro_batches)  # forward, backward, reduce, AdamW
        print(f"step {engine.state.step}: loss {metrics['loss']:.4f}, lr {metrics['lr']:.2e}")
        if engine.state.step == until:
            break
    print(f"checkpoint: {trainer.save_checkpoint()}")  # written in the background
    trainer.wait_for_checkpoints()


train(until=2)
train(until=config.training.train_iters)  # resumes at step 2
