"""ZeRO-3 on two Gloo processes: the gradients equal those of the unsharded model, and no more
than a stage, the next and (for a tied head) the embedding are ever gathered at once."""

from __future__ import annotations

from tests.torchrun import torchrun_script

SCRIPT = """
import torch
from fastllm.engine.flat_model import FlatModel
from fastllm.engine.mesh import build_mesh
from fastllm.engine.process_group import setup_distributed
from fastllm.model import GPTModel, initialize
from tests.engine.test_flat_training import tiny_config

distributed = setup_distributed()
config = tiny_config("model.base_model.transformer.num_layers=4", "model.multi_stage.recompute=none")
reference = GPTModel(config.model.base_model)
initialize(reference, torch.Generator().manual_seed(0))
with torch.device("meta"):
    model = GPTModel(config.model.base_model)
flat = FlatModel(
    model, compute_dtype=torch.float32, device=torch.device("cpu"),
    mesh=build_mesh(config.model.distributed, 2, distributed.rank), zero_stage=3,
)
flat.load_full_parameters(reference.named_parameters())
gatherer = flat.gatherer
assert all(b.untyped_storage().nbytes() == 0 for b in gatherer.buffers)

most = 0
prefetch = gatherer.prefetch
def counting_prefetch(stage):
    global most
    prefetch(stage)
    most = max(most, len(gatherer.gathered))
gatherer.prefetch = counting_prefetch

tokens = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(1))
labels = torch.roll(tokens, -1, dims=1)
model.loss(tokens, labels).backward()
flat.finish_backward()
reference.loss(tokens, labels).backward()

assert all(b.untyped_storage().nbytes() == 0 for b in gatherer.buffers), "weights left gathered"
for stage, shard in flat.shards.items():
    start, end = flat.layout.shard_range(stage, distributed.rank)
    full = torch.zeros(flat.layout.stage_size(stage))
    for index, name in enumerate(flat.names):
        s, offset, numel = flat.layout.parameter(index)
        if s == stage:
            full[offset : offset + numel] = dict(reference.named_parameters())[name].grad.reshape(-1)
    # Each rank's summed gradient is twice the reference: both ranks ran the same batch.
    torch.testing.assert_close(shard.grad, 2 * full[start:end], rtol=1e-5, atol=1e-6)
# 4 stages (the embedding with the first block, the final norm and the tied head with the
# last): never more than 3 at once (running stage 2 with stage 3 and the embedding ahead).
assert most == 3, most
"""


def test_zero3_gathers_stages_just_in_time_with_exact_gradients() -> None:
    result = torchrun_script(2, SCRIPT)
    assert result.returncode == 0, result.stderr
