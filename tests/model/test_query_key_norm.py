"""The QK-norm over all heads (OLMo 2's) on two Gloo processes, each holding half the heads,
against RMSNorm over the whole projection in one: values and gradients."""

from __future__ import annotations

from tests.data.conftest import CliResult

# Run by the fixture two_ranks (tests/conftest.py).
TWO_RANKS = """
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fastllm.config.model import RMSNormConfig
from fastllm.model.query_key_norm import AllHeadsRMSNorm
from fastllm.parallel.process_group import setup_distributed
from fastllm.parallel.tensor import TensorDimension

distributed = setup_distributed()


def check(rank: int) -> None:
    size, heads, head_size, epsilon = 2, 6, 4, 1e-6
    tp = TensorDimension(size, rank, dist.group.WORLD)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, heads, head_size, generator=generator)
    weight = 1 + 0.3 * torch.randn(heads * head_size, generator=generator)
    out_grad = torch.randn(2, 5, heads, head_size, generator=generator)

    whole_x, whole_weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    expected = F.rms_norm(whole_x.flatten(-2), (heads * head_size,), whole_weight, epsilon)
    (expected * out_grad.flatten(-2)).sum().backward()

    mine = slice(rank * heads // size, (rank + 1) * heads // size)
    norm = AllHeadsRMSNorm(RMSNormConfig(epsilon=epsilon), heads // size, head_size, tp)
    with torch.no_grad():
        norm.weight.copy_(weight.view(heads, head_size)[mine].flatten())
    ours_x = x[:, :, mine].clone().requires_grad_()
    out = norm(ours_x)
    (out * out_grad[:, :, mine]).sum().backward()
    torch.testing.assert_close(out, expected.view_as(x)[:, :, mine])
    torch.testing.assert_close(ours_x.grad, whole_x.grad[:, :, mine])
    torch.testing.assert_close(norm.weight.grad, whole_weight.grad.view(heads, head_size)[mine].flatten())


check(distributed.rank)
dist.barrier()
dist.destroy_process_group()
"""


def test_a_norm_over_all_heads_split_over_tensor_ranks_matches_the_whole_norm(
    two_ranks: CliResult,
) -> None:
    assert two_ranks.returncode == 0, two_ranks.stderr
