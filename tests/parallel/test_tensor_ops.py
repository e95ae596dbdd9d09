"""The vocab-parallel embedding on two Gloo processes against torch's embedding of the whole
vocabulary (the vocab-parallel losses: test_vocab_parallel_losses.py)."""

from __future__ import annotations

from tests.data.conftest import CliResult

# Run by the fixture two_ranks (tests/conftest.py).
TWO_RANKS = """
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fastllm.parallel.process_group import setup_distributed
from fastllm.parallel.tensor import TensorDimension, vocab_parallel_embedding

distributed = setup_distributed()


def check(rank: int) -> None:
    # Every tensor here, and the group the autograd graph keeps, is gone when it returns.
    size = 2
    tp = TensorDimension(size, rank, dist.group.WORLD)
    generator = torch.Generator().manual_seed(0)
    hidden_size, vocab = 6, 14
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


def test_vocab_parallel_embedding_matches_torch_on_the_whole_vocabulary(
    two_ranks: CliResult,
) -> None:
    assert two_ranks.returncode == 0, two_ranks.stderr
