from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fastllm_kernels.preference import (
    _pair_chunks,
    linear_dpo,
    linear_dpo_reference,
    linear_sequence_log_probs,
    linear_sequence_log_probs_reference,
)
from tests.kernels.conftest import assert_close, cuda, triton_on_cpu

pytestmark = pytest.mark.usefixtures("poisoned_empty")

# Four pairs over 32 tokens, prompts (-1) between the answers: with chunks of 8 rows, pairs 0
# and 1 (3 and 4 rows) share one, pair 2 (11 rows) is longer than a chunk, pair 3 has its own.
SPANS = [-1, 0, 0, -1, 1, -1, -1, 2, 2, -1, 3, 3, -1, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, -1, 6, 6,
         -1, 7, 7, 7, -1]  # fmt: skip
# TRL's layout: every chosen answer first, then every rejected one (a pair's rows far apart).
TRL_SPANS = [-1, 0, 0, -1, 2, 2, -1, 4, 4, 4, 4, 4, 4, -1, 6, 6, -1, 1, -1, 3, 3, -1, 5, 5, 5, 5,
             5, -1, 7, 7, 7]  # fmt: skip


def _inputs(spans, hidden_size=16, vocab=40, dtype=torch.float32):
    n = len(spans)
    hidden = torch.randn(n, hidden_size).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size) * 2 / hidden_size**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,))
    spans = torch.tensor(spans)
    labels[spans < 0] = -100  # prompts carry no label, as a data pipeline masks them
    return hidden, weight, labels, spans


def _torch_sequence_log_probs(hidden, weight, labels, spans, num_spans):
    """What a user would write: whole fp32 logits, log-softmax, a sum per span."""
    log_probs = torch.log_softmax(hidden.float() @ weight.float().T, dim=-1)
    token = log_probs.gather(-1, labels.clamp(min=0)[:, None])[:, 0]
    return torch.stack([token[spans == s].sum() for s in range(num_spans)])


def _torch_dpo(policy, reference, beta, label_smoothing=0.0, loss_type="sigmoid", tokens=None):
    """The DPO paper's loss (with cDPO's smoothing) and TRL's length-normalized IPO, per pair."""
    chosen, rejected = policy[0::2] - reference[0::2], policy[1::2] - reference[1::2]
    if loss_type == "ipo":
        margin = chosen / tokens[0::2] - rejected / tokens[1::2]
        return ((margin - 1 / (2 * beta)) ** 2).mean()
    margin = beta * (chosen - rejected)
    losses = -(1 - label_smoothing) * F.logsigmoid(margin)
    return (losses - label_smoothing * F.logsigmoid(-margin)).mean()


@triton_on_cpu
@pytest.mark.parametrize("chunk_size", [3, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sequence_log_probs_sum_each_spans_token_log_probs(chunk_size, dtype):
    hidden, weight, labels, spans = _inputs(SPANS, dtype=dtype)
    with torch.no_grad():
        ours = linear_sequence_log_probs(hidden, weight, labels, spans, 9, chunk_size=chunk_size)
    expected = _torch_sequence_log_probs(hidden, weight, labels, spans, 9)
    assert ours.dtype == torch.float32 and not ours.requires_grad
    assert_close(ours, expected, rtol=1e-5, atol=1e-4)
    assert ours[8] == 0  # a span without tokens
    reference = linear_sequence_log_probs_reference(hidden, weight, labels, spans, 9)
    assert_close(reference, expected, rtol=1e-5, atol=1e-4)


@triton_on_cpu
@pytest.mark.parametrize("spans", [SPANS, TRL_SPANS], ids=["pairs-in-order", "trl-layout"])
@pytest.mark.parametrize(
    ("loss_type", "label_smoothing", "chunk_size"),
    [("sigmoid", 0.0, 8), ("sigmoid", 0.2, 1), ("sigmoid", 0.0, None), ("ipo", 0.0, 8)],
)
def test_dpo_loss_and_gradients_match_the_formula_through_autograd(
    spans, loss_type, label_smoothing, chunk_size
):
    hidden, weight, labels, spans = _inputs(spans)
    reference = torch.randn(8) - 12.0
    beta = 0.3
    loss, metrics = linear_dpo(hidden, weight, labels, spans, reference, beta, label_smoothing,
                               loss_type, chunk_size=chunk_size)  # fmt: skip
    policy = _torch_sequence_log_probs(hidden, weight, labels, spans, 8)
    tokens = torch.bincount(spans[spans >= 0], minlength=8).float()
    expected = _torch_dpo(policy, reference, beta, label_smoothing, loss_type, tokens)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(3.0 * loss, [hidden, weight])
    expected_grads = torch.autograd.grad(3.0 * expected, [hidden, weight])
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)
    chosen, rejected = (
        beta * (policy[0::2] - reference[0::2]),
        beta * (policy[1::2] - reference[1::2]),
    )
    expected_metrics = {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/accuracies": (chosen > rejected).float().mean(),
        "rewards/margins": (chosen - rejected).mean(),
        "logps/chosen": policy[0::2].mean(),
        "logps/rejected": policy[1::2].mean(),
    }
    assert metrics.keys() == expected_metrics.keys()
    for name, value in metrics.items():
        assert not value.requires_grad
        assert_close(value, expected_metrics[name].detach(), rtol=1e-5, atol=1e-5)
    reference_loss, _ = linear_dpo_reference(hidden, weight, labels, spans, reference, beta,
                                             label_smoothing, loss_type)  # fmt: skip
    assert_close(reference_loss, expected, rtol=1e-5, atol=1e-5)


@triton_on_cpu
def test_dpo_is_log_2_when_the_policy_is_the_reference():
    hidden, weight, labels, spans = _inputs(SPANS)
    with torch.no_grad():
        reference = linear_sequence_log_probs(hidden, weight, labels, spans, 8, chunk_size=5)
    loss, metrics = linear_dpo(hidden, weight, labels, spans, reference, 0.1, chunk_size=8)
    assert_close(loss, torch.tensor(math.log(2.0)), rtol=1e-6, atol=1e-6)
    assert metrics["rewards/margins"].abs() < 1e-6
    expected, _ = linear_dpo_reference(hidden, weight, labels, spans, reference, 0.1)
    grads = torch.autograd.grad(loss, [hidden, weight])
    for grad, expected_grad in zip(
        grads, torch.autograd.grad(expected, [hidden, weight]), strict=True
    ):
        assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)


@triton_on_cpu
def test_dpo_bf16():
    hidden, weight, labels, spans = _inputs(SPANS, hidden_size=32, vocab=300, dtype=torch.bfloat16)
    reference = torch.randn(8) - 40.0
    loss, _ = linear_dpo(hidden, weight, labels, spans, reference, 0.05, chunk_size=8)
    expected, _ = linear_dpo_reference(hidden, weight, labels, spans, reference, 0.05)
    assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(loss, [hidden, weight])
    for grad, expected_grad, x in zip(grads, torch.autograd.grad(expected, [hidden, weight]),
                                      [hidden, weight], strict=True):  # fmt: skip
        assert grad.dtype == torch.bfloat16
        # Compared at the scale of the largest entry: one bf16 rounding of a sum.
        assert_close(
            grad, expected_grad.to(x.dtype), rtol=2e-2, atol=2e-2 * expected_grad.abs().max().item()
        )


@triton_on_cpu
def test_dpo_under_no_grad_forms_no_gradient():
    hidden, weight, labels, spans = _inputs(SPANS)
    with torch.no_grad():
        loss, _ = linear_dpo(hidden, weight, labels, spans, torch.zeros(8), 0.1, chunk_size=8)
    assert not loss.requires_grad
    expected, _ = linear_dpo_reference(hidden, weight, labels, spans, torch.zeros(8), 0.1)
    assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-5)


def test_chunks_hold_whole_pairs_and_a_long_pair_alone():
    # rows per pair: 3, 2, 6 (longer than the chunk), 0, 1, 1
    assert _pair_chunks([3, 2, 6, 0, 1, 1], 4) == [
        (0, 1, 0, 3), (1, 2, 3, 5), (2, 3, 5, 11), (3, 6, 11, 13)
    ]  # fmt: skip
    assert _pair_chunks([1, 1, 1], 8) == [(0, 3, 0, 3)]
    assert _pair_chunks([0, 0], 8) == []


@pytest.mark.parametrize(
    ("reference", "options", "message"),
    [
        (torch.zeros(8), {"loss_type": "hinge"}, "loss_type"),
        (torch.zeros(7), {}, "reference_log_probs"),
        (torch.zeros(8), {"label_smoothing": 0.5}, "label_smoothing"),
        (torch.zeros(8), {"loss_type": "ipo", "label_smoothing": 0.1}, "label_smoothing"),
        (torch.zeros(6), {}, "spans"),  # span ids up to 7 for three pairs
    ],
)
def test_dpo_refuses_bad_arguments(reference, options, message, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    hidden, weight, labels, spans = _inputs(SPANS)
    with pytest.raises(ValueError, match=message):
        linear_dpo(hidden, weight, labels, spans, reference, 0.1, **options)


@pytest.mark.gpu
@cuda
def test_dpo_at_llama3_vocabulary_matches_the_reference():
    # 8 pairs of 512-token answers after 512-token prompts, a 128K vocabulary, chunks of 2048
    # rows: two pairs a chunk.
    pairs, length, hidden_size, vocab = 8, 512, 1024, 128256
    spans = torch.full((pairs, 3, length), -1)
    spans[:, 1] = (2 * torch.arange(pairs))[:, None]
    spans[:, 2] = (2 * torch.arange(pairs) + 1)[:, None]
    spans = spans.view(-1).cuda()
    hidden = torch.randn(spans.shape[0], hidden_size, device="cuda").bfloat16().requires_grad_()
    weight = (torch.randn(vocab, hidden_size, device="cuda") / hidden_size**0.5).bfloat16()
    weight.requires_grad_()
    labels = torch.randint(0, vocab, spans.shape, device="cuda").masked_fill(spans < 0, -100)
    with torch.no_grad():
        reference = linear_sequence_log_probs(hidden, weight, labels, spans, 2 * pairs) + 1.0
    expected_reference = linear_sequence_log_probs_reference(hidden, weight, labels, spans, 16)
    assert_close(reference - 1.0, expected_reference, rtol=1e-4, atol=1e-2)
    loss, _ = linear_dpo(hidden, weight, labels, spans, reference, 0.1)
    expected, _ = linear_dpo_reference(hidden, weight, labels, spans, reference, 0.1)
    assert_close(loss, expected, rtol=1e-4, atol=1e-4)
    grads = torch.autograd.grad(loss, [hidden, weight])
    for grad, expected_grad in zip(
        grads, torch.autograd.grad(expected, [hidden, weight]), strict=True
    ):
        scale = expected_grad.abs().max().item()
        assert_close(grad, expected_grad.bfloat16(), rtol=2e-2, atol=1e-2 * scale)
