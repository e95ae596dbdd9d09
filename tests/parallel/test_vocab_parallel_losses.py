"""The vocab-parallel label loss and z-loss, sequence log-probabilities, DPO and distillation on
two Gloo processes against the one-process ops on the whole vocabulary: values and gradients
(the weight's through a gradient sink for the label losses and DPO)."""

from __future__ import annotations

from tests.data.conftest import CliResult

# Run by the fixture two_ranks (tests/conftest.py).
TWO_RANKS = """
import torch
import torch.distributed as dist
from fastllm.parallel.process_group import setup_distributed
from fastllm.parallel.tensor import TensorDimension, enter
from fastllm.parallel.vocab_parallel_losses import (
    vocab_parallel_distillation, vocab_parallel_dpo, vocab_parallel_label_losses,
    vocab_parallel_sequence_log_probs,
)
from fastllm_kernels.cross_entropy import linear_label_losses
from fastllm_kernels.distillation import linear_distillation
from fastllm_kernels.preference import linear_dpo, linear_sequence_log_probs
from fastllm_kernels.recipe import WeightRecipe

distributed = setup_distributed()


def grads(loss, hidden, weight):
    return torch.autograd.grad(loss, [hidden, weight], allow_unused=True)


def check(rank: int) -> None:
    # Every tensor here, and the group the autograd graph keeps, is gone when it returns.
    size = 2
    tp = TensorDimension(size, rank, dist.group.WORLD)
    generator = torch.Generator().manual_seed(0)
    hidden_size, teacher_size, vocab = 6, 10, 14
    # Three pairs, prompts (-1) between; pair 1 (7 rows) longer than the chunks of 4.
    spans = torch.tensor([-1, 0, 0, 1, -1, 2, 2, 2, 3, 3, 3, 3, -1, 4, 5, 5])
    tokens = spans.shape[0]
    hidden = torch.randn(tokens, hidden_size, generator=generator)
    weight = torch.randn(vocab, hidden_size, generator=generator) * 2
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    labels[1], labels[2] = 0, vocab - 1  # the first and last ids, on different ranks
    labels[spans < 0] = -100
    reference = torch.randn(6, generator=generator) - 10.0
    local_weight = weight.chunk(size)[rank]

    # The label losses: the cross-entropy alone, mixed with the z-loss, the z-loss alone; the
    # prompts' labels are ignored, and chunks of 5 rows.
    for label_weight, z_loss in [(1.0, 0.0), (0.5, 0.02), (0.0, 0.1)]:
        weights = {"label_weight": label_weight, "z_loss": z_loss}
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        expected, expected_parts = linear_label_losses(h, w, labels, **weights)
        expected_grads = grads(expected, h, w)
        h, w = hidden.clone().requires_grad_(), local_weight.clone().requires_grad_()
        sunk = torch.empty(w.shape)
        recipe = WeightRecipe(gradient_sink=lambda product: product(sunk, False))
        loss, parts = vocab_parallel_label_losses(enter(h, tp), w, labels, tp, recipe=recipe,
                                                  chunk_size=5, **weights)
        torch.testing.assert_close(loss, expected)
        torch.testing.assert_close(parts, expected_parts)
        hidden_grad, weight_grad = grads(loss, h, w)
        torch.testing.assert_close(hidden_grad, expected_grads[0])
        assert weight_grad is None  # in the sink
        torch.testing.assert_close(sunk, expected_grads[1].chunk(size)[rank])

    expected = linear_sequence_log_probs(hidden, weight, labels, spans, 6)
    ours = vocab_parallel_sequence_log_probs(hidden, local_weight, labels, spans, 6, tp, chunk_size=4)
    torch.testing.assert_close(ours, expected)

    for loss_type, smoothing in [("sigmoid", 0.1), ("ipo", 0.0)]:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        expected, expected_metrics = linear_dpo(h, w, labels, spans, reference, 0.2, smoothing, loss_type)
        expected_grads = grads(expected, h, w)
        h, w = hidden.clone().requires_grad_(), local_weight.clone().requires_grad_()
        sunk = torch.empty(w.shape)
        recipe = WeightRecipe(gradient_sink=lambda product: product(sunk, False))
        loss, metrics = vocab_parallel_dpo(enter(h, tp), w, labels, spans, reference, tp, 0.2,
                                           smoothing, loss_type, recipe=recipe, chunk_size=4)
        hidden_grad, weight_grad = grads(loss, h, w)
        torch.testing.assert_close(loss, expected)
        for name, value in metrics.items():
            torch.testing.assert_close(value, expected_metrics[name])
        torch.testing.assert_close(hidden_grad, expected_grads[0])
        assert weight_grad is None  # in the sink
        torch.testing.assert_close(sunk, expected_grads[1].chunk(size)[rank])

    teacher_hidden = torch.randn(tokens, teacher_size, generator=generator)
    teacher_weight = torch.randn(vocab, teacher_size, generator=generator)
    mask = spans >= 0
    for loss_type in ["forward_kl", "reverse_kl", "cross_entropy"]:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        expected = linear_distillation(h, w, teacher_hidden, teacher_weight, mask, 2.0, loss_type)
        expected_grads = grads(expected, h, w)
        h, w = hidden.clone().requires_grad_(), local_weight.clone().requires_grad_()
        loss = vocab_parallel_distillation(
            enter(h, tp), w, teacher_hidden, teacher_weight.chunk(size)[rank], mask, tp, 2.0,
            loss_type, chunk_size=5,
        )
        torch.testing.assert_close(loss, expected)
        hidden_grad, weight_grad = grads(loss, h, w)
        torch.testing.assert_close(hidden_grad, expected_grads[0])
        torch.testing.assert_close(weight_grad, expected_grads[1].chunk(size)[rank])


check(distributed.rank)
# No Gloo thread, nor a tensor or group of the check, may outlive the script into interpreter
# shutdown (releasing them there can abort the process).
dist.barrier()
dist.destroy_process_group()
"""


def test_vocab_parallel_head_losses_match_the_one_process_ops(
    two_ranks: CliResult,
) -> None:
    assert two_ranks.returncode == 0, two_ranks.stderr
