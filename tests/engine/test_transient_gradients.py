"""ZeRO-1 on two Gloo processes with transient gradient buffers: no memory outside the backward
pass and the optimizer step, and each step's summed shards exact (the buffers come back
garbage and are overwritten)."""

from __future__ import annotations

from tests.data.conftest import CliResult

# Run by the fixture two_ranks (tests/engine/conftest.py).
TWO_RANKS = """
import torch
from fastllm.engine.data_parallel import gather_weights
from fastllm.engine.optimizer import AdamW
from fastllm.parallel.process_group import setup_distributed
from fastllm.model import GPTModel, initialize
from tests.engine.shards import assert_shard_gradients_double, two_rank_stages
from tests.engine.test_stage_buffers import tiny_config

distributed = setup_distributed()
config = tiny_config("model.multi_stage.recompute=none")
reference = GPTModel(config.model.base_model)
initialize(reference, torch.Generator().manual_seed(0))
model, stages = two_rank_stages(config, reference, distributed.rank, zero_stage=1)
buffers = stages.dense.buffers
optimizer = AdamW(stages, config.optimizer)
generator = torch.Generator().manual_seed(1)


def released() -> bool:
    return all(g.untyped_storage().nbytes() == 0 for g in buffers.grads)


assert stages.dense.reducer is not None and released()
for step in range(2):
    tokens = torch.randint(0, 61, (2, 16), generator=generator)
    labels = torch.roll(tokens, -1, dims=1)
    stages.arm_reduction(True)  # the step's last backward pass: ZeRO-1 sums during it
    model.loss(tokens, labels).backward()
    stages.finish_backward()
    assert not released(), step
    reference.zero_grad()
    reference.loss(tokens, labels).backward()
    grads = {name: p.grad for name, p in reference.named_parameters()}
    assert_shard_gradients_double(buffers, grads, distributed.rank, rtol=1e-5, atol=1e-6)
    optimizer.step(1e-3)
    gather_weights(stages)  # every rank's updated shards into the full weights
    stages.zero_grad()
    with torch.no_grad():  # the next step compares like with like
        for name, parameter in reference.named_parameters():
            parameter.copy_(model.get_parameter(name))
    assert released(), step
"""


def test_zero1_gradients_hold_memory_only_from_the_backward_pass_to_the_step(
    two_ranks: CliResult,
) -> None:
    assert two_ranks.returncode == 0, two_ranks.stderr
