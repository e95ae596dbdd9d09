"""ZeRO-3 on two Gloo processes: the gradients equal those of the unsharded model, and no more
than a stage, the next and (for a tied head) the embedding are ever gathered at once."""

from __future__ import annotations

from tests.data.conftest import CliResult

# Run by the fixture two_ranks (tests/engine/conftest.py).
TWO_RANKS = """
import torch
from fastllm.parallel.process_group import setup_distributed
from fastllm.model import GPTModel, initialize
from tests.engine.shards import assert_shard_gradients_double, two_rank_stages
from tests.engine.test_stage_buffers import tiny_config

distributed = setup_distributed()
config = tiny_config("model.base_model.transformer.num_layers=4", "model.multi_stage.recompute=none")
reference = GPTModel(config.model.base_model)
initialize(reference, torch.Generator().manual_seed(0))
model, stages = two_rank_stages(config, reference, distributed.rank, zero_stage=3)
gatherer = stages.dense.gatherer
assert all(b.untyped_storage().nbytes() == 0 for b in gatherer.buffers)

most = 0
prefetch = gatherer.prefetch
def counting_prefetch(stage, whole=False):
    global most
    prefetch(stage, whole)
    most = max(most, len(gatherer.gathered))
gatherer.prefetch = counting_prefetch

tokens = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(1))
labels = torch.roll(tokens, -1, dims=1)
model.loss(tokens, labels).backward()
stages.finish_backward()
reference.loss(tokens, labels).backward()

assert all(b.untyped_storage().nbytes() == 0 for b in gatherer.buffers), "weights left gathered"
grads = {name: p.grad for name, p in reference.named_parameters()}
assert_shard_gradients_double(stages.dense.buffers, grads, distributed.rank, rtol=1e-5, atol=1e-6)
# 4 stages (the embedding with the first block, the final norm and the tied head with the
# last): never more than 3 at once (running stage 2 with stage 3 and the embedding ahead).
assert most == 3, most
"""


def test_zero3_gathers_stages_just_in_time_with_exact_gradients(two_ranks: CliResult) -> None:
    assert two_ranks.returncode == 0, two_ranks.stderr
