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
    # Each micro-batch's weight: its share of the trained tokens of the whole global batch (the
    # weights of all ranks sum to 1). last=True on the step's last micro-batch lets data
    # parallelism (ZeRO-1) sum the gradients over ranks during that backward pass.
    shares = trainer.token_shares(micro_batches)
    last = len(micro_batches) - 1
    losses = [
        trainer.forward_backward(batch, weight=share, last=i == last)
        for i, (batch, share) in enumerate(zip(micro_batches, shares, strict=True))
    ]
    report = trainer.optimizer_step()  # clip, update, advance the schedule
    trainer.consumed_samples += config.batch.batch_size
    loss = sum(
        share * loss.item() for share, loss in zip(shares, losses, strict=True)
    )  # this rank's part
    print(f"step {trainer.step}: loss {loss:.4f}, lr {report['lr']:.2e}")
    if trainer.step == config.training.train_iters:
        break
directory = trainer.save_checkpoint()  # written in the background
trainer.wait_for_checkpoints()
print(f"checkpoint: {directory}")
