"""A custom training loop on fastllm's Python API: the config builds the model on its flat
buffers, the data loader and the optimizer; the loop is yours.

    python examples/custom_loop.py   (FASTLLM_EXAMPLE_DATA: a prepared dataset directory)
"""

from __future__ import annotations

import os

from fastllm.config import TrainerConfig, load_config
from fastllm.data import TokenDataset
from fastllm.training import Trainer

data = os.environ.get("FASTLLM_EXAMPLE_DATA", "exp/demo/dataset")
experiment = os.environ.get("FASTLLM_EXAMPLE_DIR", "exp/custom_loop")
config = load_config(
    TrainerConfig,
    ["examples/tiny.yaml"],
    [
        f"data.path=[{data}]",
        f"run.experiment_dir={experiment}",
        f"model.base_model.vocab_size={TokenDataset(data).metadata['vocab_size']}",
        "model.base_model.transformer.num_layers=2",
        "batch.sequence_length=64",
        "batch.batch_size=4",
        "training.train_iters=3",
    ],
)
trainer = Trainer(config)  # the model on flat buffers (fp32 masters), AdamW, loss scale
for micro_batches in trainer.data_loader():  # this rank's micro-batches of one step
    # last=True on the step's last micro-batch lets data parallelism (ZeRO-1) sum the gradients
    # over ranks during that backward pass instead of after it.
    last = len(micro_batches) - 1
    losses = [
        trainer.forward_backward(batch, weight=1 / len(micro_batches), last=i == last)
        for i, batch in enumerate(micro_batches)
    ]
    report = trainer.optimizer_step()  # clip, update, advance the schedule
    trainer.consumed_samples += config.batch.batch_size
    print(
        f"step {trainer.step}: loss {sum(loss.item() for loss in losses) / len(losses):.4f}, lr {report['lr']:.2e}"
    )
    if trainer.step == config.training.train_iters:
        break
directory = trainer.save_checkpoint()  # written in the background
trainer.wait_for_checkpoints()
print(f"checkpoint: {directory}")
