"""`offload_optimizer`: the masters and Adam moments in host memory, streamed through the device
in chunks, update the model exactly as the state on the device does."""

from __future__ import annotations

import pytest
import torch

from fastllm.engine.model_stages import ModelStages
from fastllm.engine.optimizer import AdamW
from fastllm.engine.weights_io import load_full_parameters
from fastllm.model import GPTModel, initialize
from tests.engine.test_stage_buffers import tiny_config

CHUNK = 384
"""Elements per streamed chunk: chunks end inside parameters and weight-decay runs."""


def trained(
    device: torch.device, dtype: torch.dtype, offload: bool, chunk: int = CHUNK
) -> tuple[ModelStages, list[bool]]:
    """The tiny model's stages after four steps of the same batches (weight decay, clipping,
    a loss scale, the third step's gradient not finite), and which steps were skipped."""
    config = tiny_config()
    reference = GPTModel(config.model.base_model)
    initialize(reference, torch.Generator().manual_seed(0))
    with torch.device("meta"):
        model = GPTModel(config.model.base_model)
    stages = ModelStages(model, compute_dtype=dtype, device=device, offload_optimizer=offload)
    load_full_parameters(stages, reference.named_parameters())
    optimizer = AdamW(stages, config.optimizer, chunk=chunk)
    generator = torch.Generator().manual_seed(1)
    skipped = []
    for step in range(4):
        ids = torch.randint(0, 61, (2, 9), generator=generator).to(device)
        (model.loss(ids, ids) * 8.0).backward()
        stages.finish_backward()
        if step == 2:
            stages.dense.buffers.grads[1][5] = float("inf")
        skipped.append(optimizer.step(1e-2, loss_scale=8.0).skipped)
        stages.zero_grad()
    return stages, skipped


def assert_same_state(ours: ModelStages, theirs: ModelStages) -> None:
    """Weights, masters and moments, bit for bit."""
    shards = (ours.dense.buffers.shards.values(), theirs.dense.buffers.shards.values())
    for a, b in zip(*shards, strict=True):
        assert torch.equal(a.weight.cpu(), b.weight.cpu())
        assert torch.equal(a.master_values().cpu(), b.master_values().cpu())
        assert torch.equal(a.exp_avg.cpu(), b.exp_avg.cpu())
        assert torch.equal(a.exp_avg_sq.cpu(), b.exp_avg_sq.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_offloaded_steps_are_the_steps_on_the_device_bit_for_bit(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kernel's torch reference: the chunking is tested here, the kernel in tests/kernels.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    (offloaded, skipped), (on_device, expected) = (
        trained(cpu, dtype, offload) for offload in (True, False)
    )
    assert skipped == expected == [False, False, True, False]
    assert_same_state(offloaded, on_device)
    buffers = offloaded.dense.buffers
    assert any(shard.grad.numel() > 2 * CHUNK for shard in buffers.shards.values())
    for shard in buffers.shards.values():
        # bf16: the weights hold the masters' high halves, fp32: the weights are the masters.
        assert (shard.master is None) == (dtype == torch.bfloat16)
        assert (shard.master is shard.weight) == (dtype == torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("chunk", [CHUNK * 8, 1 << 25])
def test_offloaded_state_is_pinned_host_memory_and_steps_as_on_the_gpu(chunk: int) -> None:
    cuda = torch.device("cuda")
    offloaded, _ = trained(cuda, torch.bfloat16, offload=True, chunk=chunk)
    on_device, _ = trained(cuda, torch.bfloat16, offload=False)
    assert_same_state(offloaded, on_device)
    for shard in offloaded.dense.buffers.shards.values():
        for state in (shard.master_low, shard.exp_avg, shard.exp_avg_sq):
            assert state is not None and state.device.type == "cpu" and state.is_pinned()
        assert shard.weight.is_cuda and shard.grad.is_cuda
