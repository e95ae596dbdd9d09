"""Sequence-data parallelism on two Gloo processes against the whole sequence in one, with
contiguous and head-tail chunks: the positions and document ids each rank's layers see are
the slices of the whole sequence's, and the chunks' losses and gradients, weighted by their
tokens and summed, are the whole sequence's."""

from __future__ import annotations

from tests.data.conftest import CliResult

# Run by the fixture two_ranks (tests/conftest.py).
TWO_RANKS = """
import torch
import torch.distributed as dist
import fastllm.model.attend as attention_module
from fastllm.config import BaseModelConfig, build
from fastllm.parallel.process_group import setup_distributed
from fastllm.parallel.dimension import Dimension
from fastllm.parallel.mesh import ParallelMesh
from fastllm.parallel.sequence_data import SequenceDataDimension
from fastllm.parallel.tensor import TensorDimension
from fastllm.model import GPTModel
from fastllm.model.rotary import RotaryTables, positions_in_documents

distributed = setup_distributed()


class Spy:
    # What the layers are given: the rotary positions and the attention's document ids.
    def __init__(self):
        self.positions, self.documents = [], []
        rotary, attention = RotaryTables.forward, attention_module.attention

        def rotary_spy(tables, positions):
            self.positions.append(positions)
            return rotary(tables, positions)

        def attention_spy(*args, **kwargs):
            self.documents.append(kwargs.get("document_ids"))
            return attention(*args, **kwargs)

        RotaryTables.forward, attention_module.attention = rotary_spy, attention_spy
        self.restore = lambda: (
            setattr(RotaryTables, "forward", rotary),
            setattr(attention_module, "attention", attention),
        )


def check(rank: int, chunking: str) -> None:
    config = build(BaseModelConfig, {
        "vocab_size": 64, "tie_word_embeddings": False,
        "transformer": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                        "head_groups": 2, "gated": True, "window_size": 11},
    })
    generator = torch.Generator().manual_seed(0)
    whole = GPTModel(config)
    for parameter in whole.parameters():
        parameter.data = torch.randn(parameter.shape, generator=generator) * 0.3
    sdp = SequenceDataDimension(2, rank, dist.group.WORLD, chunking)
    data = Dimension(2, rank, dist.group.WORLD)
    ours = GPTModel(config, ParallelMesh(2, rank, TensorDimension(), data, Dimension(), sdp))
    ours.load_state_dict(whole.state_dict())
    input_ids = torch.randint(0, 64, (2, 16), generator=generator)
    labels = torch.randint(0, 64, (2, 16), generator=generator)
    labels[0, 9:12] = -100
    # Documents that cross the chunks' borders (at 8; head-tail: 4, 8, 12) and one that
    # starts on one.
    documents = torch.tensor([[0] * 5 + [1] * 6 + [2] * 5, [0] * 8 + [1] * 8])
    for document_ids in (None, documents):
        expected = whole.loss(input_ids, labels, document_ids=document_ids)
        expected_grads = torch.autograd.grad(expected, list(whole.parameters()))
        spy = Spy()
        try:
            loss = ours.loss(
                sdp.chunk(input_ids),
                sdp.chunk(labels),
                document_ids=None if document_ids is None else sdp.prefix(document_ids),
            )
        finally:
            spy.restore()
        # This rank's positions, and where each of its chunks' attention calls ends its keys.
        if chunking == "contiguous":
            mine, ends = torch.arange(8 * rank, 8 * rank + 8), [8 * (rank + 1)]
        else:  # chunks rank and 3 - rank of four
            head, tail = 4 * rank, 4 * (3 - rank)
            mine = torch.cat([torch.arange(head, head + 4), torch.arange(tail, tail + 4)])
            ends = [head + 4, tail + 4]
        assert torch.equal(sdp.chunk(input_ids), input_ids[:, mine])
        if document_ids is None:
            expected_positions = mine
        else:
            expected_positions = positions_in_documents(document_ids)[:, mine]
        assert len(spy.positions) == 1 and len(spy.documents) == 2 * len(ends)
        assert torch.equal(spy.positions[0], expected_positions), spy.positions
        for seen, end in zip(spy.documents, ends * 2):
            if document_ids is None:
                assert seen is None
            else:
                assert torch.equal(seen, document_ids[:, :end])
        # Each chunk's mean loss, weighted by its share of the trained tokens, summed.
        share = (sdp.chunk(labels) != -100).sum() / (labels != -100).sum()
        grads = torch.autograd.grad(loss * share, list(ours.parameters()))
        total = (loss * share).detach()
        dist.all_reduce(total)
        torch.testing.assert_close(total, expected.detach(), rtol=1e-5, atol=1e-6)
        for (name, _), grad, expected_grad in zip(
            ours.named_parameters(), grads, expected_grads, strict=True
        ):
            grad = grad.clone()
            dist.all_reduce(grad)
            torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6, msg=name)


for chunking in ("contiguous", "head_tail"):
    check(distributed.rank, chunking)
dist.barrier()
dist.destroy_process_group()
"""


def test_chunks_see_slices_of_the_whole_sequence_and_sum_to_its_loss_and_gradients(
    two_ranks: CliResult,
) -> None:
    assert two_ranks.returncode == 0, two_ranks.stderr
