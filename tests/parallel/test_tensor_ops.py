"""The vocab-parallel embedding and cross-entropy on two Gloo processes against torch's
embedding and `cross_entropy` on the whole vocabulary: values and gradients."""

from __future__ import annotations

from tests.data.conftest import CliResult

# Run by the fixture two_ranks (tests/conftest.py).
TWO_RANKS = """
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fastllm.parallel.process_group import setup_distributed
from fastllm.parallel.tensor import (
    TensorDimension, enter, vocab_parallel_cross_entropy, vocab_parallel_embedding,
)

distributed = setup_distributed()


def check(rank: int) -> None:
    # Every tensor here, and the group the autograd graph keeps, is gone when it returns.
    size = 2
    tp = TensorDimension(size, rank, dist.group.WORLD)
    generator = torch.Generator().manual_seed(0)
    tokens, hidden_size, vocab = 10, 6, 14
    hidden = torch.randn(tokens, hidden_size, generator=generator, dtype=torch.float32)
    weight = torch.randn(vocab, hidden_size, generator=generator, dtype=torch.float32) * 3
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    labels[[2, 7]] = -100  # ignored
    labels[0], labels[1] = 0, vocab - 1  # the first and last ids, on different ranks

    reference_hidden = hidden.clone().requires_grad_()
    reference_weight = weight.clone().requires_grad_()
    expected = F.cross_entropy(reference_hidden @ reference_weight.T, labels, ignore_index=-100)
    expected.backward()

    ours_hidden = hidden.clone().requires_grad_()
    ours_weight = weight.chunk(size)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(enter(ours_hidden, tp), ours_weight, labels, tp)
    loss.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(ours_hidden.grad, reference_hidden.grad)
    torch.testing.assert_close(ours_weight.grad, reference_weight.grad.chunk(size)[rank])

    table = torch.randn(vocab, hidden_size, generator=generator, dtype=torch.float32)
    ids = torch.randint(0, vocab, (2, 5), generator=generator)
    torch.testing.assert_close(
        vocab_parallel_embedding(ids, table.chunk(size)[rank], tp), F.embedding(ids, table)
    )


check(distributed.rank)
# No Gloo thread, nor a tensor or group of the check, may outlive the script into interpreter
# shutdown (releasing them there can abort the process).
dist.barrier()
dist.destroy_process_group()
"""


def test_vocab_parallel_embedding_and_cross_entropy_match_torch_on_the_whole_vocabulary(
    two_ranks: CliResult,
) -> None:
    assert two_ranks.returncode == 0, two_ranks.stderr
