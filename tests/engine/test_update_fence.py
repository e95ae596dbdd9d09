"""The offloaded update runs beside the next step (engine/update_fence.py): stage by stage, each
stage's forward pass waiting for its own stage's update only, a ZeRO gather or refresh of a
stage for that stage's, and whatever reads the state in host memory (a checkpoint, the next
update's copies in) for every copy back. On a CPU nothing is asynchronous: recording streams
log what the update and the step ask of them."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import Tensor

from fastllm.checkpoint.distributed import STATE_KINDS
from fastllm.engine.checkpointing import sharded_state
from fastllm.engine.model_stages import ModelStages
from fastllm.engine.optimizer import AdamW
from fastllm.engine.stages import stage_modules
from fastllm.engine.update_fence import Stream
from fastllm.engine.weights_io import load_full_parameters
from fastllm.model import GPTModel, initialize
from tests.engine.test_offloaded_optimizer import CHUNK, assert_same_state
from tests.engine.test_stage_buffers import tiny_config

FOUR_STAGES = "model.base_model.transformer.num_layers=4"


class RecordingStreams:
    """A CPU's streams (each operation done when it returns) that log what is asked of them,
    with the forward passes of the stages (`log_forward`); a mark is its record's index in
    `log`."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []

    def on(self, stream: Stream) -> nullcontext[None]:
        return nullcontext()

    def record(self, stream: Stream) -> int:
        self.log.append(("record", stream))
        return len(self.log) - 1

    def wait(self, stream: Stream, mark: Any) -> None:
        self.log.append(("wait", stream, mark))

    def synchronize(self, mark: Any) -> None:
        self.log.append(("synchronize", mark))

    def keep(self, tensor: Tensor, stream: Stream) -> None:
        self.log.append(("keep", stream))

    def log_forward(self, model: GPTModel) -> None:
        """Log each stage's forward pass as it starts (after the engine's own hooks)."""
        for stage, modules in enumerate(stage_modules(model, 1)):
            modules[0].register_forward_pre_hook(
                lambda *_, stage=stage: self.log.append(("forward", stage))
            )

    def compute_waits(self, since: int = 0) -> list[tuple[Any, ...]]:
        """The compute stream's waits and the forward passes logged from `since` on."""
        return [e for e in self.log[since:] if e[0] == "forward" or e[:2] == ("wait", "compute")]


def step(model: GPTModel, stages: ModelStages, optimizer: AdamW, seed: int) -> None:
    """A forward and backward pass of a batch, the optimizer step."""
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(seed))
    model.loss(ids, ids).backward()
    stages.finish_backward()
    optimizer.step(1e-2)
    stages.zero_grad()


def offloaded(streams: RecordingStreams) -> tuple[GPTModel, ModelStages, AdamW]:
    config = tiny_config(FOUR_STAGES)
    reference = GPTModel(config.model.base_model)
    initialize(reference, torch.Generator().manual_seed(0))
    with torch.device("meta"):
        model = GPTModel(config.model.base_model)
    cpu = torch.device("cpu")
    stages = ModelStages(
        model, compute_dtype=torch.float32, device=cpu, offload_optimizer=True, streams=streams
    )
    load_full_parameters(stages, reference.named_parameters())
    streams.log_forward(model)
    return model, stages, AdamW(stages, config.optimizer, chunk=CHUNK)


def test_each_stage_forward_waits_for_its_own_stage_update_only() -> None:
    streams = RecordingStreams()
    model, stages, optimizer = offloaded(streams)
    step(model, stages, optimizer, seed=1)
    marks = stages.fence.updated
    assert sorted(marks) == list(range(len(stages.stages))) == [0, 1, 2, 3]
    # Stage by stage in the forward passes' order, each mark past its stage's chunks (their
    # copies back queued after their update), and nothing waited for the update.
    bounds = [0, *(marks[s] for s in range(4))]
    for s, shard in stages.dense.buffers.shards.items():
        stores = [
            e for e in streams.log[bounds[s] : bounds[s + 1]] if e[:2] == ("wait", "download")
        ]
        assert len(stores) == -(-shard.grad.numel() // CHUNK) > 1
    assert stages.fence.stored > marks[3]
    assert not [e for e in streams.log if e[0] == "synchronize"]
    assert [e for e in streams.compute_waits() if e[0] == "wait"] == []
    since = len(streams.log)
    expected = [e for s in range(4) for e in (("wait", "compute", marks[s]), ("forward", s))]
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(2))
    model.loss(ids, ids)
    assert streams.compute_waits(since) == expected


def test_the_state_is_read_after_every_copy_back() -> None:
    streams = RecordingStreams()
    model, stages, optimizer = offloaded(streams)
    step(model, stages, optimizer, seed=1)
    stored = stages.fence.stored
    since = len(streams.log)
    step(model, stages, optimizer, seed=2)
    # The second update's first copy in waits for the first update's last copy back.
    uploads = [e for e in streams.log[since:] if "upload" in e]
    assert uploads[0] == ("wait", "upload", stored)
    marks, stored = dict(stages.fence.updated), stages.fence.stored
    since = len(streams.log)
    sharded_state(stages, STATE_KINDS)  # what a checkpoint saves
    waits = [("wait", "compute", marks[s]) for s in range(4)]
    assert streams.log[since:] == [*waits, ("synchronize", stored)]
    assert stages.fence.updated == {} and stages.fence.stored is None


def trained_on_the_gpu(offload: bool, overlap: bool) -> tuple[list[Tensor], ModelStages]:
    """Six steps' losses of the tiny model in bf16 on the GPU (clipped, a chunk smaller than
    a stage) and its stages after them; `overlap` false: the host waits for each update as
    it is queued (what the update did before it ran beside the step)."""
    cuda = torch.device("cuda")
    config = tiny_config(FOUR_STAGES)
    reference = GPTModel(config.model.base_model)
    initialize(reference, torch.Generator().manual_seed(0))
    with torch.device("meta"):
        model = GPTModel(config.model.base_model)
    stages = ModelStages(
        model, compute_dtype=torch.bfloat16, device=cuda, offload_optimizer=offload
    )
    load_full_parameters(stages, reference.named_parameters())
    optimizer = AdamW(stages, config.optimizer, chunk=CHUNK * 8)
    losses = []
    for seed in range(6):
        ids = torch.randint(0, 61, (4, 33), generator=torch.Generator().manual_seed(seed))
        loss = model.loss(ids.to(cuda), ids.to(cuda))  # read at the end: no wait in between
        loss.backward()
        stages.finish_backward()
        optimizer.step(1e-2)
        stages.zero_grad()
        if not overlap:
            stages.fence.wait_for_state()
            torch.cuda.synchronize()
        losses.append(loss.detach())
    return losses, stages


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_the_gpu_the_overlapped_update_trains_as_the_waited_one_bit_for_bit() -> None:
    overlapped, ours = trained_on_the_gpu(offload=True, overlap=True)
    waited, theirs = trained_on_the_gpu(offload=True, overlap=False)
    on_device, _ = trained_on_the_gpu(offload=False, overlap=False)
    assert torch.equal(torch.stack(overlapped), torch.stack(waited))
    assert torch.equal(torch.stack(overlapped), torch.stack(on_device))
    ours.fence.wait_for_state()
    assert_same_state(ours, theirs)


# Run by the fixture two_ranks (tests/conftest.py): ZeRO-1's refresh and ZeRO-3's gathers of
# a stage's shard wait for that stage's update; under ZeRO-3 a stage's forward pass waits for
# its own update and the next stage's (gathered ahead), no more.
TWO_RANKS = """
import torch
import torch.distributed as dist
from fastllm.engine.data_parallel import gather_weights
from fastllm.engine.optimizer import AdamW
from fastllm.model import GPTModel, initialize
from fastllm.parallel.process_group import setup_distributed
from tests.engine.shards import two_rank_stages
from tests.engine.test_offloaded_optimizer import CHUNK, assert_same_state
from tests.engine.test_stage_buffers import tiny_config
from tests.engine.test_update_fence import FOUR_STAGES, RecordingStreams, step

distributed = setup_distributed()
config = tiny_config(FOUR_STAGES)
reference = GPTModel(config.model.base_model)
initialize(reference, torch.Generator().manual_seed(0))
all_gather = dist.all_gather_into_tensor
for zero_stage in (1, 3):
    streams = RecordingStreams()
    model, stages = two_rank_stages(
        config, reference, distributed.rank, zero_stage, offload_optimizer=True, streams=streams
    )
    streams.log_forward(model)
    group = stages.dense
    outputs = (
        group.gatherer.buffers if zero_stage == 3 else [s.weights for s in group.buffers.stages]
    )

    def logged(output, source, group=None, async_op=False):
        streams.log.append(("gather", next(i for i, o in enumerate(outputs) if o is output)))
        return all_gather(output, source, group=group, async_op=async_op)

    dist.all_gather_into_tensor = logged
    optimizer = AdamW(stages, config.optimizer, chunk=CHUNK)
    step(model, stages, optimizer, seed=1)
    marks = dict(stages.fence.updated)
    assert sorted(marks) == [0, 1, 2, 3], marks
    since = len(streams.log)
    gather_weights(stages, wait=False)
    model.loss(*[torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(2))] * 2)
    dist.all_gather_into_tensor = all_gather
    waited, gathered = set(), set()
    for entry in streams.log[since:]:
        if entry[:2] == ("wait", "compute"):
            waited.add(next(s for s, m in marks.items() if m == entry[2]))
        elif entry[0] == "gather":
            assert entry[1] in waited, (zero_stage, entry, waited)
            gathered.add(entry[1])
        elif entry[0] == "forward" and zero_stage == 3:
            ahead = {s for s in (entry[1] + 1,) if s < 4}
            assert waited == set(range(entry[1] + 1)) | ahead, (entry, waited)
    assert gathered == waited == {0, 1, 2, 3}, (zero_stage, gathered, waited)
"""


def test_zero_gathers_of_a_stage_wait_for_its_update(two_ranks: Any) -> None:
    assert two_ranks.returncode == 0, two_ranks.stderr
